"""Typed, validated configuration shared by every transport."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class TransportConfig:
    """Settings of one endpoint; validated at construction, passed down explicitly.

    Timeouts are in seconds; ``None`` means wait without limit (a vanished peer is still
    detected through the connection closing, and on TCP through keepalive).
    """

    connect_timeout: float | None = 10.0
    handshake_timeout: float | None = 10.0
    send_timeout: float | None = None
    recv_timeout: float | None = None
    # Largest frame (header + payloads) accepted or sent; larger ones are refused.
    max_frame_bytes: int = 1 << 30
    # Shared cluster secret; when set, peers must prove they know it (HMAC handshake).
    auth_token: str | None = None
    # crc32 of every payload (header and preamble are always checksummed).
    checksum_payloads: bool = False
    # TCP: SO_SNDBUF / SO_RCVBUF; None keeps the kernel's autotuning.
    socket_buffer_bytes: int | None = 4 << 20
    tcp_keepalive_s: int | None = 10
    # Shared memory: bytes of each direction's ring; frames larger than it are streamed.
    shm_ring_bytes: int = 16 << 20
    # UCX: exported as UCX_TLS before UCX starts when set (e.g. "tcp,sm,self").
    ucx_tls: str | None = None

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "handshake_timeout", "send_timeout", "recv_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value!r}")
        if self.max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be at least 1024, got {self.max_frame_bytes}")
        if self.socket_buffer_bytes is not None and self.socket_buffer_bytes < 4096:
            raise ValueError("socket_buffer_bytes must be at least 4096 or None")
        if self.shm_ring_bytes < 64 * 1024 or self.shm_ring_bytes % 4096:
            raise ValueError("shm_ring_bytes must be a multiple of 4096 and at least 64 KiB")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token must be a non-empty string or None")

    def replace(self, **changes) -> "TransportConfig":
        return dataclasses.replace(self, **changes)
