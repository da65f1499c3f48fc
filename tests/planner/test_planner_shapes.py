import json

import pytest

from lamina.model.errors import CheckpointError
from lamina.planner.shapes import BUILTIN, resolve_model


@pytest.mark.parametrize("name, billions", [
    ("llama-2-7b", 6.74), ("llama-2-13b", 13.02), ("llama-2-70b", 68.98),
    ("llama-3-8b", 8.03), ("llama-3-70b", 70.55), ("smollm2-135m", 0.1345),
])
def test_builtin_parameter_counts_match_the_published_sizes(name, billions):
    assert BUILTIN[name].num_params / 1e9 == pytest.approx(billions, rel=2e-3)


def test_names_are_case_insensitive():
    assert resolve_model("Llama-3-70B") is BUILTIN["llama-3-70b"]


def test_kv_elements_per_token_follow_gqa():
    s = BUILTIN["llama-3-70b"]  # 80 layers, 8 KV heads of 128
    assert s.kv_elements_per_token == 2 * 80 * 8 * 128


def test_config_json_file_and_directory(tmp_path):
    cfg = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from_dir = resolve_model(str(tmp_path))
    from_file = resolve_model(str(tmp_path / "config.json"))
    assert from_dir == from_file
    assert from_dir.num_params == BUILTIN["smollm2-135m"].num_params


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("gpt-17")
    with pytest.raises(CheckpointError, match="no random model shape 'gpt-17'"):
        resolve_model("random:gpt-17")


@pytest.mark.parametrize("spec, billions", [
    ("random:llama-3.1-8b", 8.03), ("llama-3.1-8b", 8.03), ("random:llama-3.2-1b@7", 1.236),
    ("random:smollm2-135m", 0.1345),
])
def test_what_lamina_up_serves_as_random_weights_plans_by_its_shape(spec, billions, tmp_path, monkeypatch):
    monkeypatch.setenv("LAMINA_CACHE_DIR", str(tmp_path))  # nothing may be written for a shape
    shape = resolve_model(spec)
    assert shape.name == spec.removeprefix("random:").partition("@")[0]
    assert shape.num_params / 1e9 == pytest.approx(billions, rel=2e-3)
    assert not any(tmp_path.iterdir())


def test_the_default_gguf_file_plans_as_its_checkpoint():
    from lamina.model.checkpoints import default_model_path

    shape = resolve_model(str(default_model_path()))
    assert shape.num_params == BUILTIN["smollm2-135m"].num_params and shape.name != "model"
