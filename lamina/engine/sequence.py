"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from lamina.sampling.logprobs import TokenLogprobs
from lamina.sampling.params import SamplingParams
from lamina.sampling.sampler import SeqSampling


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampling: SeqSampling  # its seed, penalty and grammar state (lamina.sampling.sampler)
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached: int = 0  # tokens whose KV is stored
    text: str = ""  # detokenized output: tracked for stop strings, set in full at the end
    stopped_by_string: bool = False
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per output token, when params ask

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def next_input(self) -> list[int]:
        """The tokens this sequence feeds the next step: the uncached rest of prompt and output."""
        all_ids = self.prompt_ids + self.output_ids
        return all_ids[self.num_cached :]
