"""One forward step of a batch (lamina.model.batch.StepBatch) through the split
model, with attention over KV held in this process: the engine's, and the prefill
worker's for its prompts."""

from __future__ import annotations

from itertools import accumulate

import torch

from lamina.engine.kv import KVStore
from lamina.model.attention import causal_attention
from lamina.model.batch import StepBatch
from lamina.model.kv_attention import BufferBatch
from lamina.model.paged_decode import BufferRows, attend_buffers, paged_available
from lamina.model.placement import runs_natively
from lamina.model.slice_graphs import SliceGraphs
from lamina.model.splitter import SplitModel
from lamina.model.step_graphs import StepGraphs

# Sequences with at most this many new tokens attend through the batched kernel; longer
# ones (prompts) through fused SDPA, whose matmuls win from about 16 queries per sequence
# over a few hundred keys (one thread, 9 query and 3 KV heads of 64).
KERNEL_MAX_QUERIES = 8


class LocalAttention:
    """Attention over the engine's own KV store (the attention worker's job, in process).

    Each layer stores the new tokens' K and V in every sequence's buffer with one call,
    then attends the sequences with few new tokens (decoding ones) in one kernel call
    over their buffers in place, and each longer one (a prompt) with fused SDPA."""

    def __init__(self, kv: KVStore, batch: StepBatch) -> None:
        self._batch = batch
        self._seqs = [kv.get(s) for s in batch.seq_ids]
        lens = batch.query_lens
        held = [seq.length for seq in self._seqs]
        self._all = BufferBatch([seq.buf for seq in self._seqs], held, lens)
        small = [b for b, n in enumerate(lens) if n <= KERNEL_MAX_QUERIES]
        self._small = self._all if len(small) == len(lens) else None
        self._small_rows = None  # the rows of q that belong to the small sequences, when not all are
        self._large: list[tuple[int, int, int]] = []  # (sequence, first row, rows) of the others
        self._out: torch.Tensor | None = None  # [T, Hq, D], every layer's output when all are small
        if self._small is None:
            starts = [0, *accumulate(lens)]
            if small:
                self._small = BufferBatch([self._seqs[b].buf for b in small], [held[b] for b in small],
                                          [lens[b] for b in small])
                self._small_rows = torch.cat([torch.arange(starts[b], starts[b] + lens[b]) for b in small])
            self._large = [(b, starts[b], n) for b, n in enumerate(lens) if n > KERNEL_MAX_QUERIES]

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer `layer_id`'s attention output. It is the step's one output tensor where every
        sequence is decoding: the caller reads each layer's before it asks for the next
        (run_step's SplitModel.run)."""
        # q: [T, Hq, D]; k, v: [T, Hkv, D]. Nothing here combines partials, so no lse.
        self._all.append(layer_id, k.contiguous(), v.contiguous())
        q = q.contiguous()
        if self._small is self._all:
            self._out = self._all.attend(layer_id, q, out=self._out)[0]
            return self._out
        out = torch.empty_like(q)
        if self._small is not None:
            out[self._small_rows] = self._small.attend(layer_id, q[self._small_rows])[0]
        for b, start, n in self._large:
            kk, vv = self._all.keys_values(layer_id, b)
            out[start : start + n] = causal_attention(q[start : start + n], kk, vv)
        return out

    def commit(self) -> None:
        for seq, n in zip(self._seqs, self._batch.query_lens):
            seq.length += n


class DeviceAttention:
    """LocalAttention's job on any torch device: each sequence's new K, V are written into
    its buffer and its queries attend with fused SDPA over the buffer's tokens. A GPU's
    prompts take it (and its decode steps where triton is missing: else BufferAttention).
    The batched kernel of LocalAttention reads CPU memory only."""

    def __init__(self, kv: KVStore, batch: StepBatch) -> None:
        self._batch = batch
        self._seqs = [kv.get(s) for s in batch.seq_ids]
        self._starts = [0, *accumulate(batch.query_lens)]

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D], sequences in batch order
        out = torch.empty_like(q)
        for seq, s, e in zip(self._seqs, self._starts, self._starts[1:]):
            keys, values = seq.write(layer_id, k[s:e], v[s:e])  # [held + n, Hkv, D] each
            out[s:e] = causal_attention(q[s:e], keys, values)
        return out

    def commit(self) -> None:
        for seq, n in zip(self._seqs, self._batch.query_lens):
            seq.length += n


class BufferAttention:
    """DeviceAttention's job on a GPU, for a whole batch at once: per layer one launch
    writes every sequence's new K, V into its buffer and one attends every query row over
    its sequence (lamina.model.paged_decode's buffer kernels), where DeviceAttention
    launches a handful of kernels per sequence and layer."""

    def __init__(self, kv: KVStore, batch: StepBatch) -> None:
        self._batch = batch
        self._seqs = [kv.get(s) for s in batch.seq_ids]
        self._rows = BufferRows.of([seq.buf for seq in self._seqs], [seq.length for seq in self._seqs],
                                   batch.query_lens)

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D], sequences in batch order
        return attend_buffers(layer_id, q, k, v, self._rows)

    def commit(self) -> None:
        for seq, n in zip(self._seqs, self._batch.query_lens):
            seq.length += n


# The most new tokens a sequence may have for BufferAttention: its kernel scans a row's
# keys per query row, which suits decode steps; a prompt's many queries go to SDPA.
BUFFER_ATTENTION_ROWS = 16


def in_process_attention(kv: KVStore, batch: StepBatch) -> LocalAttention | DeviceAttention | BufferAttention:
    """The batched kernel where the KV store is CPU float32; on a GPU (triton installed) the
    buffer kernels for decode steps; fused SDPA per sequence anywhere else."""
    device = kv.device or torch.device("cpu")
    if runs_natively(device, kv.dtype):
        return LocalAttention(kv, batch)
    if paged_available(device) and max(batch.query_lens, default=0) <= BUFFER_ATTENTION_ROWS:
        return BufferAttention(kv, batch)
    return DeviceAttention(kv, batch)


def run_step(split: SplitModel, kv: KVStore, batch: StepBatch, graphs: SliceGraphs | None = None,
             step_graphs: StepGraphs | None = None) -> torch.Tensor:
    """Run the batch; its new K, V are stored. Returns logits [B, V] float32 on the KV
    store's device, where the sampler picks the tokens (lamina.sampling.sampler); with
    `step_graphs` (a GPU's), a decode step it serves is replayed whole as a CUDA graph,
    else with `graphs` its slices are replayed one by one; either way its logits live
    until the next step."""
    if step_graphs is not None:
        seqs = [kv.get(s) for s in batch.seq_ids]
        with torch.inference_mode():
            logits = step_graphs.run([seq.buf for seq in seqs], [seq.length for seq in seqs], batch.query_lens,
                                     batch.input_ids, batch.positions)
        if logits is not None:
            for seq, n in zip(seqs, batch.query_lens):
                seq.length += n
            return logits
    attention = in_process_attention(kv, batch)
    with torch.inference_mode():
        # Attention copies each layer's K and V into the store: the slices may keep their outputs.
        logits = split.run(batch.model_inputs(kv.device), lambda i, q, k, v: attention.attend(i, q, k, v),
                           reuse_outputs=True, call_slice=None if graphs is None else graphs.caller(0))
    attention.commit()
    return logits
