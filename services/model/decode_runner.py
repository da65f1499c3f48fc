"""A model worker's decode loop: its sequences, in micro-batches stepped back to back.

The scheduler streams batch changes (sequences joining with their whole state,
sequences leaving); the runner keeps N micro-batch tasks, each running steps of its
own sequences one after another and reporting each step's tokens. The tasks share
one event loop: while one awaits its attention replies, another computes its slice,
which is what staggers them (lamina.services.model.micro_batches decides who is in which).

What must hold:
- A sequence is in at most one step in flight: it belongs to one micro-batch, and
  moves between micro-batches only at its own micro-batch's step start.
- A sequence leaves (dropped, reported in `left`) only between its micro-batch's
  steps, so once the scheduler reads `left` (or `finished`, or `failed`), no frame
  of that sequence is on its way to an attention worker and its KV can be freed.
- The runner ends a sequence by the scheduler's own rule
  (lamina.sampling.stop.stop_reason), so both agree on its last token.

Owned tasks: the micro-batch tasks, cancelled and awaited by `close()`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from lamina import transports
from lamina.model.batch import StepBatch
from lamina.sampling.grammar import Grammars
from lamina.sampling.sampler import Sampler, SeqSampling
from lamina.sampling.stop import stop_reason
from lamina.services.attention_pool import SeqRows
from lamina.services.model.micro_batches import join_target, num_active, rebalance
from lamina.services.protos import lamina_pb2
from lamina.services.sampling_wire import logprobs_to_proto, params_from_proto
from lamina.services.wire import RemoteError

log = logging.getLogger(__name__)

# forward(micro_batch, step, batch, rows) -> logits [B, V]
Forward = Callable[[int, int, StepBatch, list[SeqRows]], Awaitable[torch.Tensor]]


@dataclass
class DecodeSeq:
    seq_id: str
    token: int  # the newest token: this sequence's input to its next step, not yet in the KV
    position: int  # that token's position
    # Its params and seed, the output index of the token the next step samples, and its
    # penalty and grammar state (built whole at join, from the ids the join carries).
    sampling: SeqSampling
    workers: tuple[int, ...]
    micro_batch: int
    leaving: bool = False

    @classmethod
    def from_proto(cls, s: lamina_pb2.StepSequence, micro_batch: int, sampler: Sampler) -> DecodeSeq:
        """A joining sequence; its message's parameters are converted here, once (the
        scheduler always sets the seed, which the converted params carry)."""
        sampling = sampler.join(params_from_proto(s.params), s.prompt_token_ids, s.output_token_ids,
                                num_output=s.output_index)
        return cls(s.seq_id, s.token_id, s.position, sampling, tuple(s.placement.workers), micro_batch)


class DecodeRunner:
    def __init__(self, forward: Forward, num_micro_batches: int, stop: lamina_pb2.StopRule,
                 on_step: Callable[[int, float], None] | None = None, min_micro_batch: int = 1,
                 grammars: Grammars | None = None, hand_off_s: float = 0.0) -> None:
        """`hand_off_s`: after each step, how long at most to wait for the stream to take
        the step's result (see `_run`); 0: not at all."""
        self._forward = forward
        self._hand_off_s = hand_off_s
        self._handing_off: set[asyncio.Future[None]] = set()  # steps waiting for `taken`
        self._stop_eos = set(stop.eos_token_ids)
        self._sampler = Sampler(grammars, self._stop_eos)
        self._max_model_len = stop.max_model_len or (1 << 30)
        self._on_step = on_step
        self.num_micro_batches = num_micro_batches
        self.min_micro_batch = min_micro_batch
        self.results: asyncio.Queue[lamina_pb2.DecodeResult] = asyncio.Queue()
        self._seqs: dict[str, DecodeSeq] = {}
        self._members: list[list[DecodeSeq]] = [[] for _ in range(num_micro_batches)]
        self._wake = [asyncio.Event() for _ in range(num_micro_batches)]
        self._tasks: list[asyncio.Task] = []

    # -- changes from the scheduler ---------------------------------------------------------
    def join(self, seqs: list[lamina_pb2.StepSequence]) -> None:
        for s in seqs:
            if s.seq_id in self._seqs:
                log.warning("sequence %s joined twice; the second join is ignored", s.seq_id)
                continue
            mb = join_target([len(m) for m in self._members], self._active(len(self._seqs) + 1))
            seq = DecodeSeq.from_proto(s, mb, self._sampler)
            self._seqs[s.seq_id] = seq
            self._members[mb].append(seq)
            self._wake[mb].set()

    def leave(self, seq_ids: list[str]) -> None:
        unknown = []
        for sid in seq_ids:
            seq = self._seqs.get(sid)
            if seq is None:
                unknown.append(sid)  # already ended here (a stop rule, a failure): nothing in flight
            else:
                seq.leaving = True
                self._wake[seq.micro_batch].set()
        if unknown:
            self.results.put_nowait(lamina_pb2.DecodeResult(left=unknown))

    def taken(self) -> None:
        """The stream took a result from `results` and hands it to gRPC now."""
        for waiting in self._handing_off:
            if not waiting.done():
                waiting.set_result(None)
        self._handing_off.clear()

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def _active(self, num_sequences: int) -> int:
        return num_active(num_sequences, self.num_micro_batches, self.min_micro_batch)

    # -- tasks ------------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(mb), name=f"micro-batch-{mb}")
                       for mb in range(self.num_micro_batches)]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def _start_step(self, mb: int) -> tuple[list[DecodeSeq], list[str]]:
        """This micro-batch's sequences for its next step, and those that left."""
        left = [s.seq_id for s in self._members[mb] if s.leaving]
        members = [s for s in self._members[mb] if not s.leaving]
        for sid in left:
            del self._seqs[sid]
        sizes = [len(members) if i == mb else len(m) for i, m in enumerate(self._members)]
        for target in rebalance(mb, sizes, self._active(sum(sizes))):
            seq = members.pop()
            seq.micro_batch = target
            self._members[target].append(seq)
            self._wake[target].set()
        self._members[mb] = members
        return list(members), left

    def _drop(self, mb: int, seq_ids: set[str]) -> None:
        self._members[mb] = [s for s in self._members[mb] if s.seq_id not in seq_ids]
        for sid in seq_ids:
            self._seqs.pop(sid, None)

    async def _run(self, mb: int) -> None:
        step = 0
        while True:
            members, left = self._start_step(mb)
            if left:
                self.results.put_nowait(lamina_pb2.DecodeResult(micro_batch=mb, step=step, left=left))
            if not members:
                self._wake[mb].clear()
                await self._wake[mb].wait()
                continue
            step += 1
            start = time.perf_counter()
            try:
                result = await self._step(mb, step, members)
            except Exception as exc:
                if isinstance(exc, (RemoteError, transports.TransportError)):
                    code = exc.code if isinstance(exc, RemoteError) else "transport"
                    log.warning("step %d of micro-batch %d failed: %s", step, mb, exc)
                else:
                    code = "internal"
                    log.exception("step %d of micro-batch %d failed", step, mb)
                self._drop(mb, {s.seq_id for s in members})
                result = lamina_pb2.DecodeResult(micro_batch=mb, step=step, failed=[
                    lamina_pb2.DecodeFailure(seq_id=s.seq_id, code=code, message=str(exc)) for s in members])
            handed = asyncio.get_running_loop().create_future() if self._hand_off_s else None
            if handed is not None:
                self._handing_off.add(handed)
            self.results.put_nowait(result)
            if self._on_step is not None:
                self._on_step(len(members), time.perf_counter() - start)
            # A step whose attention is in this process (layout colocated) never waits on a
            # peer, so the loop would not send its result (nor read an update) until the
            # micro-batch ran out of sequences: the step waits until the stream took the
            # result (`taken`), a few loop turns, which starts its gRPC write. (A fixed
            # sleep instead either cost a millisecond a step or, shorter, let tokens reach
            # the scheduler in bursts.) asyncio.wait, not wait_for: Python 3.11's wait_for
            # loses a cancellation that lands as its future completes, and close() would wait forever.
            if handed is not None:
                await asyncio.wait({handed}, timeout=self._hand_off_s)
                self._handing_off.discard(handed)

    async def _step(self, mb: int, step: int, members: list[DecodeSeq]) -> lamina_pb2.DecodeResult:
        # Rows grouped by attention worker: each worker's share of Q, K, V is then a view.
        members = sorted(members, key=lambda s: s.workers[0])
        batch = StepBatch.build([s.seq_id for s in members], [[s.token] for s in members],
                                [s.position for s in members])
        rows = [SeqRows(s.seq_id, 1, s.workers) for s in members]
        torn = transports.torn_frames()
        logits = await self._forward(mb, step, batch, rows)
        # Once the sampled ids are on the host every frame the step read is copied: a torn
        # one found since the step began (a vanished peer's device-ordered reply; the count
        # does not say which step read it, so every step in flight fails) fails the step,
        # which the scheduler rebuilds, rather than a wrong token going out.
        try:
            tokens, logprobs = self._sampler(logits, [s.sampling for s in members])
        except Exception as exc:
            if transports.torn_frames() != torn:
                raise _torn(mb, step) from exc
            raise
        if transports.torn_frames() != torn:
            raise _torn(mb, step)
        out = lamina_pb2.DecodeResult(micro_batch=mb, step=step)
        done: set[str] = set()
        for seq, tok, lp in zip(members, tokens, logprobs):
            seq.token = tok
            seq.position += 1
            # sampling.num_output now counts this sequence's outputs; position + 1 its tokens.
            finished = stop_reason(seq.sampling.params, tok, seq.sampling.num_output, seq.position + 1,
                                   self._stop_eos, self._max_model_len) is not None
            if finished:
                done.add(seq.seq_id)
            out.tokens.append(lamina_pb2.DecodeToken(seq_id=seq.seq_id, token_id=tok, finished=finished,
                                                     logprobs=None if lp is None else logprobs_to_proto(lp)))
        if done:
            self._drop(mb, done)
        return out


def _torn(mb: int, step: int) -> transports.TransportError:
    return transports.TransportError(f"step {step} of micro-batch {mb} ran while a frame this process read was "
                                     "found torn (its sender vanished before writing it whole)")
