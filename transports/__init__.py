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

import importlib
import sys
from typing import TYPE_CHECKING, Any

from .config import TransportConfig
from .errors import (
    AuthError,
    FrameError,
    PeerClosed,
    TransportError,
    TransportTimeout,
    TransportUnavailable,
)

if TYPE_CHECKING:
    from .base import Connection, Handler, Listener, Transport
    from .frame import Frame
    from .registry import availability, get_transport, schemes

# Imported on first use: frames hold torch tensors, and a service that only reads a
# TransportConfig (the scheduler, the gateway: through StackConfig) does not import torch.
_LAZY = {"Connection": "base", "Handler": "base", "Listener": "base", "Transport": "base", "Frame": "frame",
         "availability": "registry", "get_transport": "registry", "schemes": "registry"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


__all__ = [
    "AuthError", "Connection", "Frame", "FrameError", "Handler", "Listener", "PeerClosed",
    "Transport", "TransportConfig", "TransportError", "TransportTimeout",
    "TransportUnavailable", "availability", "connect", "get_transport",
    "listen", "schemes", "torn_frames",
]

_DEFAULT = TransportConfig()


async def listen(address: str, handler: Handler | None = None,
                 config: TransportConfig | None = None) -> Listener:
    """Listen at ``address``; each connection goes to ``handler(conn)`` or to ``accept()``."""
    from .registry import get_transport

    return await get_transport(address).listen(address, handler, config or _DEFAULT)


async def connect(address: str, config: TransportConfig | None = None) -> Connection:
    """Connect to a listener at ``address`` (handshake and auth included)."""
    from .registry import get_transport

    return await get_transport(address).connect(address, config or _DEFAULT)


def torn_frames() -> int:
    """Frames this process received that were torn, read before their sender wrote them
    whole (cuda_ipc's device-ordered frames of a sender that vanished), counted so far:
    every such frame whose copies out are done is checked first. 0 where cuda_ipc was
    never used in this process."""
    module = sys.modules.get(f"{__name__}.cuda_ipc")
    return 0 if module is None else module.torn_frames()
