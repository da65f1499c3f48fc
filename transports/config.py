"""Typed, validated configuration shared by every transport."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .polling import default_budget_us


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
    # cuda_ipc: bytes of each direction's ring of device memory; a frame whose CUDA
    # tensors do not fit it at once goes through host memory.
    cuda_ipc_ring_bytes: int = 64 << 20
    # cuda_ipc: a sender records an interprocess event after a frame's copies into its
    # ring and sends the frame at once, the receiver's stream waiting for the event on
    # the device (transports/cuda_ipc.py); False: the sender waits for its copies on the
    # host first, and the receiver's streams never wait on the sender's.
    cuda_ipc_device_order: bool = False
    # Receivers spin this long on the socket or ring before parking in the event loop
    # (0: never). Adaptive: spinning stops on a connection whose peer answers slower
    # than this, and resumes when it is quick again (transports/polling.py). None:
    # derived from the host, 50 while ``busy_processes`` fit its cores, else 0
    # (``busy_poll_budget_us``, polling.default_budget_us).
    busy_poll_us: float | None = None
    # Processes on this host that exchange frames and compute between them (this one and
    # its peers): what an unset ``busy_poll_us`` is derived from. A launcher sets the
    # number it starts; 2 is one process and its peer.
    busy_processes: int = 2
    # Encode and parse frames with the native codec (transports/_wire, csrc/wire.c) where
    # it is built; False keeps the Python codec (same bytes on the wire, several times
    # the per-frame CPU time).
    native_frames: bool = True
    # UCX: exported as UCX_TLS before UCX starts when set (e.g. "tcp,sm,self").
    ucx_tls: str | None = None
    # ucxx progress mode: "blocking" (the event loop waits on UCX's event descriptor),
    # "thread" (a progress thread), "polling" (spins the event loop: lowest latency,
    # one busy core per process) or "thread-polling".
    ucx_progress_mode: str = "blocking"
    # UCX: CUDA tensors sent from device memory where ucxx reports CUDA support and
    # UCX_TLS allows its CUDA transports (transports/ucx.py); False stages them through
    # pinned host memory, as tcp does.
    ucx_device_memory: bool = True

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
        if self.cuda_ipc_ring_bytes < 1 << 20 or self.cuda_ipc_ring_bytes % 4096:
            raise ValueError("cuda_ipc_ring_bytes must be a multiple of 4096 and at least 1 MiB")
        if self.busy_poll_us is not None and not 0 <= self.busy_poll_us <= 10_000:
            raise ValueError(f"busy_poll_us must be in 0..10000 or None, got {self.busy_poll_us!r}")
        if self.busy_processes < 1:
            raise ValueError(f"busy_processes must be at least 1, got {self.busy_processes!r}")
        if self.ucx_progress_mode not in ("blocking", "thread", "polling", "thread-polling"):
            raise ValueError("ucx_progress_mode must be one of blocking, thread, polling, "
                             f"thread-polling; got {self.ucx_progress_mode!r}")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token must be a non-empty string or None")

    @property
    def busy_poll_budget_us(self) -> float:
        """The busy-poll budget in force: ``busy_poll_us`` where set, else derived from the
        host's cores and ``busy_processes``."""
        if self.busy_poll_us is not None:
            return self.busy_poll_us
        return default_budget_us(self.busy_processes)

    def replace(self, **changes) -> TransportConfig:
        return dataclasses.replace(self, **changes)
