"""Sampling parameters and logprobs survive the control plane's messages unchanged."""

from __future__ import annotations

import pytest

from lamina.sampling.logprobs import TokenLogprobs
from lamina.sampling.params import SamplingParams
from lamina.services.protos import lamina_pb2
from lamina.services.sampling_wire import (
    join_history,
    logprobs_from_proto,
    logprobs_of,
    logprobs_to_proto,
    params_from_proto,
    params_to_proto,
)


@pytest.mark.parametrize("sp", [
    SamplingParams(max_tokens=9, temperature=0.5, top_p=0.75, top_k=4, seed=3, stop_token_ids=(7,), ignore_eos=True),
    SamplingParams(max_tokens=2, temperature=0.0, seed=1, logprobs=0),
    SamplingParams(max_tokens=2, seed=1, logprobs=20),
    SamplingParams(max_tokens=4, seed=2, presence_penalty=0.5, frequency_penalty=-1.25, repetition_penalty=1.5,
                   min_tokens=2, logit_bias=((3, 2.5), (17, -100.0))),
    SamplingParams(max_tokens=4, seed=2, grammar='{"grammars": [{"json_schema": {"type": "object"}}]}'),
])
def test_params_round_trip(sp):
    assert params_from_proto(params_to_proto(sp)) == sp


def test_logprobs_round_trip_in_float32():
    lp = TokenLogprobs(5, -0.5, ((5, -0.5), (9, -1.25)))
    assert logprobs_from_proto(5, logprobs_to_proto(lp)) == lp
    assert logprobs_of(lamina_pb2.DecodeToken(token_id=5)) is None
    assert logprobs_of(lamina_pb2.PrefillResult(token_id=5, logprobs=logprobs_to_proto(lp))).logprob == -0.5


def test_join_history_only_when_penalties_need_it():
    plain = params_to_proto(SamplingParams(max_tokens=4))
    assert join_history(plain, [1, 2], [3]) == {}
    freq = params_to_proto(SamplingParams(max_tokens=4, frequency_penalty=1.0))
    assert join_history(freq, [1, 2], [3, 4]) == {"output_token_ids": [3, 4]}
    rep = params_to_proto(SamplingParams(max_tokens=4, repetition_penalty=1.5))
    assert join_history(rep, [1, 2], [3]) == {"output_token_ids": [3], "prompt_token_ids": [1, 2]}
    constrained = params_to_proto(SamplingParams(max_tokens=4, grammar='{"grammars": []}'))
    assert join_history(constrained, [1, 2], [3, 4]) == {"output_token_ids": [3, 4]}


def test_a_joining_sequence_rebuilds_its_grammar_state_from_its_outputs():
    """A constrained sequence that joins a model worker (moved, or rebuilt after a
    failure) masks its next token as the worker that sampled its outputs would have."""
    from llguidance import LLMatcher

    from lamina.model.checkpoints import load_tokenizer
    from lamina.sampling.grammar import Grammars
    from lamina.sampling.sampler import Sampler
    from lamina.services.model.decode_runner import DecodeSeq

    tok = load_tokenizer()[0]
    grammars = Grammars(tok)
    grammar = LLMatcher.grammar_from_json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    outputs = tok.hf_tokenizer('{"n": 1', add_special_tokens=False)["input_ids"]
    proto = params_to_proto(SamplingParams(max_tokens=8, grammar=grammar))
    step = lamina_pb2.StepSequence(seq_id="s", token_id=outputs[-1], position=9, params=proto,
                                   output_index=len(outputs), **join_history(proto, [1], outputs))
    joined = DecodeSeq.from_proto(step, 0, Sampler(grammars, tok.eos_token_ids))
    assert joined.sampling.num_output == len(outputs) and joined.sampling.seed == proto.seed
    stepped = grammars.state(grammar)
    for t in outputs:
        stepped.append(t)
    assert (joined.sampling.grammar.allowed(tok.vocab_size) == stepped.allowed(tok.vocab_size)).all()
    assert not joined.sampling.grammar.allowed(tok.vocab_size)[tok.eos_token_ids[0]]  # the object is still open
