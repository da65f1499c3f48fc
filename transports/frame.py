"""Frames and their versioned wire format.

Wire layout of one frame (all integers little-endian)::

    preamble (32 bytes)
      magic        4s   b"LMNF"
      version      u8   WIRE_VERSION
      flags        u8   bit 0: payload crc32s are in the buffer descriptors
      kind         u16  Frame.kind
      header_len   u32  bytes of the header that follows
      num_buffers  u32  number of payload buffers after the header
      payload_len  u64  sum of the payload buffers' lengths
      header_crc   u32  crc32 of the header
      preamble_crc u32  crc32 of the 28 bytes before it
    header (header_len bytes)
      num_buffers buffer descriptors, each 16 + 8 * ndim bytes:
        dtype  u8   0: raw bytes; otherwise 1 + the dtype's index in WIRE_DTYPES
        ndim   u8   at most MAX_NDIM (a raw buffer has ndim 1: its length)
        zero   u16
        crc    u32  crc32 of the payload when flags bit 0 is set, else 0
        nbytes u64
        dims   ndim x u64
      the user header: msgpack, the rest of header_len (at least one byte)
    payloads: num_buffers buffers, back to back, each exactly nbytes long

Buffer descriptors are fixed binary records so that native code (transports/_wire,
built from csrc/wire.c) can encode and parse a frame without calling into Python for
them; this module is the reference implementation of the format and the fallback where
the extension is not built, and both produce the same bytes.

Every length is explicit and checked against ``TransportConfig.max_frame_bytes`` before
anything is allocated, and a header (descriptors and user header) may not exceed
``MAX_HEADER_BYTES``, since a receiver allocates it before it can check it; a frame that
fails a check raises ``FrameError``.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch

from .errors import FrameError

log = logging.getLogger(__name__)

MAGIC = b"LMNF"
WIRE_VERSION = 2
FLAG_PAYLOAD_CRC = 1
MAX_NDIM = 32
MAX_HEADER_BYTES = 1 << 20  # csrc/wire.c has the same bound: both codecs refuse the same frames
PREAMBLE = struct.Struct("<4sBBHIIQII")
PREAMBLE_SIZE = PREAMBLE.size  # 32
_PREAMBLE_HEAD = struct.Struct("<4sBBHIIQI")  # everything the preamble crc covers
RAW = "raw"  # dtype tag of a plain byte buffer (received as a bytearray)

# The dtypes a frame can carry; a descriptor's dtype code is 1 + the index here, so this
# order is part of the wire format (append only).
WIRE_DTYPES: tuple[torch.dtype, ...] = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2,
)
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in WIRE_DTYPES}
_DTYPE_NAMES = {d: n for n, d in DTYPES.items()}
_CODES = {d: i + 1 for i, d in enumerate(WIRE_DTYPES)}
_CODE_NAMES = (RAW, *(str(d).removeprefix("torch.") for d in WIRE_DTYPES))
_DESC = struct.Struct("<BBHIQ")  # dtype code, ndim, zero, payload crc, nbytes
DESC_SIZE = _DESC.size  # 16
_DIMS = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]

Buffer = torch.Tensor | bytes | bytearray | memoryview


@dataclass(slots=True)
class Frame:
    """One message: a small typed header and a list of tensors or byte buffers.

    ``kind`` (0..65535) says what the frame is; ``header`` is any msgpack-encodable value
    (normally a dict); ``tensors`` are sent as raw bytes with their dtype and shape.
    Received byte buffers come back as ``bytearray``; received tensors are new CPU
    tensors (or the caller's ``out`` tensors).
    """

    kind: int = 0
    header: Any = field(default_factory=dict)
    tensors: list[Buffer] = field(default_factory=list)


class BufferMeta(NamedTuple):
    dtype: str  # a key of DTYPES, or RAW
    shape: tuple[int, ...]
    nbytes: int


# dtypes numpy can view directly (the fast path); others go through a uint8 view.
_NUMPY_OK = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
    torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
    torch.uint8: np.uint8, torch.bool: np.bool_, torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}


_EMPTY = memoryview(b"")


def tensor_view(t: torch.Tensor) -> memoryview:
    """Flat byte view of a contiguous CPU tensor's memory (no copy)."""
    if t.numel() == 0:
        return _EMPTY
    if t.dtype in _NUMPY_OK:
        return t.numpy().data.cast("B")
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def buffer_view(b: Buffer) -> tuple[int, tuple[int, ...], memoryview]:
    """Dtype code, shape and byte view of one outgoing buffer.

    Non-contiguous tensors are made contiguous (one copy: the wire carries dense bytes);
    device tensors are copied to host by transports that cannot read device memory.
    """
    if isinstance(b, torch.Tensor):
        t = b.detach()  # the wire carries values (and numpy refuses tensors that need grad)
        if not t.is_cpu:
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.is_conj() or t.is_neg():  # lazy views: the wire carries the values
            t = t.resolve_conj().resolve_neg()
        code = _CODES.get(t.dtype)
        if code is None:
            raise FrameError(f"unsupported tensor dtype {t.dtype}")
        return code, tuple(t.shape), tensor_view(t)
    view = memoryview(b).cast("B")
    return 0, (view.nbytes,), view


def buffer_nbytes(buf: Buffer) -> int:
    """Bytes of one of a frame's buffers: a tensor's data, or a byte buffer's length."""
    return buf.numel() * buf.element_size() if isinstance(buf, torch.Tensor) else memoryview(buf).nbytes


def byte_view(buf) -> memoryview:
    """Flat, sliceable byte view of any C-contiguous buffer (numpy array, bytes, view)."""
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


# Tensor dtypes whose numpy view is taken directly on the send fast path, with wire codes
# (complex tensors may be lazily conjugated views: they go through buffer_view).
_FAST_CODES = {d: _CODES[d] for d in _NUMPY_OK if not d.is_complex}


def pack_user_header(header: Any, packer: msgpack.Packer | None = None) -> bytes:
    """The msgpack bytes of a frame's user header (``packer``: a connection's own
    ``msgpack.Packer(use_bin_type=True)``; reusing one saves building one per frame)."""
    try:
        if packer is None:
            return msgpack.packb(header, use_bin_type=True)
        return packer.pack(header)
    except (TypeError, ValueError, OverflowError) as exc:
        if packer is not None:
            packer.reset()  # a failed pack may leave partial output in the packer's buffer
        raise FrameError(f"frame header is not msgpack-encodable: {exc}") from exc


def check_kind(kind: int) -> None:
    if not 0 <= kind <= 0xFFFF:
        raise FrameError(f"frame kind must be in 0..65535, got {kind}")


def encode(frame: Frame, *, checksum_payloads: bool, max_frame_bytes: int,
           packer: msgpack.Packer | None = None, user: bytes | None = None) -> tuple[bytes, list]:
    """Preamble+header bytes and the non-empty payload buffers to send after them.

    Payloads are not copied: each is the tensor's own memory as a numpy array or a
    memoryview (C-contiguous, any shape); ``byte_view`` gives a sliceable byte view of
    one when a transport must split it. ``user``: the header's msgpack bytes when the
    caller has them already (``pack_user_header``).
    """
    kind = frame.kind
    check_kind(kind)
    parts = []
    bufs = []
    payload_len = 0
    for b in frame.tensors:
        # Fast path, the common case: a contiguous CPU tensor numpy can view (the
        # attribute tests alone cost microseconds per frame, so they are ordered cheap first).
        arr: np.ndarray | memoryview
        shape: tuple[int, ...]
        if (type(b) is torch.Tensor and (code := _FAST_CODES.get(b.dtype)) is not None
                and b.is_cpu and b.is_contiguous() and not b.requires_grad):
            arr = b.numpy()
            shape = b.shape
        else:
            code, shape, arr = buffer_view(b)
        n = arr.nbytes
        if len(shape) > MAX_NDIM:
            raise FrameError(f"a frame carries tensors of at most {MAX_NDIM} dimensions, got {len(shape)}")
        # numpy's stubs give ndarray the buffer protocol only from Python 3.12 (mypy checks 3.11).
        crc = zlib.crc32(arr) if checksum_payloads and n else 0  # type: ignore[arg-type]
        parts.append(_DESC.pack(code, len(shape), 0, crc, n))
        if shape:
            parts.append(_DIMS[len(shape)].pack(*shape))
        if n:
            bufs.append(arr)
            payload_len += n
    parts.append(pack_user_header(frame.header, packer) if user is None else user)
    header = b"".join(parts)
    if len(header) > MAX_HEADER_BYTES:
        raise FrameError(f"frame header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    if len(header) + payload_len > max_frame_bytes:
        raise FrameError(
            f"frame of {len(header) + payload_len} bytes exceeds max_frame_bytes={max_frame_bytes}"
        )
    head = _PREAMBLE_HEAD.pack(MAGIC, WIRE_VERSION, FLAG_PAYLOAD_CRC if checksum_payloads else 0,
                               kind, len(header), len(frame.tensors), payload_len, zlib.crc32(header))
    return b"".join((head, _CRC.pack(zlib.crc32(head)), header)), bufs


_CRC = struct.Struct("<I")


class Preamble(NamedTuple):
    flags: int
    kind: int
    header_len: int
    num_buffers: int
    payload_len: int
    header_crc: int


def decode_preamble(data: bytes | bytearray | memoryview, max_frame_bytes: int, offset: int = 0) -> Preamble:
    """The preamble at ``data[offset:offset + PREAMBLE_SIZE]``, checked."""
    magic, version, flags, kind, header_len, nbufs, payload_len, header_crc, pre_crc = \
        PREAMBLE.unpack_from(data, offset)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): corrupted stream")
    if zlib.crc32(data[offset:offset + 28]) != pre_crc:
        raise FrameError("frame preamble checksum mismatch: corrupted frame")
    if version != WIRE_VERSION:
        raise FrameError(f"unsupported wire version {version} (this side speaks {WIRE_VERSION})")
    if header_len + payload_len > max_frame_bytes:
        raise FrameError(
            f"frame of {header_len + payload_len} bytes exceeds max_frame_bytes={max_frame_bytes}"
        )
    if header_len > MAX_HEADER_BYTES:
        raise FrameError(f"frame header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
    # tuple.__new__ skips the named tuple's Python-level constructor (per-frame hot path).
    return _new_tuple(Preamble, (flags, kind, header_len, nbufs, payload_len, header_crc))


_new_tuple = tuple.__new__


# Buffer descriptions already validated, by (dtype code, shape, nbytes): a connection
# carries the same few shapes over and over, and validating one costs microseconds.
_META_CACHE: dict[tuple, BufferMeta] = {}
_META_CACHE_MAX = 4096


def _check_meta(code: int, shape: tuple, nbytes: int) -> BufferMeta:
    if code == 0:
        expected = shape[0] if len(shape) == 1 else -1
    elif code <= len(WIRE_DTYPES):
        expected = math.prod(shape) * WIRE_DTYPES[code - 1].itemsize
    else:
        raise FrameError(f"unknown dtype code {code} in frame header")
    if expected != nbytes:
        raise FrameError(f"buffer of shape {shape} {_CODE_NAMES[code]} cannot hold {nbytes} bytes")
    return BufferMeta(_CODE_NAMES[code], shape, nbytes)


def _unpack_user(data) -> Any:
    if len(data) == 1 and data[0] == 0x80:  # {}: the most common header on the data plane
        return {}
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # malformed msgpack, trailing bytes, nesting too deep
        raise FrameError(f"malformed frame header: {exc}") from exc


def decode_header(pre: Preamble, data: bytes | bytearray | memoryview,
                  ) -> tuple[Any, list[BufferMeta], list[int] | None]:
    """Check and unpack the header; validates every buffer description."""
    if zlib.crc32(data) != pre.header_crc:
        raise FrameError("frame header checksum mismatch: corrupted frame")
    size = len(data)
    metas = []
    crcs = []
    total = 0
    pos = 0
    for _ in range(pre.num_buffers):
        if pos + DESC_SIZE > size:
            raise FrameError("frame header is shorter than its buffer descriptors")
        code, ndim, zero, crc, nbytes = _DESC.unpack_from(data, pos)
        if ndim > MAX_NDIM or zero:
            raise FrameError(f"malformed buffer descriptor (ndim {ndim}, reserved {zero})")
        pos += DESC_SIZE
        if pos + 8 * ndim > size:
            raise FrameError("frame header is shorter than its buffer descriptors")
        key = (code, _DIMS[ndim].unpack_from(data, pos), nbytes)
        pos += 8 * ndim
        meta = _META_CACHE.get(key)
        if meta is None:
            meta = _check_meta(*key)
            if len(_META_CACHE) >= _META_CACHE_MAX:
                _META_CACHE.clear()
            _META_CACHE[key] = meta
        total += nbytes
        metas.append(meta)
        crcs.append(crc)
    if pos >= size:
        raise FrameError("frame header lacks its user header")
    if total != pre.payload_len:
        raise FrameError("frame header disagrees with the preamble's payload length")
    user = _unpack_user(data[pos:])
    return user, metas, (crcs if pre.flags & FLAG_PAYLOAD_CRC else None)


def allocate(meta: BufferMeta, out: Buffer | None = None) -> tuple[Buffer, memoryview]:
    """The object a received buffer is delivered in, and the byte view to receive into.

    ``out`` (a preallocated tensor or writable buffer of exactly ``meta.nbytes`` bytes)
    is used when given; otherwise a new tensor (or bytearray for RAW) is allocated.
    """
    if out is not None:
        if isinstance(out, torch.Tensor):
            if not out.is_contiguous() or out.device.type != "cpu":
                raise FrameError("out tensors must be contiguous CPU tensors")
            view = tensor_view(out)
        else:
            view = memoryview(out).cast("B")
        if view.nbytes != meta.nbytes:
            raise FrameError(f"out buffer has {view.nbytes} bytes, frame carries {meta.nbytes}")
        return out, view
    if meta.dtype == RAW:
        buf = bytearray(meta.nbytes)
        return buf, memoryview(buf)
    dtype = DTYPES[meta.dtype]
    np_dtype = _NUMPY_OK.get(dtype)
    if np_dtype is not None:
        arr: np.ndarray = np.empty(meta.shape, np_dtype)
        return torch.from_numpy(arr), (arr.data.cast("B") if arr.size else _EMPTY)
    t = torch.empty(meta.shape, dtype=dtype)
    return t, tensor_view(t)


def check_payload_crcs(views: Sequence[memoryview], crcs: list[int] | None) -> None:
    if crcs is None:
        return
    for i, (v, c) in enumerate(zip(views, crcs)):
        if zlib.crc32(v) != c:
            raise FrameError(f"payload {i} checksum mismatch: corrupted frame")


class OutViews:
    """Byte views of callers' ``out`` tensors, cached per connection.

    Services receive into the same preallocated tensors frame after frame, and taking a
    tensor's byte view costs more than copying a small payload. An entry is reused only
    for the same tensor object at the same data pointer and size; the cache holds at most
    ``limit`` tensors alive and starts over when full.
    """

    __slots__ = ("_limit", "_views")

    def __init__(self, limit: int = 64) -> None:
        self._views: dict[int, tuple[torch.Tensor, int, memoryview]] = {}
        self._limit = limit

    def get(self, out: Buffer, nbytes: int) -> memoryview:
        if type(out) is torch.Tensor:
            entry = self._views.get(id(out))
            ptr = out.data_ptr()
            if (entry is not None and entry[0] is out and entry[1] == ptr
                    and entry[2].nbytes == nbytes == out.nbytes):  # resize_ keeps the pointer
                return entry[2]
            _, view = allocate(BufferMeta(RAW, (nbytes,), nbytes), out)
            if len(self._views) >= self._limit:
                self._views.clear()
            self._views[id(out)] = (out, ptr, view)
            return view
        return allocate(BufferMeta(RAW, (nbytes,), nbytes), out)[1]


def parse_frame(pre: Preamble, body: memoryview, out: Sequence[Buffer | None] | None,
                out_views: OutViews | None = None) -> Frame:
    """The frame whose header and payloads (``pre.header_len + pre.payload_len`` bytes)
    are all in ``body``: one pass, payloads copied once into their destinations."""
    hlen = pre.header_len
    user, metas, crcs = decode_header(pre, body[:hlen])
    pos = hlen
    buffers: list[Buffer] = []
    for i, meta in enumerate(metas):
        n = meta.nbytes
        dest = out[i] if out is not None and i < len(out) else None
        if dest is None:
            obj, view = allocate(meta)
        else:
            obj = dest
            view = out_views.get(dest, n) if out_views is not None else allocate(meta, dest)[1]
        if n:
            view[:] = body[pos:pos + n]
            if crcs is not None and zlib.crc32(view) != crcs[i]:
                raise FrameError(f"payload {i} checksum mismatch: corrupted frame")
            pos += n
        buffers.append(obj)
    return Frame(pre.kind, user, buffers)


# ---------------------------------------------------------------- native codec
def _alloc(code: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor for a received buffer (called by the native codec)."""
    dtype = WIRE_DTYPES[code - 1]
    np_dtype = _NUMPY_OK.get(dtype)
    if np_dtype is not None:  # numpy allocates faster than torch.empty
        return torch.from_numpy(np.empty(shape, np_dtype))
    return torch.empty(shape, dtype=dtype)


def _load_native():
    """The native codec (transports/_wire, built from csrc/wire.c), set up, or ``None``
    where it is not built or ``LAMINA_NATIVE_FRAMES=0``."""
    if os.environ.get("LAMINA_NATIVE_FRAMES", "1") == "0":
        return None
    try:
        from . import _wire
    except ImportError as exc:
        log.info("native frame codec not built (%s): using the Python codec", exc)
        return None
    _wire.setup(torch.Tensor, tuple(None if d.is_complex else d for d in WIRE_DTYPES),
                tuple(d.itemsize for d in WIRE_DTYPES), Frame,
                functools.partial(msgpack.unpackb, raw=False, strict_map_key=False),
                _alloc, FrameError)
    return _wire


NATIVE = _load_native()
