"""The frame codec: the wire format (version 2) through the Python reference codec, and
the native codec (transports/_wire) producing and accepting the very same bytes."""

from __future__ import annotations

import socket
import struct
import zlib

import msgpack
import pytest
import torch

from lamina.transports import Frame, FrameError
from lamina.transports.frame import (
    MAX_NDIM,
    NATIVE,
    PREAMBLE_SIZE,
    WIRE_DTYPES,
    WIRE_VERSION,
    decode_preamble,
    encode,
    pack_user_header,
    parse_frame,
)

MAX = 1 << 30

native = pytest.mark.skipif(NATIVE is None, reason="native frame codec not built (transports/_wire "
                                                   "needs a C compiler and zlib headers at install)")


def sample_frames() -> list[Frame]:
    g = torch.Generator().manual_seed(0)
    frames = [
        Frame(0, {}, []),
        Frame(1, {"layer": 3, "seq": [1, 2, 3], "name": "résumé"}, [torch.randn(4, 8, generator=g)]),
        Frame(65535, {"empty": True}, [torch.empty(0), torch.empty(3, 0, 2, dtype=torch.int32)]),
        Frame(7, None, [torch.tensor(3.5)]),  # a 0-d tensor
        Frame(2, [1, "x"], [b"raw bytes", bytearray(b"\x00\x01"), memoryview(b"view")]),
        Frame(3, {}, [torch.arange(6, dtype=torch.int64).reshape(2, 3).t()]),  # non-contiguous
        Frame(4, {}, [torch.ones(1, 1, 1, 1, 2, dtype=torch.bool)]),
        Frame(9, {}, [torch.ones(3, requires_grad=True)]),  # sent by value
    ]
    for dtype in WIRE_DTYPES:
        t = torch.randn(3, 5, generator=g).to(dtype) if dtype.is_floating_point or dtype.is_complex \
            else torch.randint(0, 100, (3, 5), generator=g).to(dtype)
        frames.append(Frame(5, {"dtype": str(dtype)}, [t]))
    frames.append(Frame(6, {}, [torch.randn(2, 2, dtype=torch.complex64, generator=g).conj()]))
    frames.append(Frame(8, {}, [torch.ones(*([1] * MAX_NDIM))]))
    return frames


def wire_bytes(frame: Frame, checksum: bool = False) -> bytes:
    head, bufs = encode(frame, checksum_payloads=checksum, max_frame_bytes=MAX)
    return head + b"".join(bytes(memoryview(b).cast("B")) for b in bufs)


def py_parse(data: bytes, out=None) -> Frame:
    pre = decode_preamble(data, MAX)
    return parse_frame(pre, memoryview(data)[PREAMBLE_SIZE:], out)


def assert_same(a: Frame, b: Frame) -> None:
    assert a.kind == b.kind and a.header == b.header and len(a.tensors) == len(b.tensors)
    for x, y in zip(a.tensors, b.tensors):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and y.is_contiguous()
            # Byte for byte (NaNs included); a lazily conjugated input arrives resolved.
            if x.numel():
                x = x.resolve_conj().contiguous().reshape(-1).view(torch.uint8)
                assert torch.equal(x, y.reshape(-1).view(torch.uint8))
        else:
            assert bytes(x) == bytes(y)


def craft(header: bytes, payload: bytes = b"", *, nbufs: int, payload_len: int | None = None,
          flags: int = 0, version: int = WIRE_VERSION) -> bytes:
    """A frame with valid checksums around an arbitrary header (to reach the checks past them)."""
    payload_len = len(payload) if payload_len is None else payload_len
    head = struct.pack("<4sBBHIIQI", b"LMNF", version, flags, 1, len(header), nbufs, payload_len,
                       zlib.crc32(header))
    return head + struct.pack("<I", zlib.crc32(head)) + header + payload


def desc(code: int, dims: tuple[int, ...], nbytes: int, *, crc: int = 0, zero: int = 0) -> bytes:
    return struct.pack("<BBHIQ", code, len(dims), zero, crc, nbytes) + struct.pack(f"<{len(dims)}Q", *dims)


# ---------------------------------------------------------------- the Python codec
@pytest.mark.parametrize("checksum", [False, True])
def test_python_codec_round_trips_every_kind_of_buffer(checksum):
    for frame in sample_frames():
        assert_same(frame, py_parse(wire_bytes(frame, checksum)))


