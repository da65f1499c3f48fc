"""The local engine: requests in, tokens out, one step at a time.

Owns the model's slices, the KV store and the queue. `step()` schedules a
batch, runs it, samples one token per sequence and applies stop conditions.
Not thread-safe: one owner drives it (the CLI, or an async wrapper's thread).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from lamina.engine.kv import KVStore
from lamina.engine.scheduler import SchedulerLimits, schedule
from lamina.engine.sequence import Sequence, SequenceStatus
from lamina.engine.step import run_step
from lamina.model.batch import StepBatch
from lamina.model.llama import split_llama
from lamina.model.loader import LoadedModel
from lamina.model.paged_decode import paged_available
from lamina.model.placement import COMPUTE_DTYPES, place, runs_natively
from lamina.model.slice_graphs import SliceGraphs
from lamina.model.step_graphs import StepGraphs
from lamina.sampling.grammar import Grammars
from lamina.sampling.logprobs import TokenLogprobs
from lamina.sampling.params import SamplingParams
from lamina.sampling.sampler import Sampler
from lamina.sampling.stop import stop_reason


@dataclass(frozen=True)
class EngineConfig:
    kv_capacity_bytes: int = 2 << 30
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    max_model_len: int | None = None  # defaults to the model's context length
    # Where the engine computes and in which dtype (weights, activations, KV). Other than
    # cpu/float32, the model must be loaded with torch's own linears (load_model(packed=False)).
    device: str = "cpu"
    dtype: str = "float32"
    # On a GPU, each decode slice captured as a CUDA graph per batch-size bucket and
    # replayed (lamina.model.slice_graphs, as a model worker's); false: every slice eagerly.
    cuda_graphs: bool = True
    # With cuda_graphs, a decode step captured whole, its attention included, per batch and
    # context bucket (lamina.model.step_graphs; triton needed); false: the slices' graphs only.
    step_graphs: bool = True

    def __post_init__(self) -> None:
        if self.kv_capacity_bytes <= 0:
            raise ValueError("kv_capacity_bytes must be positive")
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be {', '.join(COMPUTE_DTYPES[:-1])} or {COMPUTE_DTYPES[-1]}, "
                             f"got {self.dtype!r}")


@dataclass(frozen=True)
class RequestOutput:
    seq_id: str
    new_token_ids: list[int]  # tokens produced by this step
    finish_reason: str | None  # None while running; "stop", "length" or "abort"
    prompt_tokens: int
    output_token_ids: list[int]  # all tokens so far
    text: str | None = None  # the detokenized output once finished, cut at a stop string
    logprobs: tuple[TokenLogprobs, ...] = ()  # every output token's so far, when params.logprobs asks


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.loaded = loaded
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.split = split_llama(loaded.model)
        self.device, self.dtype = torch.device(self.config.device), getattr(torch, self.config.dtype)
        if not runs_natively(self.device, self.dtype):
            place([loaded.model, *(piece.module for piece in self.split.slices)], self.device, self.dtype)
        # The decode slices as CUDA graphs (a GPU's); `graphs.replays` counts the slices replayed.
        on_gpu = self.device.type == "cuda" and self.config.cuda_graphs
        self.graphs = SliceGraphs(self.split, self.device) if on_gpu else None
        # Whole decode steps as CUDA graphs where their attention is the buffer kernels';
        # `step_graphs.replays` counts the steps replayed.
        self.step_graphs = StepGraphs(self.split, self.device) \
            if on_gpu and self.config.step_graphs and paged_available(self.device) else None
        self.kv = KVStore(loaded.config, self.config.kv_capacity_bytes, dtype=self.dtype, device=self.device)
        self.max_model_len = self.config.max_model_len or loaded.config.max_position_embeddings
        self.eos_token_ids = set(loaded.tokenizer.eos_token_ids)
        self.sampler = Sampler(Grammars(loaded.tokenizer), self.eos_token_ids)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.sum_batch_size = 0

    # -- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, seq_id: str | None = None) -> str:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the model's context length is {self.max_model_len}"
            )
        seq_id = seq_id or f"seq-{next(self._ids)}"
        if seq_id in self._by_id:
            raise ValueError(f"duplicate request id {seq_id!r}")
        seq = Sequence(seq_id, list(prompt_ids), params, self.sampler.join(params, prompt_ids))
        self._waiting.append(seq)
        self._by_id[seq_id] = seq
        return seq_id

    def abort(self, seq_id: str) -> bool:
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    # -- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        def reserve(seq: Sequence, total: int) -> bool:
            if not self.kv.can_reserve(seq.seq_id, total):
                return False
            self.kv.reserve(seq.seq_id, total)
            return True

        plan = schedule(self._running, self._waiting, self.config.limits, reserve)
        for seq in plan.preempted:
            # Lost its KV room: recompute from the prompt and what it generated so far.
            self.kv.free(seq.seq_id)
            seq.num_cached = 0
            seq.status = SequenceStatus.WAITING
            self._running.remove(seq)
            self._waiting.appendleft(seq)
        for seq in plan.admitted:
            self._waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
        if plan.is_empty:
            if self._waiting and not self._running:
                seq = self._waiting.popleft()
                self._by_id.pop(seq.seq_id, None)
                self._finish(seq, "length")  # cannot fit even alone
                return [self._output(seq, [])]
            return []
        batch = StepBatch.build(
            [s.seq_id for s in plan.running], [s.next_input() for s in plan.running],
            [s.num_cached for s in plan.running],
        )
        logits = run_step(self.split, self.kv, batch, self.graphs, self.step_graphs)
        self.num_steps += 1
        self.sum_batch_size += len(plan.running)
        tokens, logprobs = self.sampler(logits, [s.sampling for s in plan.running])
        outputs = []
        for seq, tok, lp, n in zip(plan.running, tokens, logprobs, batch.query_lens):
            seq.num_cached += n
            seq.output_ids.append(tok)
            reason = self._stop_reason(seq, tok)
            if reason is not None:
                self._by_id.pop(seq.seq_id, None)
                self._finish(seq, reason)
            if lp is not None:
                seq.logprobs.append(lp)
            outputs.append(self._output(seq, [tok]))
        return outputs

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        """The stack's stop rule (lamina.sampling.stop), and stop strings on top: the
        gateway applies those in the stack, the engine here."""
        reason = stop_reason(seq.params, tok, len(seq.output_ids), seq.num_tokens, self.eos_token_ids,
                             self.max_model_len)
        if reason != "stop" and self._stop_string(seq):
            return "stop"
        return reason

    def _stop_string(self, seq: Sequence) -> bool:
        """Whether the output's text now holds one of its stop strings (then cut there)."""
        p = seq.params
        if not p.stop or len(seq.output_ids) <= p.min_tokens:
            return False
        seq.text = self.tokenizer.decode(seq.output_ids)
        # As vLLM (and the gateway): the first min_tokens tokens' text holds no stop string.
        start = len(self.tokenizer.decode(seq.output_ids[:p.min_tokens])) if p.min_tokens else 0
        for s in p.stop:
            cut = seq.text.find(s, start)
            if cut != -1:
                seq.text = seq.text[:cut]
                seq.stopped_by_string = True
                return True
        return False

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if not seq.stopped_by_string:
            seq.text = self.tokenizer.decode(seq.output_ids)
        self.kv.free(seq.seq_id)
        if seq in self._running:
            self._running.remove(seq)
        if seq in self._waiting:
            self._waiting.remove(seq)

    @staticmethod
    def _output(seq: Sequence, new: list[int]) -> RequestOutput:
        return RequestOutput(
            seq.seq_id, new, seq.finish_reason, len(seq.prompt_ids), list(seq.output_ids),
            seq.text if seq.is_finished else None, tuple(seq.logprobs),
        )

    # -- convenience ----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion; results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        while self.has_work():
            for out in self.step():
                if out.finish_reason is not None:
                    final[out.seq_id] = out
        return [final[i] for i in ids]
