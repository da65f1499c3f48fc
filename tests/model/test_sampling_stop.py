"""The stop rule (lamina.sampling.stop): one function for the scheduler, the model workers
and the local engine, reading the control plane's message and SamplingParams alike."""

from __future__ import annotations

import pytest

from lamina.sampling.params import SamplingParams
from lamina.sampling.stop import stop_reason
from lamina.services.protos import lamina_pb2


@pytest.mark.parametrize("make", [lamina_pb2.SamplingParams, SamplingParams], ids=["proto", "params"])
def test_stop_reasons(make):
    p = make(max_tokens=4, stop_token_ids=[7] if make is lamina_pb2.SamplingParams else (7,))
    assert stop_reason(p, 5, 1, 10, eos_ids={2}, max_model_len=100) is None
    assert stop_reason(p, 2, 1, 10, eos_ids={2}, max_model_len=100) == "stop"
    assert stop_reason(p, 7, 1, 10, eos_ids={2}, max_model_len=100) == "stop"
    assert stop_reason(p, 5, 4, 10, eos_ids={2}, max_model_len=100) == "length"
    assert stop_reason(p, 5, 1, 4, eos_ids={2}, max_model_len=4) == "length"  # context full
    ignoring = make(max_tokens=4, ignore_eos=True)
    assert stop_reason(ignoring, 2, 1, 10, eos_ids={2}, max_model_len=100) is None
