"""Constrained decoding's masks (lamina.sampling.grammar) with the real tokenizer, and the
local engine's constrained greedy output against transformers with the same masks."""

from __future__ import annotations

import json

import pytest
import torch
from llguidance import LLMatcher

from lamina.model.checkpoints import load_tokenizer
from lamina.sampling.grammar import Grammars, apply_grammars
from lamina.sampling.params import SamplingParams
from lamina.sampling.sampler import sample

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
# No free whitespace (as the gateway asks): random logits would fill every token with it.
GRAMMAR = LLMatcher.grammar_from_json_schema(
    SCHEMA, overrides={"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False})


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()[0]


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.hf_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_mask_allows_the_valid_text_and_eos_only_at_its_end(tokenizer, grammars):
    eos = tokenizer.eos_token_ids[0]
    ids = _ids(tokenizer, '{"name": "Ann", "age": 31}')
    state = grammars.state(GRAMMAR)
    for i, token in enumerate(ids):
        allowed = state.allowed(tokenizer.vocab_size)
        assert allowed[token], f"token {i} of a valid text is masked"
        assert not allowed[eos], f"EOS allowed after {i} tokens, before the object closes"
        if i == 0:
            assert not allowed[_ids(tokenizer, "hello")[0]]  # an object starts with "{"
        state.append(token)
    allowed = state.allowed(tokenizer.vocab_size)
    assert state.is_accepting and allowed.nonzero().flatten().tolist() == [eos]


def test_state_rebuilt_from_outputs_masks_as_the_stepped_one(tokenizer, grammars):
    ids = _ids(tokenizer, '{"name": "Bo", "age": 4')
    stepped = grammars.state(GRAMMAR)
    for token in ids:
        stepped.append(token)
    rebuilt = grammars.state(GRAMMAR, ids)
    assert torch.equal(stepped.allowed(tokenizer.vocab_size), rebuilt.allowed(tokenizer.vocab_size))
    # The cached compiled grammar is copied, never shared: a fresh state starts over.
    assert grammars.state(GRAMMAR).allowed(tokenizer.vocab_size)[_ids(tokenizer, "{\"")[0]]


def test_a_refused_history_or_a_bad_grammar_allows_eos_alone(tokenizer, grammars):
    eos = tokenizer.eos_token_ids[0]
    refused = grammars.state(GRAMMAR, _ids(tokenizer, "hello"))
    assert refused.is_error
    assert refused.allowed(tokenizer.vocab_size).nonzero().flatten().tolist() == [eos]
    broken = grammars.state(LLMatcher.grammar_from_json_schema({"type": "strin"}))
    assert broken.is_error
    assert broken.allowed(tokenizer.vocab_size).nonzero().flatten().tolist() == [eos]


def test_mask_applies_after_the_penalties_and_leaves_other_rows(tokenizer, grammars):
    vocab = tokenizer.vocab_size
    logits = torch.zeros(2, vocab)  # [B, V]
    forbidden = _ids(tokenizer, "hello")[0]
    p = SamplingParams(temperature=0.0, logit_bias=((forbidden, 100.0),), grammar=GRAMMAR)
    free = SamplingParams(temperature=0.0, logit_bias=((forbidden, 100.0),))
    state = grammars.state(GRAMMAR)
    from lamina.sampling.penalties import PenaltyState
    penalties = [PenaltyState.build(p, [], [], ()), PenaltyState.build(free, [], [], ())]
    tokens = sample(logits, [p, free], [1, 1], [0, 0], penalties, [state, None])
    assert tokens[1] == forbidden  # the bias wins where there is no grammar
    assert tokens[0] != forbidden and state.allowed(vocab)[tokens[0]]
    assert torch.count_nonzero(logits) == 0  # the raw logits are left as they were
    masked = torch.zeros(2, vocab)
    apply_grammars(masked, [state, None])
    assert torch.isinf(masked[0]).sum() == vocab - state.allowed(vocab).sum()
    assert not torch.isinf(masked[1]).any()


def test_sampled_constrained_output_is_valid_and_reproducible_per_seed(tokenizer, grammars):
    """Random logits, temperature 1: every sampled text is valid JSON for the schema,
    and the same seed samples the same text."""
    def run(seed: int) -> str:
        state = grammars.state(GRAMMAR)
        p = SamplingParams(temperature=1.0, grammar=GRAMMAR, max_tokens=64)
        gen = torch.Generator().manual_seed(seed)
        out = []
        for index in range(64):
            logits = torch.randn(1, tokenizer.vocab_size, generator=gen)
            token = sample(logits, [p], [seed], [index], None, [state])[0]
            if token in tokenizer.eos_token_ids:
                return tokenizer.decode(out)
            state.append(token)
            out.append(token)
        raise AssertionError(f"no EOS in 64 tokens: {tokenizer.decode(out)!r}")

    texts = [run(seed) for seed in (1, 2, 3)]
    for text in texts:
        value = json.loads(text)
        assert set(value) == {"name", "age"} and len(value["name"]) <= 12 and 0 <= value["age"] <= 150
    assert run(2) == texts[1]
    assert len(set(texts)) > 1


def test_constrained_greedy_equals_transformers_with_the_same_masks(loaded_model, hf_reference):
    """The local engine's greedy output under a grammar equals transformers' greedy
    generate with the same llguidance mask applied to its logits at each step."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from lamina.engine.engine import Engine

    tok = loaded_model.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Describe a person as JSON with a name and an age."}])
    engine = Engine(loaded_model)
    ours = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, grammar=GRAMMAR))[0]

    class Mask(LogitsProcessor):
        def __init__(self) -> None:
            self.state = Grammars(tok).state(GRAMMAR)
            self.seen = len(prompt)

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            for token in input_ids[0, self.seen:].tolist():
                self.state.append(token)
            self.seen = input_ids.shape[1]
            scores = scores.clone()
            apply_grammars(scores, [self.state])
            return scores

    with torch.no_grad():
        ref = hf_reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=24, do_sample=False, logits_processor=LogitsProcessorList([Mask()]),
                                    eos_token_id=list(tok.eos_token_ids), pad_token_id=tok.eos_token_ids[0])
    assert ours.output_token_ids == ref[0, len(prompt):].tolist()
    if ours.finish_reason == "stop":
        json.loads(tok.decode(ours.output_token_ids))
