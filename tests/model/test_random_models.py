"""Seeded random-weight models of named shapes (`random:NAME[@SEED]`): the real
configurations' dimensions, the same weights for every reader, greedy decoding through
the engine equal to transformers on them."""

import json

import pytest
import torch

from lamina.engine import Engine, SamplingParams
from lamina.model import random_models
from lamina.model.checkpoints import checkpoint_name, resolve_checkpoint
from lamina.model.errors import CheckpointError
from lamina.model.loader import load_model
from lamina.model.tokenizer import Tokenizer

SPEC = "random:smollm2-135m"


@pytest.fixture(scope="module")
def random_model():
    return load_model(SPEC, weights="float32")


# The published parameter counts of the real checkpoints (their model cards and
# safetensors indexes), which only the real dimensions reproduce.
@pytest.mark.parametrize(("shape", "params"), [
    ("smollm2-135m", 134_515_008), ("smollm2-360m", 361_821_120), ("smollm2-1.7b", 1_711_376_384),
    ("llama-3.2-1b", 1_235_814_400), ("llama-3.2-3b", 3_212_749_824), ("llama-3.1-8b", 8_030_261_248),
])
def test_shapes_have_the_real_checkpoints_parameter_counts(shape, params):
    assert random_models.parameter_count(random_models.SHAPES[shape]) == params
    cfg = random_models.SHAPES[shape]
    assert sum(torch.Size(s).numel() for s in random_models.tensor_shapes(cfg).values()) == params


def test_a_wrong_name_or_seed_is_refused_with_the_shapes_there_are():
    with pytest.raises(CheckpointError, match=r"no random model shape 'llama-9b'.*llama-3\.1-8b"):
        resolve_checkpoint("random:llama-9b")
    with pytest.raises(CheckpointError, match="seed after '@' must be a non-negative integer"):
        resolve_checkpoint("random:llama-3.2-1b@x")


def test_the_weights_are_written_once_with_transformers_index_and_the_tokenizer(random_model):
    source, weights_dir, was_cached = resolve_checkpoint(SPEC)
    assert was_cached and source == weights_dir == random_model.weights_dir
    index = json.loads((weights_dir / "model.safetensors.index.json").read_text())
    cfg = random_models.SHAPES["smollm2-135m"]
    assert set(index["weight_map"]) == set(random_models.tensor_shapes(cfg))
    assert (weights_dir / "tokenizer.json").is_file()
    assert json.loads((weights_dir / "config.json").read_text())["num_hidden_layers"] == 30
    assert checkpoint_name(SPEC) == SPEC  # the served model's name is the spec, not the cache folder
    tok = random_model.tokenizer.hf_tokenizer  # SmolLM2's, from this package: its BOS and EOS ids are the config's
    assert random_model.config.bos_token_id == tok.convert_tokens_to_ids("<|im_start|>") == random_models.BOS_ID
    assert random_model.config.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),) == (random_models.EOS_ID,)
    assert random_model.tokenizer.has_chat_template


def test_the_weights_depend_on_name_and_seed_only():
    shape = (64, 32)
    a = random_models.random_tensor("model.layers.0.mlp.up_proj.weight", shape, seed=0)
    assert torch.equal(a, random_models.random_tensor("model.layers.0.mlp.up_proj.weight", shape, seed=0))
    assert not torch.equal(a, random_models.random_tensor("model.layers.0.mlp.up_proj.weight", shape, seed=1))
    assert not torch.equal(a, random_models.random_tensor("model.layers.1.mlp.up_proj.weight", shape, seed=0))
    assert a.dtype == torch.bfloat16 and 0.015 < a.float().std() < 0.025
    assert torch.equal(random_models.random_tensor("model.norm.weight", (8,), 0), torch.ones(8, dtype=torch.bfloat16))


def test_greedy_tokens_equal_transformers_on_the_random_model(random_model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(random_model.weights_dir), dtype=torch.float32).eval()
    tok = random_model.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode_chat([{"role": "user", "content": "Hi there"}])]
    outs = Engine(random_model).generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.output_token_ids == ref[0, len(ids):].tolist()


def test_ids_past_the_tokenizer_decode_to_no_text():
    """The Llama 3 shapes keep their 128,256-entry vocabulary; SmolLM2's tokenizer spells
    the first 49,152 and the rest decode to nothing (random weights: no id means a word)."""
    t = Tokenizer.from_dir(resolve_checkpoint(SPEC)[1], random_models.SHAPES["llama-3.2-1b"])
    assert t.decode([100_000]) == ""
    assert t.decode([100_000, *t.encode("hello")[-1:]]).strip() == "hello"
