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
    SLICE     model -> model      header {tag, slice}; tensors [the slice's graph inputs in its order,
                                  attention output (all but slice 0), context...]: run one slice
                                  for a rotational coordinator (lamina.services.model.slice_server)
    SLICE_OUT model -> model      header {tag}; tensors [q, k, v, context...], or [logits] from the last slice
    FETCH_PREFIX prefill -> prefill header {tag, tokens: [ids], start}: the KV of the longest prefix
                                  of `tokens` the peer's cache holds, from token `start` on
    PREFIX_KV prefill -> prefill  header {tag, num_tokens}; tensors [kv: [L, 2, num_tokens - start,
                                  hkv, D]], or none when the peer holds no more than `start` tokens

A decode tag is [micro_batch, step, layer]; a store tag is [seq_id]; a slice tag is
[micro_batch, step, slice]; a fetch tag is [fetch number].

Decoding is strict: a header that is not a map, a field missing or of the wrong
type, or a raw byte buffer where a tensor belongs raises RemoteError, which the
worker answers with an ERROR frame. The codes of ERROR frames:

    bad_request       the message does not fit: its fields, or its tensors against
                      the worker's model shape (lamina.services.attention.attention_checks)
    protocol          out of the exchange's order: an unknown kind, no tag, an
                      ATTEND_KV without its ATTEND_Q, a STORE_KV layer out of turn
    unknown_sequence  the worker holds no KV for a sequence the message names
    kv_full           the worker's KV memory cannot hold the new tokens
    internal          the worker failed on the message: a case the checks did not foresee (a bug)
"""

from __future__ import annotations

import enum
import logging
import reprlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch

from lamina import transports
from lamina.transports import Frame
from lamina.transports.frame import Buffer

log = logging.getLogger(__name__)

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
    SLICE = 8
    SLICE_OUT = 9
    FETCH_PREFIX = 10
    PREFIX_KV = 11


class RemoteError(RuntimeError):
    """An attention worker refused a request (e.g. its KV memory is full)."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(f"{code}: {message}")


def decode_tag(micro_batch: int, step: int, layer: int) -> Tag:
    return (micro_batch, step, layer)


def slice_tag(micro_batch: int, step: int, slice_index: int) -> Tag:
    return (micro_batch, step, slice_index)


_MAX_TAG_ITEMS = 8
_REPR = reprlib.Repr()  # bounded reprs: a hostile value must not make a long reply
_REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict, _REPR.maxlevel = 60, 60, 6, 6, 2
short_repr = _REPR.repr


async def incoming(conn: transports.Connection, what: str) -> AsyncIterator[Frame]:
    """A served connection's frames until the peer closes it. A corrupted frame or a
    failed socket ends it too (the transport has closed the connection): logged, and
    the service goes on serving its other connections."""
    while True:
        try:
            frame = await conn.recv()
        except transports.PeerClosed:
            return
        except transports.TransportError as exc:
            log.warning("%s connection from %s dropped: %s", what, conn.peer, exc)
            return
        yield frame


def frame_tag(f: Frame) -> Tag:
    """The tag of a frame, as a hashable tuple (msgpack gives lists back): a short list
    of integers and strings, or RemoteError."""
    tag = f.header.get("tag") if isinstance(f.header, dict) else None
    if not (isinstance(tag, (list, tuple)) and 0 < len(tag) <= _MAX_TAG_ITEMS
            and all(isinstance(t, (int, str)) for t in tag)):
        raise RemoteError("protocol", f"frame kind {f.kind} without a tag (a list of up to {_MAX_TAG_ITEMS} "
                                      f"integers and strings), got {short_repr(tag)}")
    return tuple(tag)


def _header(f: Frame) -> dict:
    if not isinstance(f.header, dict):
        raise RemoteError("bad_request", f"frame kind {f.kind}: the header is {type(f.header).__name__}, not a map")
    return f.header


def _field(h: dict, name: str, kind: type) -> Any:
    """Header field `name`, of type `kind` (int excludes bool), or RemoteError."""
    value = h.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        got = "missing" if name not in h else f"{type(value).__name__} {short_repr(value)}"
        raise RemoteError("bad_request", f"header field {name!r} must be {kind.__name__}, got {got}")
    return value


def _tensors(f: Frame, kind: Kind, count: int) -> list[torch.Tensor]:
    if len(f.tensors) != count:
        raise RemoteError("bad_request", f"{kind.name} carries {count} tensors, got {len(f.tensors)}")
    tensors: list[torch.Tensor] = []
    for i, t in enumerate(f.tensors):
        if not isinstance(t, torch.Tensor):
            raise RemoteError("bad_request", f"{kind.name}: buffer {i} is raw bytes, not a tensor")
        tensors.append(t)
    return tensors


def frame_tensors(f: Frame, kind: Kind) -> list[torch.Tensor]:
    """The tensors of a frame whose kind does not fix their count; RemoteError for a raw
    byte buffer among them."""
    return _tensors(f, kind, len(f.tensors))


def result_tensor(f: Frame) -> torch.Tensor:
    """The attention output of a RESULT frame; RemoteError for an ERROR frame, another
    kind, or a RESULT that does not carry exactly one tensor."""
    tensors = expect(f, Kind.RESULT).tensors
    out = tensors[0] if len(tensors) == 1 else None
    if not isinstance(out, torch.Tensor):
        raise RemoteError("protocol", f"RESULT carries {len(tensors)} buffers, not one tensor")
    return out


def _carried(t: torch.Tensor | None, kind: Kind, name: str) -> torch.Tensor:
    """A tensor that a message of `kind` carries by the protocol; RemoteError when it is
    absent (a message built for another kind), never an AttributeError further on."""
    if t is None:
        raise RemoteError("protocol", f"{kind.name} without its {name} tensor")
    return t


