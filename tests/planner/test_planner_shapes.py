import json

import pytest

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