def test_layout_is_the_documented_one():
    data = wire_bytes(Frame(9, {"a": 1}, [torch.zeros(2, 3, dtype=torch.float16), b"xyz"]), True)
    magic, version, flags, kind, hlen, nbufs, plen, hcrc, pcrc = struct.unpack_from("<4sBBHIIQII", data)
    assert (magic, version, flags, kind, nbufs, plen) == (b"LMNF", 2, 1, 9, 2, 12 + 3)
    header = data[32:32 + hlen]
    assert hcrc == zlib.crc32(header) and pcrc == zlib.crc32(data[:28])
    code, ndim, zero, crc, nbytes = struct.unpack_from("<BBHIQ", header)
    assert (code, ndim, zero, nbytes) == (WIRE_DTYPES.index(torch.float16) + 1, 2, 0, 12)
    assert struct.unpack_from("<2Q", header, 16) == (2, 3) and crc == zlib.crc32(bytes(12))
    assert struct.unpack_from("<BBHIQQ", header, 32) == (0, 1, 0, zlib.crc32(b"xyz"), 3, 3)
    assert msgpack.unpackb(header[56:]) == {"a": 1}
    assert data[32 + hlen:] == bytes(12) + b"xyz"


def test_encoder_refuses_what_the_wire_cannot_carry():
    with pytest.raises(FrameError, match="kind"):
        encode(Frame(70000), checksum_payloads=False, max_frame_bytes=MAX)
    with pytest.raises(FrameError, match="msgpack"):
        encode(Frame(1, {"x": object()}), checksum_payloads=False, max_frame_bytes=MAX)
    with pytest.raises(FrameError, match="exceeds max_frame_bytes"):
        encode(Frame(1, {}, [torch.zeros(1024)]), checksum_payloads=False, max_frame_bytes=2048)
    with pytest.raises(FrameError, match="dimensions"):
        encode(Frame(1, {}, [torch.zeros([1] * (MAX_NDIM + 1))]), checksum_payloads=False,
               max_frame_bytes=MAX)
    with pytest.raises(FrameError, match="dtype"):
        encode(Frame(1, {}, [torch.zeros(2, dtype=torch.uint16)]), checksum_payloads=False,
               max_frame_bytes=MAX)


# Headers that pass every checksum but break a rule of the format, with what is reported.
MALFORMED = [
    (craft(desc(1, (2,), 16), bytes(16), nbufs=1), "lacks its user header"),
    (craft(desc(1, (2,), 16)[:20], bytes(16), nbufs=1), "shorter than its buffer descriptors"),
    (craft(desc(1, (2,), 16) + b"\x80", bytes(16), nbufs=2), "shorter than its buffer descriptors"),
    (craft(desc(99, (2,), 16) + b"\x80", bytes(16), nbufs=1), "unknown dtype code 99"),
    (craft(desc(1, (3,), 16) + b"\x80", bytes(16), nbufs=1), "cannot hold 16 bytes"),
    (craft(desc(0, (2, 2), 4) + b"\x80", bytes(4), nbufs=1), "cannot hold 4 bytes"),
    (craft(desc(1, (1 << 62, 1 << 62), 0) + b"\x80", nbufs=1), "cannot hold 0 bytes"),
    (craft(desc(1, (2,), 16, zero=1) + b"\x80", bytes(16), nbufs=1), "malformed buffer descriptor"),
    (craft(desc(1, tuple([1] * 33), 8) + b"\x80", bytes(8), nbufs=1), "malformed buffer descriptor"),
    (craft(desc(1, (2,), 16) + b"\x80", bytes(24), nbufs=1), "disagrees with the preamble"),
    (craft(desc(0, (1 << 63,), 1 << 63) + desc(0, (1 << 63,), 1 << 63) + b"\x80", nbufs=2,
           payload_len=0), "disagrees with the preamble"),
    (craft(b"\xc1", nbufs=0), "malformed frame header"),  # 0xc1: never valid msgpack
    (craft(b"\x80\x80", nbufs=0), "malformed frame header"),  # trailing bytes
    (craft(b"\x80", nbufs=0, version=1), "unsupported wire version 1"),
]


@pytest.mark.parametrize("data,message", MALFORMED)
def test_python_codec_rejects_malformed_headers(data, message):
    with pytest.raises(FrameError, match=message):
        py_parse(data)


def test_python_codec_checks_sizes_before_allocating():
    data = craft(desc(0, (1 << 40,), 1 << 40) + b"\x80", nbufs=1, payload_len=1 << 40)
    with pytest.raises(FrameError, match="exceeds max_frame_bytes"):
        decode_preamble(data, 1 << 30)