def _seqs(h: dict) -> list[tuple[str, int]]:
    seqs = _field(h, "seqs", list)
    if not all(isinstance(m, list) and len(m) == 2 and isinstance(m[0], str)
               and isinstance(m[1], int) and not isinstance(m[1], bool) for m in seqs):
        raise RemoteError("bad_request", f"header field 'seqs' must be a list of [seq_id: str, new tokens: int], "
                                         f"got {short_repr(seqs)}")
    return [(s, n) for s, n in seqs]


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

    @property
    def query(self) -> torch.Tensor:
        """q, which ATTEND and ATTEND_Q carry."""
        return _carried(self.q, self.kind, "q")

    @property
    def key(self) -> torch.Tensor:
        """k, which ATTEND and ATTEND_KV carry."""
        return _carried(self.k, self.kind, "k")

    @property
    def value(self) -> torch.Tensor:
        """v, which ATTEND and ATTEND_KV carry."""
        return _carried(self.v, self.kind, "v")

    def to_frame(self) -> Frame:
        header = {"v": WIRE_VERSION, "tag": list(self.tag), "layer": self.layer, "seqs": [list(s) for s in self.seqs]}
        tensors: list[Buffer]
        if self.kind == Kind.ATTEND:
            tensors = [self.query, self.key, self.value]
        elif self.kind == Kind.ATTEND_Q:
            tensors = [self.query]
        elif self.kind == Kind.ATTEND_KV:
            tensors = [self.key, self.value]
        else:
            raise ValueError(f"an Attend message of kind {self.kind!r}")
        return Frame(kind=self.kind, header=header, tensors=tensors)

    @classmethod
    def from_frame(cls, f: Frame) -> Attend:
        """The message of an ATTEND, ATTEND_Q or ATTEND_KV frame; its fields typed, its
        tensors not yet checked against a model (lamina.services.attention.attention_checks)."""
        h = _header(f)
        kind = Kind(f.kind)
        tensors = _tensors(f, kind, {Kind.ATTEND: 3, Kind.ATTEND_Q: 1, Kind.ATTEND_KV: 2}[kind])
        q = k = v = None
        if kind is Kind.ATTEND:
            q, k, v = tensors
        elif kind is Kind.ATTEND_Q:
            (q,) = tensors
        else:
            k, v = tensors
        return cls(kind, frame_tag(f), _field(h, "layer", int), _seqs(h), q, k, v)


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
        h = _header(f)
        k, v = _tensors(f, Kind.STORE_KV, 2)
        return cls(_field(h, "seq_id", str), _field(h, "layer", int), _field(h, "num_layers", int), k, v)


@dataclass(frozen=True)
class RunSlice:
    """One slice of a micro-batch's step, to run on another model worker."""

    tag: Tag
    slice: int
    tensors: list[torch.Tensor]  # graph inputs (in the slice's order), attention output, context

    def to_frame(self) -> Frame:
        return Frame(kind=Kind.SLICE, header={"v": WIRE_VERSION, "tag": list(self.tag), "slice": self.slice},
                     tensors=list(self.tensors))

    @classmethod
    def from_frame(cls, f: Frame) -> RunSlice:
        h = _header(f)
        tensors = frame_tensors(f, Kind.SLICE)
        return cls(frame_tag(f), _field(h, "slice", int), tensors)


@dataclass(frozen=True)
class FetchPrefix:
    """A request for the KV of a prompt's prefix that another prefill worker caches."""

    tag: Tag
    tokens: list[int]  # the prefix asked for (the peer answers its longest cached part)
    start: int  # tokens the asker holds already: only the KV after them is sent

    def to_frame(self) -> Frame:
        return Frame(kind=Kind.FETCH_PREFIX, header={"v": WIRE_VERSION, "tag": list(self.tag),
                                                     "tokens": self.tokens, "start": self.start}, tensors=[])

    @classmethod
    def from_frame(cls, f: Frame) -> FetchPrefix:
        h = _header(f)
        tokens = _field(h, "tokens", list)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
            raise RemoteError("bad_request", f"header field 'tokens' must be token ids, got {short_repr(tokens)}")
        start = _field(h, "start", int)
        if not 0 <= start <= len(tokens):
            raise RemoteError("bad_request", f"start {start} is outside the {len(tokens)} tokens asked for")
        return cls(frame_tag(f), tokens, start)


@dataclass(frozen=True)
class PrefixKV:
    """A peer's answer to FETCH_PREFIX: it holds the first `num_tokens` tokens' KV."""

    tag: Tag
    num_tokens: int
    kv: torch.Tensor | None  # [L, 2, num_tokens - start, hkv, D]; None when num_tokens <= start

    def to_frame(self) -> Frame:
        return Frame(kind=Kind.PREFIX_KV, header={"v": WIRE_VERSION, "tag": list(self.tag),
                                                  "num_tokens": self.num_tokens},
                     tensors=[] if self.kv is None else [self.kv])

    @classmethod
    def from_frame(cls, f: Frame) -> PrefixKV:
        h = _header(f)
        tensors = frame_tensors(f, Kind.PREFIX_KV)
        if len(tensors) > 1:
            raise RemoteError("bad_request", f"PREFIX_KV carries at most 1 tensor, got {len(tensors)}")
        return cls(frame_tag(f), _field(h, "num_tokens", int), tensors[0] if tensors else None)


def slice_out_frame(tag: Tag, tensors: list[torch.Tensor]) -> Frame:
    return Frame(kind=Kind.SLICE_OUT, header={"v": WIRE_VERSION, "tag": list(tag)}, tensors=list(tensors))


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
