"""The stop rule: when a sequence's newest token ends it.

One pure function, used by the scheduler (which ends the request), by the model
workers (which drop a finished sequence at once) and by the local engine (which adds
stop strings on top), so every place agrees on a sequence's last token. It reads its
parameters through `StopParams`, which both `SamplingParams` and the control plane's
`lamina_pb2.SamplingParams` message satisfy.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol


class StopParams(Protocol):
    """What the stop rule reads of a request's sampling parameters."""

    @property
    def stop_token_ids(self) -> Collection[int]: ...

    @property
    def ignore_eos(self) -> bool: ...

    @property
    def max_tokens(self) -> int: ...


def stop_reason(params: StopParams, token: int, num_output: int, num_tokens: int,
                eos_ids: Collection[int], max_model_len: int) -> str | None:
    """Why a sequence ends after `token` became its `num_output`-th output token (its
    `num_tokens`-th in all): "stop" (a stop token id, or EOS unless ignored), "length"
    (max_tokens reached, or the context full), or None if it goes on."""
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids):
        return "stop"
    if num_output >= params.max_tokens or num_tokens >= max_model_len:
        return "length"
    return None
