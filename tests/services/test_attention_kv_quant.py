"""An attention worker with 4-bit KV (attention.kv_quant: q4): what it stores, and how
far its answers are from a worker with float32 KV."""

from __future__ import annotations

import pytest
import torch

from lamina.model.attention import batched_attention
from lamina.model.config import ModelConfig
from lamina.model.kv_quant import Q4Rows
from lamina.services.attention.attention_core import AttentionCore
from lamina.services.attention.attention_service import AttentionService
from lamina.services.config import AttentionSection, ConfigError, StackConfig, load_config
from lamina.services.wire import Attend, Kind, StoreKV, frame_tag

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=9,
                  num_kv_heads=3, head_dim=64)
# What a q4 worker's output may differ from a float32 worker's, for K and V of unit
# scale (docs/model.md measures the effect on the model's logits).
Q4_ATOL = 0.3


def _kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 64), torch.randn(n, 3, 64)


def test_q4_keeps_kv_packed_and_answers_from_the_packed_rows():
    torch.manual_seed(0)
    q4 = AttentionCore(CFG, capacity_bytes=1 << 20, num_kv_heads=3, tokens_per_slab=8, kv_quant="q4")
    early = AttentionCore(CFG, capacity_bytes=1 << 20, num_kv_heads=3, tokens_per_slab=8, kv_quant="q4")
    exact = AttentionCore(CFG, capacity_bytes=1 << 20, num_kv_heads=3, tokens_per_slab=8)
    layout = Q4Rows(64)
    history: dict[str, list[list[torch.Tensor]]] = {}  # seq -> layer -> [K, V] as decoded from q4
    for seq, n in (("a", 20), ("b", 9)):
        history[seq] = []
        for layer in range(CFG.num_layers):
            k, v = _kv(n)
            for core in (q4, early, exact):
                core.store(StoreKV(seq, layer, CFG.num_layers, k, v))  # quantized on arrival
            history[seq].append([layout.dequantize(layout.quantize(k)), layout.dequantize(layout.quantize(v))])
    assert q4.slabs.k_pools[0].dtype == torch.uint8 and q4.slabs.config.bytes_per_token == 3 * 2 * 3 * 40
    assert exact.slabs.config.bytes_per_token == 3 * 2 * 3 * 64 * 4
    assert q4.used_bytes == 29 * q4.slabs.config.bytes_per_token
    seqs = [("a", 1), ("b", 2)]
    for _step in range(2):
        for layer in range(CFG.num_layers):
            q, (k, v) = torch.randn(3, 9, 64), _kv(3)
            out, lse = q4.attend(layer, seqs, q, k, v, need_lse=True)
            held = early.attend_held(layer, seqs, q)
            combined = early.append_and_combine(layer, seqs, q, k, v, *held)
            float_out, _ = exact.attend(layer, seqs, q, k, v)
            start = 0
            for s, n in seqs:
                for i, t in enumerate((k, v)):
                    rows = layout.dequantize(layout.quantize(t[start : start + n]))
                    history[s][layer][i] = torch.cat([history[s][layer][i], rows])
                start += n
            ref, ref_lse = batched_attention(q, [n for _, n in seqs], [history[s][layer][0] for s, _ in seqs],
                                             [history[s][layer][1] for s, _ in seqs])
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)  # attention over the decoded rows
            torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(combined, out, atol=1e-5, rtol=1e-4)  # Q-early sees the same rows
            assert (out - float_out).abs().max() < Q4_ATOL


def test_kv_quant_is_validated():
    assert load_config(env={}).attention.kv_quant == "none"
    assert load_config(env={"LAMINA_KV_QUANT": "q4"}).attention.kv_quant == "q4"
    with pytest.raises(ConfigError, match=r"attention\.kv_quant must be one of none, q4"):
        load_config(env={}, overrides={"attention.kv_quant": "q3"})
    with pytest.raises(ValueError, match="kv_quant"):
        AttentionCore(CFG, 1 << 20, 3, kv_quant="int4")


def test_an_attention_worker_with_q4_answers_frames_within_the_tolerance():
    num_layers, head_dim = 30, 64  # the default model (SmolLM2-135M); Redis is never reached: only frames are handled
    services = [AttentionService(StackConfig(redis_url="redis://127.0.0.1:1", attention=AttentionSection(
        workers=1, kv_capacity_bytes=8 << 20, kv_quant=quant))) for quant in ("none", "q4")]
    torch.manual_seed(0)
    prompt = [_kv(12) for _ in range(num_layers)]
    q, (k, v) = torch.randn(1, 9, head_dim), _kv(1)
    outs = []
    for service in services:
        replies = [service._handle(StoreKV("s", layer, num_layers, pk, pv).to_frame(), {}) for layer, (pk, pv) in
                   enumerate(prompt)]
        assert replies[-1].kind == Kind.ACK
        reply = service._handle(Attend(Kind.ATTEND, (0, 1, 0), 0, [("s", 1)], q, k, v).to_frame(), {})
        assert reply.kind == Kind.RESULT and frame_tag(reply) == (0, 1, 0)
        outs.append(reply.tensors[0])
    none, q4 = services
    assert none.core.used_bytes == 13 * 46080 and q4.core.used_bytes == 13 * 7200  # 6.4x less per token
    assert q4.core.capacity_bytes <= 8 << 20 and q4.core.slabs.num_total_tokens > 6 * none.core.slabs.num_total_tokens
    assert (outs[0] - outs[1]).abs().max() < Q4_ATOL