# ---------------------------------------------------------------- the native codec
def native_bytes(frame: Frame, checksum: bool = False) -> bytes:
    ring = bytearray(1 << 20)
    user = pack_user_header(frame.header)
    n = NATIVE.write_ring(ring, 0, len(ring), frame.kind, user, frame.tensors, checksum, MAX)
    assert n
    return bytes(ring[:n])


def n_parse(data: bytes, out=None) -> Frame:
    r = NATIVE.parse(data, 0, len(data), MAX, out)
    assert type(r) is tuple and r[1] == len(data)
    return r[0]


def native_eligible(frame: Frame) -> bool:
    return all(not (isinstance(t, torch.Tensor) and (not t.is_contiguous() or t.is_complex()))
               for t in frame.tensors)


@native
@pytest.mark.parametrize("checksum", [False, True])
def test_native_codec_writes_the_same_bytes_and_reads_both(checksum):
    for frame in sample_frames():
        reference = wire_bytes(frame, checksum)
        if native_eligible(frame):
            assert native_bytes(frame, checksum) == reference
        else:  # the Python path handles these: the native one declines, writing nothing
            ring = bytearray(1024)
            assert NATIVE.write_ring(ring, 0, 1024, frame.kind, pack_user_header(frame.header),
                                     frame.tensors, checksum, MAX) is None
            assert ring == bytearray(1024)
        assert_same(frame, n_parse(reference))


@native
def test_native_send_writes_the_frame_on_the_socket():
    a, b = socket.socketpair()
    with a, b:
        frame = Frame(5, {"k": [1, 2]}, [torch.arange(10, dtype=torch.float32), b"tail"])
        assert NATIVE.send(a.fileno(), frame.kind, pack_user_header(frame.header), frame.tensors,
                           True, MAX) == 0
        expected = wire_bytes(frame, True)
        got = b""
        while len(got) < len(expected):
            got += b.recv(65536)
        assert got == expected
        # Not for the native path: nothing is written, the caller encodes in Python.
        assert NATIVE.send(a.fileno(), 1, b"\x80", [torch.zeros(4, 4).t()], False, MAX) is None
        assert NATIVE.send(a.fileno(), 1, b"\x80", [b"x"] * 33, False, MAX) is None
        with pytest.raises(FrameError, match="kind"):
            NATIVE.send(a.fileno(), -1, b"\x80", [], False, MAX)
        with pytest.raises(FrameError, match="exceeds max_frame_bytes"):
            NATIVE.send(a.fileno(), 1, b"\x80", [bytes(4096)], False, 1024)
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)
        # A socket whose buffer is full takes part of the frame: the rest is reported.
        a.setblocking(False)
        big = torch.zeros(8 << 20, dtype=torch.uint8)
        left = NATIVE.send(a.fileno(), 1, b"\x80", [big], False, MAX)
        assert 0 < left < big.nbytes


