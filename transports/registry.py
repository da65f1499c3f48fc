"""Selects a transport implementation from an address or scheme.

Implementations are imported lazily (importing ``transports`` never imports ucxx,
pyverbs or CUDA code); services only use ``transports.connect`` / ``transports.listen``.
"""

from __future__ import annotations

import importlib

from .base import Transport, split_address
from .errors import TransportUnavailable

# scheme -> "module:Class". rdma and fhbn need hardware; availability() says what is missing.
_IMPLEMENTATIONS: dict[str, str] = {
    "tcp": "lamina.transports.tcp:TcpTransport",
    "shm": "lamina.transports.shm:ShmTransport",
    "ucx": "lamina.transports.ucx:UcxTransport",
    "rdma": "lamina.transports.rdma_transport:RdmaTransport",
    "fhbn": "lamina.transports.fhbn:FhbnTransport",
    "cuda_ipc": "lamina.transports.cuda_ipc:CudaIpcTransport",
}


def schemes() -> list[str]:
    return list(_IMPLEMENTATIONS)


def transport_class(scheme: str) -> type[Transport]:
    try:
        target = _IMPLEMENTATIONS[scheme]
    except KeyError:
        raise ValueError(f"unknown transport scheme {scheme!r}; known: {', '.join(_IMPLEMENTATIONS)}") from None
    module_name, cls_name = target.split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def get_transport(address_or_scheme: str) -> Transport:
    """The transport for ``"tcp"`` or ``"tcp://host:port"``; raises TransportUnavailable
    (with the reason) when it cannot run on this machine."""
    scheme = split_address(address_or_scheme)[0] if "://" in address_or_scheme else address_or_scheme.lower()
    cls = transport_class(scheme)
    reason = cls.availability()
    if reason is not None:
        raise TransportUnavailable(f"transport {scheme!r} is unavailable here: {reason}")
    return cls()


def availability(scheme: str) -> str | None:
    """``None`` when ``scheme`` can run here, else why not."""
    return transport_class(scheme).availability()
