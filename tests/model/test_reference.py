"""Greedy decoding through the engine equals transformers token for token."""

import pytest
import torch
from reference_helpers import CHAT_PROMPTS, COMPLETION_PROMPTS, MAX_NEW, hf_greedy, reference_prompts

from lamina.engine import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine(loaded_model):
    return Engine(loaded_model)


def test_greedy_tokens_equal_transformers(engine, hf_reference, loaded_model):
    prompts = reference_prompts(loaded_model.tokenizer)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    for ids, out in zip(prompts, outs):
        assert out.output_token_ids == hf_greedy(hf_reference, ids)


def test_chat_tokenization_matches_transformers(loaded_model):
    from transformers import AutoTokenizer

    path = loaded_model.source
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    messages = [{"role": "user", "content": CHAT_PROMPTS[0]}]
    expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert loaded_model.tokenizer.encode_chat(messages) == list(expected)
    assert loaded_model.tokenizer.encode(COMPLETION_PROMPTS[2]) == ref(COMPLETION_PROMPTS[2])["input_ids"]


def test_logits_match_transformers(loaded_model, hf_reference):
    from lamina.model.attention import attention_with_lse

    class Dense:
        def attend(self, layer_id, q, k, v):
            return attention_with_lse(q, k, v)[0]

    ids = torch.tensor(reference_prompts(loaded_model.tokenizer)[5])
    with torch.no_grad():
        ours = loaded_model.model(ids, torch.arange(len(ids)), torch.arange(len(ids)), Dense())
        ref = hf_reference(ids[None]).logits[0]
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-4)


def test_batch_invariance(engine, loaded_model):
    tok = loaded_model.tokenizer
    target = tok.encode_chat([{"role": "user", "content": CHAT_PROMPTS[1]}])
    alone = engine.generate([target], SamplingParams(max_tokens=24, temperature=0.0))[0]
    others = [tok.encode("word " * (3 + 7 * i) + str(i)) for i in range(15)]
    batch = engine.generate(others[:7] + [target] + others[7:], SamplingParams(max_tokens=24, temperature=0.0))
    assert batch[7].output_token_ids == alone.output_token_ids
    assert engine.kv.used_bytes == 0  # every sequence's KV freed at the end


def test_the_reference_models_dtype_keyword_follows_the_transformers_version():
    """from_pretrained took `torch_dtype` before transformers 4.56 and takes `dtype` since
    (a GPU machine's image may hold a 4.x)."""
    from lamina.model.hf_reference import dtype_argument

    assert dtype_argument("4.55.2", torch.bfloat16) == {"torch_dtype": torch.bfloat16}
    assert dtype_argument("4.56.0", torch.float32) == {"dtype": torch.float32}
    assert dtype_argument("4.57.0.dev0", torch.float32) == {"dtype": torch.float32}
    assert dtype_argument("5.23.0", torch.float16) == {"dtype": torch.float16}
