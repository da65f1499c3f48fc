"""One interface for frames of tensors between services; the implementation is chosen by
the address's scheme: ``tcp://host:port`` (default), ``shm://name``, ``ucx://host:port``,
and, where the hardware exists, ``rdma://DEVICE/PORT/HOST:TCPPORT`` (pyverbs) and
``fhbn://DEVICE/PORT/HOST:TCPPORT`` (CUDA + verbs); ``transports.availability(scheme)``
says why one cannot run here.

    listener = await transports.listen("tcp://0.0.0.0:0", handler, config)
    conn = await transports.connect(listener.address, config)
    await conn.send(Frame(kind=1, header={"layer": 3}, tensors=[q, k, v]))
    frame = await conn.recv()
"""

from __future__ import annotations

from .base import Connection, Handler, Listener, Transport
from .config import TransportConfig
from .errors import (
    AuthError,
    FrameError,
    PeerClosed,
    TransportError,
    TransportTimeout,
    TransportUnavailable,
)
from .frame import Frame
from .registry import availability, get_transport, schemes

__all__ = [
    "AuthError", "Connection", "Frame", "FrameError", "Handler", "Listener", "PeerClosed",
    "Transport", "TransportConfig", "TransportError", "TransportTimeout",
    "TransportUnavailable", "availability", "connect", "get_transport", "install_uvloop",
    "listen", "schemes",
]

_DEFAULT = TransportConfig()


async def listen(address: str, handler: Handler | None = None,
                 config: TransportConfig | None = None) -> Listener:
    """Listen at ``address``; each connection goes to ``handler(conn)`` or to ``accept()``."""
    return await get_transport(address).listen(address, handler, config or _DEFAULT)


async def connect(address: str, config: TransportConfig | None = None) -> Connection:
    """Connect to a listener at ``address`` (handshake and auth included)."""
    return await get_transport(address).connect(address, config or _DEFAULT)


def install_uvloop() -> bool:
    """Use uvloop's event loop policy when uvloop is installed; returns whether it is."""
    try:
        import uvloop
    except ImportError:
        return False
    import asyncio
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True