@native
def test_native_ring_wraps_around_the_end():
    frame = Frame(3, {"wrap": "yes"}, [torch.arange(40, dtype=torch.int16), b"abc"])
    reference = wire_bytes(frame)
    size = 256
    for start in (0, 5, size - len(reference) // 2, size - 31, size - 1):
        ring = bytearray(size)
        assert NATIVE.write_ring(ring, start, size, frame.kind, pack_user_header(frame.header),
                                 frame.tensors, False, MAX) == len(reference)
        unrolled = (ring[start:] + ring[:start])[:len(reference)]
        assert bytes(unrolled) == reference
        got, n = NATIVE.parse(ring, start, len(reference), MAX, None)
        assert n == len(reference)
        assert_same(frame, got)
    # A frame larger than the space it is given is not written.
    ring = bytearray(size)
    assert NATIVE.write_ring(ring, 0, len(reference) - 1, frame.kind, pack_user_header(frame.header),
                             frame.tensors, False, MAX) == 0
    assert ring == bytearray(size)


@native
def test_native_parse_says_how_much_it_needs():
    data = wire_bytes(Frame(1, {"a": 1}, [torch.ones(100)]))
    assert NATIVE.parse(data, 0, 0, MAX, None) == PREAMBLE_SIZE
    assert NATIVE.parse(data, 0, PREAMBLE_SIZE - 1, MAX, None) == PREAMBLE_SIZE
    for avail in (PREAMBLE_SIZE, len(data) - 1):
        assert NATIVE.parse(data, 0, avail, MAX, None) == len(data)
    assert NATIVE.parse(data, 0, len(data), MAX, None)[1] == len(data)


@native
def test_native_parse_fills_out_buffers_in_place():
    frame = Frame(1, {}, [torch.arange(6, dtype=torch.float32), b"12345", torch.ones(2)])
    data = wire_bytes(frame)
    dest = torch.empty(6)
    raw = bytearray(5)
    got = n_parse(data, [dest, raw])  # the third buffer is allocated
    assert got.tensors[0] is dest and torch.equal(dest, frame.tensors[0])
    assert got.tensors[1] is raw and raw == b"12345"
    assert torch.equal(got.tensors[2], torch.ones(2))
    got = n_parse(data, [None, None, None, "ignored"])
    assert isinstance(got.tensors[1], bytearray)
    with pytest.raises(FrameError, match="out buffer has 20 bytes, frame carries 24"):
        n_parse(data, [torch.empty(5)])
    with pytest.raises(FrameError, match="contiguous"):
        n_parse(data, [torch.empty(12)[::2]])
    with pytest.raises(FrameError, match="writable"):
        n_parse(data, [None, b"12345"])


@native
@pytest.mark.parametrize("data,message", MALFORMED)
def test_native_codec_rejects_malformed_headers(data, message):
    with pytest.raises(FrameError, match=message):
        n_parse(data)


@native
@pytest.mark.parametrize("checksum", [False, True])
def test_both_codecs_agree_on_every_single_byte_corruption(checksum):
    frame = Frame(4, {"layer": 2, "ids": [5, 6]}, [torch.arange(8, dtype=torch.int32), b"payload"])
    data = wire_bytes(frame, checksum)
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x41
        outcomes = []
        for parse in (py_parse, n_parse):
            try:
                outcomes.append(("ok", parse(bytes(bad))))
            except FrameError:
                outcomes.append(("error", None))
            except AssertionError:  # native asks for more bytes than the frame has
                outcomes.append(("error", None))
        assert outcomes[0][0] == outcomes[1][0], f"byte {i}"
        payload_start = len(data) - 32 - 7
        if i < payload_start or checksum:  # preamble and header are always checked
            assert outcomes[0][0] == "error", f"byte {i}"
        else:  # an unchecked payload is delivered as it came, by both
            assert outcomes[0][0] == "ok"
            assert_same(outcomes[0][1], outcomes[1][1])


@native
def test_native_codec_sizes_are_checked_against_the_limit():
    data = wire_bytes(Frame(1, {}, [torch.zeros(1024)]))
    with pytest.raises(FrameError, match="exceeds max_frame_bytes=2048"):
        NATIVE.parse(data, 0, len(data), 2048, None)
    huge = craft(desc(0, (1 << 40,), 1 << 40) + b"\x80", nbufs=1, payload_len=1 << 40)
    with pytest.raises(FrameError, match="exceeds max_frame_bytes"):
        NATIVE.parse(huge, 0, len(huge), MAX, None)
    bad_magic = b"XXXX" + data[4:]
    with pytest.raises(FrameError, match="bad frame magic"):
        NATIVE.parse(bad_magic, 0, len(bad_magic), MAX, None)


def _huge_header_preamble() -> bytes:
    """Only the preamble of a frame that claims a 2 MiB header (checksums valid)."""
    head = struct.pack("<4sBBHIIQI", b"LMNF", WIRE_VERSION, 0, 1, 2 << 20, 0, 0, 0)
    return head + struct.pack("<I", zlib.crc32(head))


def test_a_header_over_the_bound_is_refused_before_it_is_read():
    # A receiver allocates the header before it can check it: the preamble alone decides.
    with pytest.raises(FrameError, match="frame header of 2097152 bytes exceeds"):
        decode_preamble(_huge_header_preamble(), MAX)
    with pytest.raises(FrameError, match="frame header of"):
        encode(Frame(1, {"x": "a" * (2 << 20)}), checksum_payloads=False, max_frame_bytes=MAX)


@native
def test_native_codec_bounds_the_header_the_same_way():
    data = _huge_header_preamble()
    with pytest.raises(FrameError, match="frame header of 2097152 bytes exceeds"):
        NATIVE.parse(data, 0, len(data), MAX, None)
    ring = bytearray(4 << 20)
    with pytest.raises(FrameError, match="frame header of"):
        NATIVE.write_ring(ring, 0, len(ring), 1, pack_user_header({"x": "a" * (2 << 20)}), [], False, MAX)
