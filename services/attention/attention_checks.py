"""What a data-plane message must satisfy before an attention worker applies it.

The worker decodes a frame into a typed message (lamina.services.wire, which refuses bad
fields) and checks the message here, against its model's shape and its KV state,
before anything changes. A message that fails raises RemoteError, whose code names
the rule it broke, and leaves every sequence as it was: a hostile or broken frame
costs its sender an ERROR reply and nothing else, and the connection stays up.

These are pure functions of the message, the shape and the allocator; they do no
I/O and change nothing.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

import torch

from lamina.kvstore.slab import SlabAllocator
from lamina.services.wire import RemoteError, StoreKV, short_repr


@dataclass(frozen=True)
class KVShape:
    """The tensors one attention worker accepts."""

    num_layers: int
    num_q_heads: int  # the query heads of this worker's KV heads
    num_kv_heads: int
    head_dim: int
    dtypes: tuple[torch.dtype, ...]  # what may arrive (the worker converts it to the dtype of its KV)


@dataclass
class PendingStore:
    """A prefilled sequence whose STORE_KV layers are arriving (layer 0 came, the last not yet)."""

    next_layer: int
    num_tokens: int
    error: RemoteError | None = None  # the store failed (e.g. kv_full): its last layer raises this


def _bad(message: str) -> RemoteError:
    return RemoteError("bad_request", message)


def check_layer(shape: KVShape, layer: int) -> None:
    if not 0 <= layer < shape.num_layers:
        raise _bad(f"layer {layer} is out of range: the model has {shape.num_layers} layers")


def check_tensor(shape: KVShape, name: str, t: torch.Tensor, rows: int, heads: int) -> None:
    """`t` must be [rows, heads, head_dim] of a dtype the worker takes."""
    if t.dtype not in shape.dtypes:
        raise _bad(f"{name} is {t.dtype}; this worker takes {', '.join(map(str, shape.dtypes))}")
    if t.shape != (rows, heads, shape.head_dim):
        raise _bad(f"{name} {tuple(t.shape)} for {rows} new tokens: this worker expects "
                   f"[{rows}, {heads}, {shape.head_dim}]")


def check_attend(shape: KVShape, slabs: SlabAllocator, storing: Container[str], layer: int,
                 seqs: list[tuple[str, int]], q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """A layer's Q (and K, V) for `seqs`, (seq_id, new tokens) in row order.

    Every sequence must be held here whole (not in `storing`, the sequences whose
    prompt KV is still arriving), once, with at least one new token; past layer 0
    (which extends the sequences) a sequence holds its new tokens already, so it
    cannot have more new tokens than tokens: those rows would be another sequence's."""
    check_layer(shape, layer)
    check_members(seqs)
    rows = sum(n for _, n in seqs)
    check_tensor(shape, "q", q, rows, shape.num_q_heads)
    if kv is not None:
        check_tensor(shape, "k", kv[0], rows, shape.num_kv_heads)
        check_tensor(shape, "v", kv[1], rows, shape.num_kv_heads)
    check_held(slabs, storing, layer, seqs)


def check_members(seqs: list[tuple[str, int]]) -> None:
    """At least one sequence, none twice, each with at least one new token."""
    if not seqs:
        raise _bad("no sequences")
    if any(n < 1 for _, n in seqs):
        raise _bad(f"every sequence has at least one new token, got {short_repr(seqs)}")
    if len({s for s, _ in seqs}) != len(seqs):
        raise _bad(f"a sequence appears twice in {short_repr(seqs)}")


def check_held(slabs: SlabAllocator, storing: Container[str], layer: int, seqs: list[tuple[str, int]]) -> None:
    """Every sequence held here whole; past layer 0, none with more new tokens than it holds."""
    unknown = [s for s, _ in seqs if not slabs.has_request(s) or s in storing]
    if unknown:
        # Decoding a sequence whose prompt KV never arrived whole (or was freed) would
        # silently attend over nothing: refuse it.
        raise RemoteError("unknown_sequence", f"no KV for sequence(s) {short_repr(unknown)}")
    if layer > 0:
        over = [(s, n, slabs.num_tokens(s)) for s, n in seqs if n > slabs.num_tokens(s)]
        if over:
            s, n, held = over[0]
            raise _bad(f"{n} new tokens for sequence {short_repr(s)}, which holds {held}")


def check_store(shape: KVShape, msg: StoreKV, pending: PendingStore | None) -> None:
    """One layer of a prefilled sequence's KV. Layer 0 starts a store; every later
    layer continues the store in progress, in order, with as many tokens as layer 0."""
    check_layer(shape, msg.layer)
    if msg.num_layers != shape.num_layers:
        raise _bad(f"num_layers {msg.num_layers}: the model has {shape.num_layers} layers")
    num_tokens = msg.k.shape[0] if msg.k.dim() else 0
    check_tensor(shape, "k", msg.k, num_tokens, shape.num_kv_heads)
    check_tensor(shape, "v", msg.v, num_tokens, shape.num_kv_heads)
    if msg.layer == 0:
        return
    if pending is None:
        raise RemoteError("unknown_sequence", f"layer {msg.layer} of {short_repr(msg.seq_id)} arrived "
                                              f"without its layer 0")
    if msg.layer != pending.next_layer:
        raise RemoteError("protocol", f"layer {msg.layer} of {short_repr(msg.seq_id)} arrived out of turn "
                                      f"(expected layer {pending.next_layer})")
    if num_tokens != pending.num_tokens:
        raise _bad(f"layer {msg.layer} of {short_repr(msg.seq_id)} carries {num_tokens} tokens, "
                   f"layer 0 carried {pending.num_tokens}")
