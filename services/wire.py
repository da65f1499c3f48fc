"""Typed data-plane messages between model, prefill and attention workers.

Each message maps to one transport `Frame`: a kind, a small msgpack header and
a list of tensors. Wire version 2; the kinds below are stable numbers.

Every request frame carries a `tag` that its reply echoes, so replies are matched
by id, never by order: several micro-batches share one connection, and their
frames and replies interleave.

    ATTEND    model -> attention  header {tag, layer, seqs: [[seq_id, n_new], ...]}
                                  tensors [q: [T, hq, D], k: [T, hkv, D], v: [T, hkv, D]]
    ATTEND_Q  model -> attention  header {tag, layer, seqs}; tensors [q]   (no reply)
    ATTEND_KV model -> attention  header {tag, layer, seqs}; tensors [k, v]; completes an
                                  ATTEND_Q of the same tag: the worker attends over the KV
                                  it held when Q came, appends K, V, and combines the partials
    RESULT    attention -> model  header {tag}; tensors [out: [T, hq, D]]
    STORE_KV  prefill -> attention header {tag, seq_id, layer, num_layers}; tensors [k, v]: [P, hkv, D]
    ACK       attention -> prefill header {tag}, after the last layer of a STORE_KV
    ERROR     attention -> sender header {tag, code, message}; that request failed, the link stays up

A decode tag is [micro_batch, step, layer]; a store tag is [seq_id].
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from transports import Frame

WIRE_VERSION = 2

Tag = tuple  # (micro_batch, step, layer) for decode frames, (seq_id,) for stores


class Kind(enum.IntEnum):
    ATTEND = 1
    RESULT = 2
    STORE_KV = 3
    ACK = 4
    ERROR = 5
    ATTEND_Q = 6
    ATTEND_KV = 7


class RemoteError(RuntimeError):
    """An attention worker refused a request (e.g. its KV memory is full)."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(f"{code}: {message}")


def decode_tag(micro_batch: int, step: int, layer: int) -> Tag:
    return (micro_batch, step, layer)


def frame_tag(f: Frame) -> Tag:
    """The tag of a frame, as a hashable tuple (msgpack gives lists back)."""
    tag = f.header.get("tag")
    if not isinstance(tag, (list, tuple)):
        raise RemoteError("protocol", f"frame kind {f.kind} without a tag")
    return tuple(tag)


@dataclass(frozen=True)
class Attend:
    """Q, K and V of one layer of a micro-batch's step (any of them may be absent:
    ATTEND_Q carries q only, ATTEND_KV k and v only)."""

    kind: Kind
    tag: Tag
    layer: int
    seqs: list[tuple[str, int]]  # (seq_id, new tokens) in row order
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def to_frame(self) -> Frame:
        header = {"v": WIRE_VERSION, "tag": list(self.tag), "layer": self.layer, "seqs": [list(s) for s in self.seqs]}
        tensors = {Kind.ATTEND: [self.q, self.k, self.v], Kind.ATTEND_Q: [self.q],
                   Kind.ATTEND_KV: [self.k, self.v]}[self.kind]
        return Frame(kind=self.kind, header=header, tensors=tensors)

    @classmethod
    def from_frame(cls, f: Frame) -> Attend:
        h = f.header
        kind = Kind(f.kind)
        expected = {Kind.ATTEND: 3, Kind.ATTEND_Q: 1, Kind.ATTEND_KV: 2}[kind]
        if len(f.tensors) != expected:
            raise RemoteError("bad_request", f"{kind.name} carries {expected} tensors, got {len(f.tensors)}")
        q = k = v = None
        if kind is Kind.ATTEND:
            q, k, v = f.tensors
        elif kind is Kind.ATTEND_Q:
            (q,) = f.tensors
        else:
            k, v = f.tensors
        seqs = [(str(s), int(n)) for s, n in h["seqs"]]
        return cls(kind, frame_tag(f), int(h["layer"]), seqs, q, k, v)


@dataclass(frozen=True)
class StoreKV:
    seq_id: str
    layer: int
    num_layers: int
    k: torch.Tensor
    v: torch.Tensor

    @property
    def tag(self) -> Tag:
        return (self.seq_id,)

    def to_frame(self) -> Frame:
        header = {"v": WIRE_VERSION, "tag": [self.seq_id], "seq_id": self.seq_id, "layer": self.layer,
                  "num_layers": self.num_layers}
        return Frame(kind=Kind.STORE_KV, header=header, tensors=[self.k, self.v])

    @classmethod
    def from_frame(cls, f: Frame) -> StoreKV:
        h = f.header
        k, v = f.tensors
        return cls(str(h["seq_id"]), int(h["layer"]), int(h["num_layers"]), k, v)


def result_frame(tag: Tag, out: torch.Tensor) -> Frame:
    return Frame(kind=Kind.RESULT, header={"v": WIRE_VERSION, "tag": list(tag)}, tensors=[out])


def ack_frame(tag: Tag) -> Frame:
    return Frame(kind=Kind.ACK, header={"v": WIRE_VERSION, "tag": list(tag)}, tensors=[])


def error_frame(tag: Tag | None, code: str, message: str) -> Frame:
    header = {"v": WIRE_VERSION, "code": code, "message": message}
    if tag is not None:
        header["tag"] = list(tag)
    return Frame(kind=Kind.ERROR, header=header, tensors=[])


def expect(f: Frame, kind: Kind) -> Frame:
    """Return the frame if it is of `kind`; raise RemoteError for an ERROR frame."""
    if f.kind == Kind.ERROR:
        raise RemoteError(str(f.header.get("code")), str(f.header.get("message")))
    if f.kind != kind:
        raise RemoteError("protocol", f"expected frame kind {kind.name}, got {f.kind}")
    return f
