"""The scheduler's view of requests, and its decisions as pure functions."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from lamina.services.protos import lamina_pb2
from lamina.services.scheduler.choices import reserve_tokens
from lamina.services.scheduler.scheduling_policies import SCHEDULING_POLICIES, QueuedRequest


class QueueFull(Exception):
    """The waiting queue holds `scheduler.max_queue` requests: a new one is refused
    (gRPC RESOURCE_EXHAUSTED; HTTP 429 at the gateway)."""


class NotYet(Exception):
    """A prefill or a rebuild cannot proceed now (no attention worker up with room, no
    prefill worker answers): tried again until `deadlines.recovery_s` passes."""


@dataclass(frozen=True)
class RequestFailed:
    """Put on a request's event queue in place of a chunk: its stream ends with this error."""

    message: str


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    RECOVERING = "recovering"  # its KV is being rebuilt after a worker failed
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: lamina_pb2.SamplingParams  # seed always set
    events: asyncio.Queue  # TokenChunk messages for the client, ending with a finish reason
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    workers: list[int] = field(default_factory=list)  # KV placement
    model_worker: int = -1  # whose decode stream holds it
    status: Status = Status.WAITING
    abort_requested: bool = False
    max_model_len: int = 1 << 30
    recoveries: int = 0  # times its KV was rebuilt after a failure
    prompt_logprobs: bool = False  # its first prefill also scores the prompt's tokens (echo)
    # Choices (lamina.services.scheduler.choices): which one this is, and its request's id when it has several.
    index: int = 0
    group_id: str = ""
    # Choice 0 of an n > 1 request: the seeds of choices 1..n-1, forked from its prompt once
    # its first prefill is done (`forked`).
    choice_seeds: list[int] = field(default_factory=list)
    forked: bool = False
    reserved: int = 0  # KV tokens reserved for it on each of its workers

    @property
    def kv_id(self) -> str:
        """The id its KV has on the attention workers (and on its model worker)."""
        return kv_id(self.request_id, self.recoveries)

    @property
    def rebuild_ids(self) -> list[int]:
        """The tokens whose KV a request holds: all but the newest output, which is the
        input of its next step (the prompt alone before the first output)."""
        return self.prompt_ids + self.output_ids[:-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request's KV can grow to."""
        return min(len(self.prompt_ids) + self.params.max_tokens, self.max_model_len)

    @property
    def reserve_tokens(self) -> int:
        """KV tokens to reserve when it is placed: its own, and the choices still to fork's."""
        return reserve_tokens(len(self.prompt_ids), self.max_total_tokens,
                              0 if self.forked else len(self.choice_seeds))

    @property
    def num_slots(self) -> int:
        """Decode batch slots its prefill leads to: one per choice."""
        return 1 + len(self.choice_seeds)


def kv_id(request_id: str, recoveries: int) -> str:
    """The sequence id of a request's KV after `recoveries` rebuilds: each rebuild
    stores it under a new id, so nothing addressed to the old one can reach it."""
    return request_id if not recoveries else f"{request_id}#{recoveries}"


def admission_order(waiting: Sequence[Request], distances: Sequence[int], policy: str, now: float) -> list[Request]:
    """Waiting requests in the order the scheduling policy admits them (a pure decision)."""
    queued = [QueuedRequest(r.request_id, r.arrival, d) for r, d in zip(waiting, distances)]
    by_id = {r.request_id: r for r in waiting}
    return [by_id[q.request_id] for q in SCHEDULING_POLICIES[policy](queued, now)]


def can_admit(num_running: int, num_prefilling: int, max_batch_size: int, num_new: int = 1) -> bool:
    """Admit a request of `num_new` sequences (its choices) only while they would fit in a decode batch."""
    return num_running + num_prefilling + num_new <= max_batch_size


def admission_refusal(num_prompt: int, max_tokens: int, n: int, max_model_len: int, max_batch_size: int,
                      most_capacity: int) -> str | None:
    """Why a request of `num_prompt` prompt tokens, `max_tokens` and `n` choices can never
    run (the message its client gets), or None when it can: `most_capacity` is the
    largest KV capacity of an attention worker, in tokens."""
    if not num_prompt:
        return "the prompt is empty"
    if num_prompt >= max_model_len:
        return f"prompt has {num_prompt} tokens; the model's context length is {max_model_len}"
    if n > max_batch_size:
        return f"n={n} choices exceed the decode batch ({max_batch_size} sequences)"
    need = reserve_tokens(num_prompt, min(num_prompt + max_tokens, max_model_len), n - 1)
    if need > most_capacity:
        what = "prompt plus max_tokens" if n == 1 else f"prompt plus {n} choices of max_tokens"
        return f"{what} ({need} tokens) exceeds the KV capacity of an attention worker ({most_capacity} tokens)"
    return None
