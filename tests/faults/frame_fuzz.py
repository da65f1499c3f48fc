"""Hostile and corrupted data-plane frames for the attention workers, from a seeded
random.Random: the frames of tests/faults/test_fuzz_frames.py.

Hostile frames pass every checksum and break the worker's rules (lamina.services.wire,
lamina.services.attention.attention_checks); each gets an ERROR reply. Corrupted frames are a valid
frame's bytes with bytes flipped, cut short or with lengths declared that the bytes
do not hold; the worker may close their connection (the transport's rule).
"""

from __future__ import annotations

import random
import struct
import zlib

import torch

from lamina.services.attention.attention_core import ACCEPTED_DTYPES
from lamina.services.wire import Attend, Kind, StoreKV
from lamina.transports import Frame
from lamina.transports.frame import PREAMBLE, WIRE_DTYPES, byte_view, encode

L, HQ, HKV, D = 30, 9, 3, 64  # the default model (SmolLM2-135M), every KV head on each worker
# What a frame can carry but an attention worker does not take (it converts the float
# dtypes it takes to its own).
_OTHER_DTYPES = [d for d in WIRE_DTYPES if d not in ACCEPTED_DTYPES]
_NOT_AN_INT = ["0", 0.0, 1.5, None, [0], {"layer": 0}, True, b"\x00"]
_NOT_SEQS = [{}, "s", [["s"]], [[1, 1]], [["s", "1"]], [["s", 1.0]], [["s", None]], None, [["s", 1, 2]], [[]]]
_NOT_TAGS = [None, [], [{"a": 1}], [[1]], [1.5], list(range(9)), "tag", 5]
_NOT_HEADERS = [[1, 2, 3], 7, "header", None, b"\x01\x02", 1.5]


def _rows(n: int, heads: int, dtype: torch.dtype = torch.float32, dim: int = D) -> torch.Tensor:
    return torch.randn(n, heads, dim).to(dtype) if dtype.is_floating_point else torch.zeros(n, heads, dim,
                                                                                              dtype=dtype)


