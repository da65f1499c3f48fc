"""A model worker's slice service: runs single slices for a rotational coordinator.

Under `pipeline.mode: rotational` every model worker listens on the data plane for
SLICE frames (lamina.services.wire): one slice of one micro-batch's step, with the hidden
state it needs (graph inputs, the previous attention output, the context). It runs
the slice with its own copy of the weights and answers SLICE_OUT with the next
attention's Q, K, V and the context, or the logits of the last slice. It keeps no
state between frames, so any worker can run any slice of any micro-batch.

A frame that does not fit the model (an unknown slice, wrong tensor count, dtype or
rows) is answered with an ERROR frame and changes nothing; the connection stays up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lamina import transports
from lamina.model.splitter import Slice, SliceOutput
from lamina.services.wire import (
    Kind,
    RemoteError,
    RunSlice,
    error_frame,
    frame_tag,
    incoming,
    short_repr,
    slice_out_frame,
)

# run(slice_index, inputs, attn, context) -> SliceOutput: the worker's own slices
RunLocal = Callable[[int, dict, torch.Tensor | None, Sequence[torch.Tensor]], SliceOutput]


def slice_tensors(sl: Slice, inputs: dict, attn: torch.Tensor | None,
                  context: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What a SLICE frame carries for slice `sl`, in order."""
    out = [inputs[name] for name in sl.graph_inputs]
    if sl.takes_attention:
        out.append(attn)
    return out + list(context)


def slice_out_tensors(out: SliceOutput) -> list[torch.Tensor]:
    """What a SLICE_OUT frame carries (frames send contiguous tensors as they are)."""
    if out.qkv is None:
        return [out.output]
    return [t.contiguous() for t in (*out.qkv, *out.context)]


def from_slice_out(sl: Slice, tensors: list[torch.Tensor]) -> SliceOutput:
    if sl.is_last:
        if len(tensors) != 1:
            raise RemoteError("protocol", f"SLICE_OUT of the last slice carries {len(tensors)} tensors, not 1")
        return SliceOutput(None, [], tensors[0])
    if len(tensors) != 3 + len(sl.context_out):
        raise RemoteError("protocol", f"SLICE_OUT of slice {sl.index} carries {len(tensors)} tensors, "
                                      f"not {3 + len(sl.context_out)}")
    q, k, v, *context = tensors
    return SliceOutput((q, k, v), context, None)


def unpack(slices: Sequence[Slice], msg: RunSlice) -> tuple[dict, torch.Tensor | None, list[torch.Tensor]]:
    """The inputs, attention output and context of a SLICE message, checked against
    the split model: RemoteError("bad_request") when they do not fit it."""
    if not 0 <= msg.slice < len(slices):
        raise RemoteError("bad_request", f"slice {msg.slice} out of range (the model has {len(slices)})")
    sl = slices[msg.slice]
    want = len(sl.graph_inputs) + int(sl.takes_attention) + len(sl.context_in)
    if len(msg.tensors) != want:
        raise RemoteError("bad_request", f"slice {msg.slice} takes {want} tensors, got {len(msg.tensors)}")
    g = len(sl.graph_inputs)
    inputs = dict(zip(sl.graph_inputs, msg.tensors[:g]))
    for name, t in inputs.items():
        if t.dtype != torch.long or t.dim() != 1:
            raise RemoteError("bad_request", f"input {name!r} must be a 1-D int64 tensor, got "
                                             f"{t.dtype} {tuple(t.shape)}")
    rest = msg.tensors[g:]
    attn = rest.pop(0) if sl.takes_attention else None
    rows = {t.shape[0] for t in rest + ([attn] if attn is not None else []) if t.dim() > 0}
    if "positions" in inputs:
        rows.add(inputs["positions"].shape[0])
    for t in rest + ([attn] if attn is not None else []):
        if t.dtype != torch.float32 or t.dim() not in (2, 3):
            raise RemoteError("bad_request", f"hidden-state tensors must be float32 [T, ...], got "
                                             f"{t.dtype} {tuple(t.shape)}")
    if len(rows) > 1:
        raise RemoteError("bad_request", f"tensors of slice {msg.slice} disagree on the number of rows: {sorted(rows)}")
    return inputs, attn, rest


class SliceServer:
    """Serves SLICE frames on data-plane connections with the worker's own slices."""

    def __init__(self, slices: Sequence[Slice], run: RunLocal) -> None:
        self.slices = slices
        self._run = run
        self.frames = 0

    async def serve_connection(self, conn: transports.Connection) -> None:
        # One coordinator's link. It sends one slice at a time and awaits the reply.
        async for frame in incoming(conn, "slice"):
            await conn.send(self.handle(frame))

    def handle(self, frame: transports.Frame) -> transports.Frame:
        tag = None
        try:
            tag = frame_tag(frame)
            if frame.kind != Kind.SLICE:
                raise RemoteError("protocol", f"a slice service takes SLICE frames, got kind {frame.kind}")
            msg = RunSlice.from_frame(frame)
            inputs, attn, context = unpack(self.slices, msg)
            try:
                out = self._run(msg.slice, inputs, attn, context)
            except (RuntimeError, ValueError, IndexError) as exc:  # shapes the checks could not foresee
                raise RemoteError("bad_request", f"slice {msg.slice} failed on these tensors: "
                                                 f"{short_repr(str(exc))}") from exc
            self.frames += 1
            return slice_out_frame(tag, slice_out_tensors(out))
        except RemoteError as exc:
            return error_frame(tag, exc.code, str(exc))
