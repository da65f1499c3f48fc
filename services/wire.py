"""Typed data-plane messages between model, prefill and attention workers.

Each message maps to one transport `Frame`: a kind, a small msgpack header and
a list of tensors. Wire version 1; the kinds below are stable numbers.

    ATTEND   model -> attention  header {layer, seqs: [[seq_id, n_new], ...], commit}
                                 tensors [q: [T, hq, D], k: [T, hkv, D], v: [T, hkv, D]]
    RESULT   attention -> model  tensors [out: [T, hq, D], lse: [T, hq]]
    STORE_KV prefill -> attention header {seq_id, layer, num_layers}; tensors [k, v]: [P, hkv, D]
    ACK      attention -> prefill after the last layer of a STORE_KV
    ERROR    attention -> sender header {code, message}; the request failed, the link stays up
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from transports import Frame

WIRE_VERSION = 1


class Kind(enum.IntEnum):
    ATTEND = 1
    RESULT = 2
    STORE_KV = 3
    ACK = 4
    ERROR = 5


class RemoteError(RuntimeError):
    """An attention worker refused a request (e.g. its KV memory is full)."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(f"{code}: {message}")


@dataclass(frozen=True)
class Attend:
    layer: int
    seqs: list[tuple[str, int]]  # (seq_id, new tokens) in row order
    commit: bool  # last layer of the step: the new tokens become part of the KV
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def to_frame(self) -> Frame:
        header = {"v": WIRE_VERSION, "layer": self.layer, "seqs": [list(s) for s in self.seqs], "commit": self.commit}
        return Frame(kind=Kind.ATTEND, header=header, tensors=[self.q, self.k, self.v])

    @classmethod
    def from_frame(cls, f: Frame) -> Attend:
        h = f.header
        q, k, v = f.tensors
        return cls(int(h["layer"]), [(str(s), int(n)) for s, n in h["seqs"]], bool(h["commit"]), q, k, v)


@dataclass(frozen=True)
class StoreKV:
    seq_id: str
    layer: int
    num_layers: int
    k: torch.Tensor
    v: torch.Tensor

    def to_frame(self) -> Frame:
        header = {"v": WIRE_VERSION, "seq_id": self.seq_id, "layer": self.layer, "num_layers": self.num_layers}
        return Frame(kind=Kind.STORE_KV, header=header, tensors=[self.k, self.v])

    @classmethod
    def from_frame(cls, f: Frame) -> StoreKV:
        h = f.header
        k, v = f.tensors
        return cls(str(h["seq_id"]), int(h["layer"]), int(h["num_layers"]), k, v)


def result_frame(out: torch.Tensor, lse: torch.Tensor) -> Frame:
    return Frame(kind=Kind.RESULT, header={"v": WIRE_VERSION}, tensors=[out, lse])


def ack_frame() -> Frame:
    return Frame(kind=Kind.ACK, header={"v": WIRE_VERSION}, tensors=[])


def error_frame(code: str, message: str) -> Frame:
    return Frame(kind=Kind.ERROR, header={"v": WIRE_VERSION, "code": code, "message": message}, tensors=[])


def expect(f: Frame, kind: Kind) -> Frame:
    """Return the frame if it is of `kind`; raise RemoteError for an ERROR frame."""
    if f.kind == Kind.ERROR:
        raise RemoteError(str(f.header.get("code")), str(f.header.get("message")))
    if f.kind != kind:
        raise RemoteError("protocol", f"expected frame kind {kind.name}, got {f.kind}")
    return f
