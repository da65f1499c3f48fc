"""Token log-probabilities: the raw logits' float32 log-softmax, equal to transformers'."""

from __future__ import annotations

import pytest
import torch

from lamina.engine import Engine, SamplingParams
from lamina.sampling.logprobs import TokenLogprobs, token_logprobs


def test_token_logprobs_are_the_log_softmax_of_the_raw_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    out = token_logprobs(logits, [1, 2, 0], [2, None, 0])
    lsm = torch.log_softmax(logits, dim=-1)
    assert out[1] is None  # that row did not ask
    assert out[0] == TokenLogprobs(1, pytest.approx(lsm[0, 1].item()),
                                   ((0, pytest.approx(lsm[0, 0].item())), (1, pytest.approx(lsm[0, 1].item()))))
    assert out[2].top == () and out[2].logprob == pytest.approx(lsm[2, 0].item())


def test_no_row_asking_costs_nothing():
    assert token_logprobs(torch.zeros(2, 5), [0, 1], [None, None]) == [None, None]


def _reference_logprobs(hf, prompt: list[int], outputs: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each output position: [len(outputs), V]."""
    ids = torch.tensor([prompt + outputs[:-1]])
    with torch.no_grad():
        logits = hf(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1:]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=10, temperature=0.0, logprobs=5),
                                    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, seed=11, logprobs=3)])
def test_engine_logprobs_equal_transformers(loaded_model, hf_reference, params):
    engine = Engine(loaded_model)
    prompt = loaded_model.tokenizer.encode_chat([{"role": "user", "content": "Name three rivers in Europe."}])
    (out,) = engine.generate([prompt], params)
    ref = _reference_logprobs(hf_reference, prompt, out.output_token_ids)
    assert len(out.logprobs) == len(out.output_token_ids)
    for i, (tok, lp) in enumerate(zip(out.output_token_ids, out.logprobs)):
        assert lp.token_id == tok
        assert abs(lp.logprob - ref[i, tok].item()) < 1e-4
        values, ids = ref[i].topk(params.logprobs)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert max(abs(v - r) for (_, v), r in zip(lp.top, values.tolist())) < 1e-4
    if params.is_greedy:  # greedy picks the most likely token, so its logprob is the top one
        assert all(lp.top[0] == (lp.token_id, lp.logprob) for lp in out.logprobs)