def _unknown_id(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return "ghost-" + str(rng.getrandbits(64))
    if kind == 1:
        return "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randrange(1, 40)))
    if kind == 2:
        return "x" * rng.randrange(1000, 20000)
    return ""


class HostileFrames:
    """Frames for one worker holding `seq` (its own sequence, of `held` tokens)."""

    def __init__(self, rng: random.Random, seq: str, held: int) -> None:
        self.rng = rng
        self.seq = seq
        self.held = held
        self._tags = iter(range(1 << 62))

    def tag(self) -> list:
        return [7, next(self._tags), 0]

    def next(self) -> tuple[list[Frame], list | None]:
        """Frames to send in order, the last answered with ERROR; the tag it echoes
        (None when the frame has no valid tag)."""
        rng = self.rng
        pick = rng.randrange(100)
        tag = self.tag()
        if pick < 50:
            return [self._frame(Kind.ATTEND, tag, *self._bad_attend())], tag
        if pick < 62:  # Q-early: a refused Q is answered when its K, V come
            layer, seqs, q, _, _ = self._bad_attend(touch_q=True)
            kv = self._frame(Kind.ATTEND_KV, tag, layer, seqs, None, _rows(1, HKV), _rows(1, HKV))
            return [self._frame(Kind.ATTEND_Q, tag, layer, seqs, q, None, None), kv], tag
        if pick < 66:  # K, V that name other sequences or another layer than their Q
            q = Attend(Kind.ATTEND_Q, tuple(tag), 0, [(self.seq, 1)], q=_rows(1, HQ))
            kv = Attend(Kind.ATTEND_KV, tuple(tag), rng.randrange(1, L), [(self.seq, 1)], k=_rows(1, HKV),
                        v=_rows(1, HKV))
            if rng.random() < 0.5:
                kv = Attend(Kind.ATTEND_KV, tuple(tag), 0, [(_unknown_id(rng), 1)], k=kv.k, v=kv.v)
            return [q.to_frame(), kv.to_frame()], tag
        if pick < 69:
            kv = Attend(Kind.ATTEND_KV, tuple(tag), 0, [(self.seq, 1)], k=_rows(1, HKV), v=_rows(1, HKV))
            return [kv.to_frame()], tag
        if pick < 84:
            return self._bad_store()
        if pick < 90:
            good = self._frame(Kind.ATTEND, tag, 0, [(self.seq, 1)], _rows(1, HQ), _rows(1, HKV), _rows(1, HKV))
            return [Frame(good.kind, {**good.header, "tag": rng.choice(_NOT_TAGS)}, good.tensors)], None
        if pick < 95:
            good = self._frame(Kind.ATTEND, tag, 0, [(self.seq, 1)], _rows(1, HQ), _rows(1, HKV), _rows(1, HKV))
            return [Frame(good.kind, rng.choice(_NOT_HEADERS), good.tensors)], None
        kind = rng.choice([0, Kind.RESULT, Kind.ACK, Kind.ERROR, rng.randrange(8, 1 << 16)])
        return [Frame(kind, {"tag": tag, "layer": 0}, [_rows(1, HQ)])], tag

    @staticmethod
    def _frame(kind: Kind, tag: list, layer, seqs, q, k, v) -> Frame:
        header = {"v": 2, "tag": tag, "layer": layer, "seqs": [list(s) if isinstance(s, tuple) else s for s in seqs]
                  if isinstance(seqs, list) else seqs}
        tensors = {Kind.ATTEND: [q, k, v], Kind.ATTEND_Q: [q], Kind.ATTEND_KV: [k, v]}[kind]
        return Frame(kind, header, tensors)

    def _bad_attend(self, touch_q: bool = False) -> tuple:
        """(layer, seqs, q, k, v) with one thing wrong (`touch_q`: not in k, v only)."""
        rng, seq = self.rng, self.seq
        layer, seqs, rows = rng.randrange(L), [(seq, 1)], 1
        q, k, v = _rows(1, HQ), _rows(1, HKV), _rows(1, HKV)
        what = rng.choice([w for w in range(15) if not (touch_q and w == 9)])
        if what == 0:
            layer = rng.choice([L, L + 1, 1 << 31, (1 << 63) - 1, -1, -L, -(1 << 63)])
        elif what == 1:
            layer = rng.choice(_NOT_AN_INT)
        elif what == 2:  # rows that do not match the tensors
            seqs = [(seq, rng.randrange(2, 6))]
        elif what == 3:  # more new tokens than the sequence holds
            layer, rows = rng.randrange(1, L), self.held + rng.randrange(1, 4)
            seqs, q, k, v = [(seq, rows)], _rows(rows, HQ), _rows(rows, HKV), _rows(rows, HKV)
        elif what == 4:
            seqs = [(seq, rng.choice([0, -1, -(1 << 63), (1 << 63) - 1]))]
        elif what == 5:
            seqs, q, k, v = [(seq, 1), (seq, 1)], _rows(2, HQ), _rows(2, HKV), _rows(2, HKV)
        elif what == 6:
            seqs = [(_unknown_id(rng), 1)]
        elif what == 7:
            seqs = rng.choice(_NOT_SEQS)
        elif what == 8:
            q = _rows(1, rng.choice([1, HQ - 1, HQ + 1, 3 * HQ]))
        elif what == 9:
            k = v = _rows(1, rng.choice([1, 2, HKV + 1, HQ]))
        elif what == 10:
            dim = rng.choice([1, 32, D - 1, D + 1, 128])
            q, k, v = _rows(1, HQ, dim=dim), _rows(1, HKV, dim=dim), _rows(1, HKV, dim=dim)
        elif what == 11:
            dtype = rng.choice(_OTHER_DTYPES)
            q, k, v = _rows(1, HQ, dtype), _rows(1, HKV, dtype), _rows(1, HKV, dtype)
        elif what == 12:
            q = rng.choice([q[0], q[None], torch.randn(HQ * D), torch.tensor(1.0)])
        elif what == 13:
            q = bytearray(rng.randbytes(rng.randrange(0, 64)))
        else:
            seqs, q = [], q[:0]
        return layer, seqs, q, k, v

    def _bad_store(self) -> tuple[list[Frame], list]:
        rng = self.rng
        seq = _unknown_id(rng) if rng.random() < 0.5 else self.seq
        n = rng.randrange(1, 6)
        layer, num_layers, k, v = 0, L, _rows(n, HKV), _rows(n, HKV)
        what = rng.randrange(7)
        if what == 0:
            layer = rng.choice([L, L + 7, -1, 1 << 40])
        elif what == 1:
            num_layers = rng.choice([0, 1, L - 1, L + 1, 1 << 32, -5])
        elif what == 2:
            v = _rows(n + 1, HKV)
        elif what == 3:
            k = v = _rows(n, rng.choice([1, HKV + 1]))
        elif what == 4:
            k = v = _rows(n, HKV, rng.choice(_OTHER_DTYPES))
        elif what == 5:  # a later layer with no store in progress
            seq, layer = _unknown_id(rng), rng.randrange(1, L)
        else:
            frame = StoreKV(seq, layer, num_layers, k, v).to_frame()
            header = dict(frame.header)
            name = rng.choice(["seq_id", "layer", "num_layers"])
            header[name] = rng.choice([x for x in _NOT_AN_INT + [[seq]] if name != "seq_id" or not isinstance(x, str)])
            return [Frame(Kind.STORE_KV, header, rng.choice([frame.tensors, frame.tensors[:1], []]))], [seq]
        return [StoreKV(seq, layer, num_layers, k, v).to_frame()], [seq]


# -- corrupted bytes ------------------------------------------------------------------------
def frame_bytes(frame: Frame, checksum_payloads: bool) -> bytes:
    head, bufs = encode(frame, checksum_payloads=checksum_payloads, max_frame_bytes=1 << 30)
    return head + b"".join(byte_view(b).tobytes() for b in bufs)


def _with_lengths(data: bytes, header_len: int, payload_len: int) -> bytes:
    """The frame with other lengths declared in its preamble (its checksum made right)."""
    magic, version, flags, kind, _, nbufs, _, header_crc, _ = PREAMBLE.unpack_from(data)
    head = struct.pack("<4sBBHIIQI", magic, version, flags, kind, header_len, nbufs, payload_len, header_crc)
    return head + struct.pack("<I", zlib.crc32(head)) + data[PREAMBLE.size:]


def corrupt(rng: random.Random, data: bytes, max_frame_bytes: int) -> tuple[str, bytes]:
    """A damaged copy of a frame's bytes, and what was done to it."""
    what = rng.randrange(6)
    if what == 0:
        out = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return "flipped bits", bytes(out)
    if what == 1:
        return "truncated", data[:rng.randrange(len(data))]
    if what == 2:
        header_len, payload_len = PREAMBLE.unpack_from(data)[4], PREAMBLE.unpack_from(data)[6]
        if rng.random() < 0.5:
            return "oversized header", _with_lengths(data, min(max_frame_bytes + 1, (1 << 32) - 1), payload_len)
        return "oversized payload", _with_lengths(data, header_len, rng.choice([max_frame_bytes, 1 << 62]))
    if what == 3:
        header_len, payload_len = PREAMBLE.unpack_from(data)[4], PREAMBLE.unpack_from(data)[6]
        return "lengths beyond the bytes", _with_lengths(data, header_len + rng.randrange(0, 64),
                                                         payload_len + rng.randrange(1, 4096))
    if what == 4:
        return "random bytes", rng.randbytes(rng.randrange(1, 256))
    return "a frame then garbage", data + rng.randbytes(rng.randrange(1, 64))
