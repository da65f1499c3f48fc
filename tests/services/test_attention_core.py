"""The attention worker's core over several decode steps: plain and Q-early paths, with
micro-batches interleaving their layers, against attention over the whole history."""

from __future__ import annotations

import pytest
import torch

from model.attention import batched_attention
from model.config import ModelConfig
from services.attention_core import AttentionCore
from services.wire import StoreKV

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=6,
                  num_kv_heads=3, head_dim=8)


@pytest.mark.parametrize("kv_heads", [3, 1])  # all of the model's KV heads, or a head-level share
def test_plain_and_q_early_steps_equal_attention_over_the_history(kv_heads):
    torch.manual_seed(0)
    hq = CFG.num_groups * kv_heads
    plain = AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=kv_heads)
    early = AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=kv_heads)
    # Two micro-batches of sequences with different prompt lengths.
    micro_batches = [["a", "b"], ["c", "d", "e"]]
    history: dict[str, list[list[torch.Tensor]]] = {}  # seq -> layer -> [K rows, V rows]
    for i, s in enumerate("abcde"):
        n = 3 + 5 * i
        history[s] = []
        for layer in range(CFG.num_layers):
            k, v = torch.randn(n, kv_heads, 8), torch.randn(n, kv_heads, 8)
            history[s].append([k, v])
            for core in (plain, early):
                core.store(StoreKV(s, layer, CFG.num_layers, k, v))
    for _step in range(3):
        new = {s: [(torch.randn(1, hq, 8), torch.randn(1, kv_heads, 8), torch.randn(1, kv_heads, 8))
                   for _ in range(CFG.num_layers)] for s in history}
        for layer in range(CFG.num_layers):
            for mb in micro_batches:  # layer l of one micro-batch, then of the other
                seqs = [(s, 1) for s in mb]
                q = torch.cat([new[s][layer][0] for s in mb])
                k = torch.cat([new[s][layer][1] for s in mb])
                v = torch.cat([new[s][layer][2] for s in mb])
                out, lse = plain.attend(layer, seqs, q, k, v, need_lse=True)
                held_out, held_lse = early.attend_held(layer, seqs, q)
                combined = early.append_and_combine(layer, seqs, q, k, v, held_out, held_lse)
                for s, kk, vv in zip(mb, k, v):
                    history[s][layer][0] = torch.cat([history[s][layer][0], kk[None]])
                    history[s][layer][1] = torch.cat([history[s][layer][1], vv[None]])
                ref, ref_lse = batched_attention(q, [1] * len(mb), [history[s][layer][0] for s in mb],
                                                 [history[s][layer][1] for s in mb])
                torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
                torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)
                torch.testing.assert_close(combined, ref, atol=2e-5, rtol=1e-4)
    for core in (plain, early):
        assert core.slabs.num_tokens("e") == 3 + 5 * 4 + 3
        core.free(list(history))
        assert core.num_sequences == 0 and core.used_bytes == 0
