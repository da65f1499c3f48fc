"""A request's n choices: seeds, ids, KV reservations and admission (pure functions),
and the attention core's fork of a prompt for them."""

from __future__ import annotations

import pytest
import torch

from lamina.model.attention import batched_attention
from lamina.model.config import ModelConfig
from lamina.services.attention.attention_core import AttentionCore
from lamina.services.protos import lamina_pb2
from lamina.services.scheduler.choices import choice_id, choice_seed, reserve_tokens
from lamina.services.scheduler.scheduler_state import Request, can_admit
from lamina.services.wire import RemoteError, StoreKV

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=9,
                  num_kv_heads=3, head_dim=8)


def test_choice_seeds_are_fixed_distinct_and_63_bit():
    assert choice_seed(1234, 1) == choice_seed(1234, 1)  # a pure function of (seed, index)
    seeds = [choice_seed(1234, i) for i in range(1, 16)] + [choice_seed(1235, i) for i in range(1, 16)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 1 << 63 for s in seeds)
    assert choice_seed((1 << 64) - 1, 15) < 1 << 63
    # Pinned: a change of the derivation changes every seeded n > 1 output (docs/api.md).
    assert choice_seed(0, 1) == int.from_bytes(__import__("hashlib").blake2b(
        bytes(8) + (1).to_bytes(4, "little"), digest_size=8).digest(), "little") % (1 << 63)


def test_choice_ids_and_reservations():
    assert choice_id("cmpl-1", 0, 1) == "cmpl-1"
    assert [choice_id("cmpl-1", i, 3) for i in range(3)] == ["cmpl-1/0", "cmpl-1/1", "cmpl-1/2"]
    # A 10-token prompt that may grow to 30 tokens, with 2 choices to fork: 30 + 2 * 20.
    assert reserve_tokens(10, 30, 2) == 70 and reserve_tokens(10, 30, 0) == 30
    req = Request("r/0", list(range(10)), lamina_pb2.SamplingParams(max_tokens=20), None,  # type: ignore[arg-type]
                  choice_seeds=[5, 6])
    assert req.reserve_tokens == 70 and req.num_slots == 3
    req.forked = True
    assert req.reserve_tokens == 30 and req.num_slots == 3


def test_admission_counts_every_choice():
    assert can_admit(2, 1, 4) and not can_admit(3, 1, 4)  # one sequence, as before
    assert can_admit(1, 0, 4, num_new=3) and not can_admit(2, 0, 4, num_new=3)


def _store(core: AttentionCore, seq: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    kv = [(torch.randn(n, 3, 8), torch.randn(n, 3, 8)) for _ in range(CFG.num_layers)]
    for layer, (k, v) in enumerate(kv):
        core.store(StoreKV(seq, layer, CFG.num_layers, k, v))
    return kv


def test_forked_choices_attend_over_the_shared_prompt_and_their_own_tokens():
    torch.manual_seed(0)
    core = AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=3, tokens_per_slab=4)
    prompt = _store(core, "r/0", 6)
    core.fork("r/0", ["r/1", "r/2"], 6)
    assert core.num_sequences == 3 and core.slabs.num_used_tokens == 6
    assert core.slabs.num_sequence_tokens == 18
    seqs = [("r/0", 1), ("r/1", 1), ("r/2", 1)]
    # What each choice must attend over, per layer: the prompt, then its own tokens.
    history = {s: [list(kv) for kv in prompt] for s, _ in seqs}
    for _ in range(3):  # three decode steps, every choice with its own new token
        for layer in range(CFG.num_layers):
            q, k, v = torch.randn(3, 9, 8), torch.randn(3, 3, 8), torch.randn(3, 3, 8)
            out, _ = core.attend(layer, seqs, q, k, v)
            for i, (s, _) in enumerate(seqs):
                hk, hv = history[s][layer]
                history[s][layer] = [torch.cat([hk, k[i:i + 1]]), torch.cat([hv, v[i:i + 1]])]
            want, _ = batched_attention(q, [1, 1, 1], [history[s][layer][0] for s, _ in seqs],
                                        [history[s][layer][1] for s, _ in seqs])
            torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    # 6 shared prompt tokens and 3 of each choice's own: not 3 copies of the prompt.
    assert core.slabs.num_used_tokens == 6 + 9 and core.slabs.num_sequence_tokens == 3 * 9
    core.free(["r/0", "r/2"])
    assert core.slabs.num_used_tokens == 9  # r/1 still holds the prompt and its 3 tokens
    core.free(["r/1"])
    assert core.slabs.num_used_tokens == 0


def test_a_fork_that_does_not_fit_changes_nothing():
    core = AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=3)
    _store(core, "p", 4)
    core.store(StoreKV("half", 0, CFG.num_layers, torch.randn(2, 3, 8), torch.randn(2, 3, 8)))
    cases = [("nope", ["c"], 4, "unknown_sequence"), ("half", ["c"], 2, "unknown_sequence"),
             ("p", ["c"], 5, "bad_request"), ("p", ["c"], 0, "bad_request"), ("p", ["c", "c"], 4, "bad_request"),
             ("p", ["p"], 4, "bad_request"), ("p", ["c", "half"], 4, "bad_request")]
    for source, seq_ids, n, code in cases:
        with pytest.raises(RemoteError) as info:
            core.fork(source, seq_ids, n)
        assert info.value.code == code, (source, seq_ids, n)
    assert core.num_sequences == 2 and not core.slabs.has_request("c") and core.slabs.num_sequence_tokens == 6
