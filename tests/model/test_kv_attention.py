"""The batched attention kernel over KV in place, against the reference operator.

Every case runs on both paths: the native kernel (skipped where model/_kv_attention is
not built) and the torch fallback."""

from __future__ import annotations

import pytest
import torch

from lamina.model import kv_attention
from lamina.model.attention import attention_with_lse, combine_partials
from lamina.model.kv_attention import SlotBatch, buffer_attention, slot_attention

NOT_BUILT = "model/_kv_attention is not built on this machine (no C compiler at install)"


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    if request.param == "native" and kv_attention.NATIVE is None:
        pytest.skip(NOT_BUILT)
    if request.param == "torch":
        monkeypatch.setattr(kv_attention, "NATIVE", None)
    return request.param


def _reference(q, query_lens, keys, values, causal=True):
    outs, lses, start = [], [], 0
    for n, k, v in zip(query_lens, keys, values):
        qq = q[start : start + n]
        if k.shape[0] == 0:  # no key: out 0, lse -inf
            out, lse = torch.zeros_like(qq), torch.full(qq.shape[:2], float("-inf"))
        else:
            out, lse = attention_with_lse(qq, k, v, causal=causal)
        outs.append(out)
        lses.append(lse)
        start += n
    return torch.cat(outs), torch.cat(lses)


def _pool(lens, hkv, d, shuffle, seed=0):
    """A pool with room to spare and each sequence's slots (scattered when `shuffle`)."""
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(lens) + 7
    k_pool, v_pool = torch.randn(num_slots, hkv, d, generator=g), torch.randn(num_slots, hkv, d, generator=g)
    order = torch.randperm(num_slots, generator=g) if shuffle else torch.arange(num_slots)
    per_seq, start = [], 0
    for n in lens:
        per_seq.append(order[start : start + n].tolist())
        start += n
    return k_pool, v_pool, per_seq


CASES = [  # query_lens, kv_lens, Hq, Hkv, D, shuffled slots, causal
    ([1, 1, 1], [5, 70, 33], 9, 3, 64, False, True),  # decode, G = 3
    ([1, 1], [40, 1], 4, 4, 64, True, True),  # G = 1, scattered slots
    ([4, 1, 6], [4, 9, 30], 6, 2, 48, True, True),  # a whole prompt (n = L) and a prefix + new tokens
    ([2, 3], [100, 3], 8, 2, 13, False, True),  # a head size that is no multiple of 8
    ([1, 3], [300, 150], 16, 2, 128, True, True),  # D = 128, several blocks of keys, G = 8
    ([70, 1], [200, 65], 3, 1, 64, False, True),  # more queries than a block of keys
    ([3, 2, 1], [10, 0, 129], 6, 3, 64, True, False),  # not causal, one sequence with no keys
    ([0, 1, 0], [0, 12, 5], 6, 3, 64, False, True),  # sequences without queries
]


@pytest.mark.parametrize(("query_lens", "kv_lens", "hq", "hkv", "d", "shuffle", "causal"), CASES)
def test_slot_and_buffer_attention_equal_the_reference(path, query_lens, kv_lens, hq, hkv, d, shuffle, causal):
    k_pool, v_pool, per_seq = _pool(kv_lens, hkv, d, shuffle)
    q = torch.randn(sum(query_lens), hq, d)
    keys = [k_pool[torch.tensor(s, dtype=torch.int64)] for s in per_seq]
    values = [v_pool[torch.tensor(s, dtype=torch.int64)] for s in per_seq]
    ref_out, ref_lse = _reference(q, query_lens, keys, values, causal)
    batch = SlotBatch.build(per_seq, k_pool.shape[0])
    out, lse = slot_attention(q, query_lens, k_pool, v_pool, batch, causal=causal)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    out2, lse2 = buffer_attention(q, query_lens, keys, values, causal=causal, need_lse=False)
    assert lse2 is None
    torch.testing.assert_close(out2, ref_out, atol=1e-5, rtol=1e-4)


def test_a_prefix_of_the_slots_and_partials_that_combine_into_the_whole(path):
    """Q-early: attention over the held prefix (non-causal, `kv_lens`) and over the new
    token, combined by log-sum-exp, equals attention over all of them."""
    lens = [17, 64, 3, 1]
    k_pool, v_pool, per_seq = _pool(lens, 3, 64, shuffle=True, seed=3)
    batch = SlotBatch.build(per_seq, k_pool.shape[0])
    q = torch.randn(4, 9, 64)
    held_out, held_lse = slot_attention(q, [1] * 4, k_pool, v_pool, batch, [n - 1 for n in lens], causal=False)
    keys = [k_pool[torch.tensor(s)] for s in per_seq]
    values = [v_pool[torch.tensor(s)] for s in per_seq]
    assert torch.equal(held_out[3], torch.zeros(9, 64)) and (held_lse[3] == float("-inf")).all()  # held nothing
    new_out, new_lse = _reference(q, [1] * 4, [k[-1:] for k in keys], [v[-1:] for v in values])
    out, _ = combine_partials(held_out, held_lse, new_out, new_lse)
    torch.testing.assert_close(out, _reference(q, [1] * 4, keys, values)[0], atol=1e-5, rtol=1e-4)


def test_an_empty_batch(path):
    k_pool, v_pool, _ = _pool([4], 2, 8, shuffle=False)
    out, lse = slot_attention(torch.empty(0, 2, 8), [], k_pool, v_pool, SlotBatch.build([], k_pool.shape[0]))
    assert out.shape == (0, 2, 8) and lse.shape == (0, 2)


def test_the_native_kernel_and_the_torch_path_agree(monkeypatch):
    if kv_attention.NATIVE is None:
        pytest.skip(NOT_BUILT)
    k_pool, v_pool, per_seq = _pool([9, 30, 200], 3, 64, shuffle=True, seed=5)
    batch = SlotBatch.build(per_seq, k_pool.shape[0])
    q = torch.randn(6, 9, 64)
    native = slot_attention(q, [1, 2, 3], k_pool, v_pool, batch)
    monkeypatch.setattr(kv_attention, "NATIVE", None)
    torch_path = slot_attention(q, [1, 2, 3], k_pool, v_pool, batch)
    torch.testing.assert_close(native, torch_path, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("packed", [False, True])
def test_the_kernel_gives_the_same_bits_on_any_number_of_threads(monkeypatch, packed):
    """The kernel shares sequences (and, when there are few, runs of their KV heads)
    out over the products' worker pool: every row is still computed by one thread in
    the same order, so the results are those of one thread, bit for bit."""
    from lamina.model import quant
    from lamina.model.kv_quant import Q4Rows

    if kv_attention.NATIVE is None or quant.NATIVE is None:
        pytest.skip(NOT_BUILT + ", or model/_qmatmul (its worker pool) is not")
    assert kv_attention.NATIVE.pooled()  # the pool is attached: threads > 1 really split
    cases = [*CASES, ([1], [900], 9, 3, 64, True, True), ([1] * 12, [300] * 6 + [7] * 6, 9, 3, 64, False, True),
             ([5, 1], [2000, 40], 32, 8, 128, True, False)]
    for query_lens, kv_lens, hq, hkv, d, shuffle, causal in cases:
        k_pool, v_pool, per_seq = _pool(kv_lens, hkv, d, shuffle)
        layout = Q4Rows(d) if packed and d % 32 == 0 else None
        if layout is not None:
            k_pool, v_pool = layout.quantize(k_pool), layout.quantize(v_pool)
        batch = SlotBatch.build(per_seq, k_pool.shape[0])
        q = torch.randn(sum(query_lens), hq, d)
        results = []
        for threads in (1, 2, 3):
            monkeypatch.setattr(quant, "_kernel_threads", threads)
            results.append(slot_attention(q, query_lens, k_pool, v_pool, batch, causal=causal, packed=layout))
        for out, lse in results[1:]:
            assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1]), (query_lens, kv_lens)


def test_bad_arguments_are_refused_before_the_kernel_runs(path):
    k_pool, v_pool, per_seq = _pool([4], 3, 8, shuffle=False)
    batch = SlotBatch.build(per_seq, k_pool.shape[0])
    q = torch.randn(1, 9, 8)
    refused = [
        ("slots outside the pool", lambda: SlotBatch.build([[0, 99]], k_pool.shape[0])),
        ("slots outside the pool", lambda: SlotBatch.build([[-1]], k_pool.shape[0])),
        ("contiguous int64", lambda: SlotBatch(torch.tensor([0, 1], dtype=torch.int32), (2,), 8)),
        ("2 slots for sequences of 3", lambda: SlotBatch(torch.tensor([0, 1]), (3,), 8)),
        ("q must be a contiguous float32", lambda: slot_attention(q.double(), [1], k_pool, v_pool, batch)),
        ("q must be a contiguous float32",
         lambda: slot_attention(torch.randn(1, 9, 16)[:, :, :8], [1], k_pool, v_pool, batch)),
        ("does not fit KV", lambda: slot_attention(torch.randn(1, 9, 16), [1], k_pool, v_pool, batch)),
        ("does not fit KV", lambda: slot_attention(torch.randn(1, 4, 8), [1], k_pool, v_pool, batch)),
        ("do not add up", lambda: slot_attention(q, [2], k_pool, v_pool, batch)),
        ("do not add up", lambda: slot_attention(q, [2, -1], k_pool, v_pool, batch)),
        ("more queries than keys", lambda: slot_attention(torch.randn(5, 9, 8), [5], k_pool, v_pool, batch)),
        ("must not exceed", lambda: slot_attention(q, [1], k_pool, v_pool, batch, [5])),
        ("must not exceed", lambda: slot_attention(q, [1], k_pool, v_pool, batch, [1, 1])),
        ("1 query lengths for 2", lambda: slot_attention(
            q, [1], k_pool, v_pool, SlotBatch.build([[0], [1]], k_pool.shape[0]))),
        ("does not fit a pool", lambda: slot_attention(q, [1], k_pool[:2].contiguous(), v_pool[:2].contiguous(),
                                                        batch)),
        ("must be contiguous float32", lambda: slot_attention(q, [1], k_pool.half(), v_pool.half(), batch)),
        ("must be contiguous float32", lambda: slot_attention(q, [1], k_pool, v_pool[:4], batch)),
        ("contiguous float32", lambda: buffer_attention(q, [1], [k_pool[:8:2]], [v_pool[:8:2]])),
        ("contiguous float32", lambda: buffer_attention(q, [1], [k_pool[:4]], [v_pool[:3]])),
        ("one of each", lambda: buffer_attention(q, [1], [], [])),
        ("one of each", lambda: buffer_attention(q, [1], [k_pool[:4]], [v_pool[:4], v_pool[:4]])),
    ]
    for message, call in refused:
        with pytest.raises(ValueError, match=message):
            call()


def _buffers(held, capacity, layers=2, hkv=3, d=64, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(layers, 2, c, hkv, d, generator=g) for c in capacity]


def test_a_buffer_batch_appends_every_sequence_and_attends_over_its_buffer(path):
    held, new, capacity = [5, 0, 130, 2], [1, 3, 1, 9], [8, 64, 192, 11]
    buffers = _buffers(held, capacity)
    before = [b.clone() for b in buffers]
    batch = kv_attention.BufferBatch(buffers, held, new)
    for layer in range(2):
        q, k, v = torch.randn(sum(new), 9, 64), torch.randn(sum(new), 3, 64), torch.randn(sum(new), 3, 64)
        batch.append(layer, k, v)
        start = 0
        for buf, old, h, n in zip(buffers, before, held, new):
            assert torch.equal(buf[layer, 0, h : h + n], k[start : start + n])
            assert torch.equal(buf[layer, 1, h : h + n], v[start : start + n])
            assert torch.equal(buf[layer, :, : h], old[layer, :, : h])  # the held tokens stay
            assert torch.equal(buf[1 - layer, :, h + n :], old[1 - layer, :, h + n :])  # nothing else moves
            start += n
        keys = [buf[layer, 0, : h + n] for buf, h, n in zip(buffers, held, new)]
        values = [buf[layer, 1, : h + n] for buf, h, n in zip(buffers, held, new)]
        out, lse = batch.attend(layer, q, need_lse=True)
        ref_out, ref_lse = _reference(q, new, keys, values)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
        if kv_attention.NATIVE is not None:  # into a given output: the same values, that tensor
            given = torch.full_like(q, float("nan"))
            assert batch.attend(layer, q, out=given)[0] is given and torch.equal(given, out)


def test_a_buffer_batch_refuses_what_does_not_fit(path):
    buffers = _buffers([4], [8])
    batch = kv_attention.BufferBatch(buffers, [4], [1])
    refused = [
        ("do not fit a buffer of 8", lambda: kv_attention.BufferBatch(buffers, [4], [5])),
        ("held lengths", lambda: kv_attention.BufferBatch(buffers, [4, 1], [1])),
        ("must be \\[num_layers, 2", lambda: kv_attention.BufferBatch([torch.zeros(2, 3, 8, 3, 64)], [0], [1])),
        ("contiguous float32", lambda: kv_attention.BufferBatch([buffers[0], buffers[0][:, :, :, :2]], [0, 0], [1, 1])),
        ("contiguous float32", lambda: kv_attention.BufferBatch([buffers[0].double()], [0], [1])),
        ("new K and V", lambda: batch.append(0, torch.randn(2, 3, 64), torch.randn(2, 3, 64))),
        ("new K and V", lambda: batch.append(0, torch.randn(1, 3, 64), torch.randn(1, 3, 64).half())),
        ("layer 2 of 2", lambda: batch.append(2, torch.randn(1, 3, 64), torch.randn(1, 3, 64))),
        ("do not add up", lambda: batch.attend(0, torch.randn(2, 9, 64))),
        ("out must be a contiguous float32", lambda: batch.attend(0, torch.randn(1, 9, 64), out=torch.zeros(2, 9, 64))),
    ]
    for message, call in refused:
        with pytest.raises(ValueError, match=message):
            call()


def test_the_engine_attends_decoding_and_prompt_rows_in_any_order(path):
    """LocalAttention: sequences with few new tokens through the kernel, prompts through
    SDPA, in whatever order they come; every new token stored."""
    from lamina.engine.kv import KVStore
    from lamina.engine.step import KERNEL_MAX_QUERIES, LocalAttention
    from lamina.model.batch import StepBatch
    from lamina.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=9,
                      num_kv_heads=3, head_dim=64)
    kv = KVStore(cfg, 64 << 20)
    prompt = KERNEL_MAX_QUERIES + 5
    held, new = [7, 0, 40, 0, 3], [1, prompt, 2, 4, 1]  # a prompt between decoding rows, a short prompt
    ids = [f"s{i}" for i in range(len(held))]
    history = []
    for s, h, n in zip(ids, held, new):
        seq = kv.reserve(s, h + n)
        history.append([[torch.randn(h, 3, 64), torch.randn(h, 3, 64)] for _ in range(2)])
        for layer in range(2):
            seq.buf[layer, 0, :h], seq.buf[layer, 1, :h] = history[-1][layer]
        seq.length = h
    local = LocalAttention(kv, StepBatch.build(ids, [[0] * n for n in new], held))
    for layer in range(2):
        q, k, v = torch.randn(sum(new), 9, 64), torch.randn(sum(new), 3, 64), torch.randn(sum(new), 3, 64)
        out = local.attend(layer, q, k, v)
        start, keys, values = 0, [], []
        for n, hist in zip(new, history):
            keys.append(torch.cat([hist[layer][0], k[start : start + n]]))
            values.append(torch.cat([hist[layer][1], v[start : start + n]]))
            start += n
        torch.testing.assert_close(out, _reference(q, new, keys, values)[0], atol=1e-5, rtol=1e-4)
    local.commit()
    assert [kv.get(s).length for s in ids] == [h + n for h, n in zip(held, new)]


def test_device_attention_equals_the_engines_on_the_same_step():
    """DeviceAttention (the prefill worker's attention off CPU) gives LocalAttention's
    outputs and stores the same K, V; here both run on CPU (on a GPU: tests/e2e/test_stack_prefill_cuda.py)."""
    from lamina.engine.kv import KVStore
    from lamina.engine.step import KERNEL_MAX_QUERIES, DeviceAttention, LocalAttention
    from lamina.model.batch import StepBatch
    from lamina.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=9,
                      num_kv_heads=3, head_dim=64)
    held, new = [7, 0, 40], [1, KERNEL_MAX_QUERIES + 5, 3]
    ids = [f"s{i}" for i in range(len(held))]
    stores = []
    for _ in range(2):
        kv = KVStore(cfg, 64 << 20, device=torch.device("cpu"))
        torch.manual_seed(0)
        for s, h, n in zip(ids, held, new):
            seq = kv.reserve(s, h + n)
            seq.buf[:, :, :h] = torch.randn(2, 2, h, 3, 64)
            seq.length = h
        stores.append(kv)
    batch = StepBatch.build(ids, [[0] * n for n in new], held)
    local, device = LocalAttention(stores[0], batch), DeviceAttention(stores[1], batch)
    for layer in range(2):
        q, k, v = torch.randn(sum(new), 9, 64), torch.randn(sum(new), 3, 64), torch.randn(sum(new), 3, 64)
        torch.testing.assert_close(device.attend(layer, q, k, v), local.attend(layer, q, k, v), atol=1e-5, rtol=1e-4)
    local.commit()
    device.commit()
    for s in ids:
        a, b = stores[0].get(s), stores[1].get(s)
        assert a.length == b.length
        torch.testing.assert_close(a.buf[:, :, :a.length], b.buf[:, :, :b.length])


@pytest.mark.parametrize(("query_lens", "causal", "kv_lens"), [
    ([1, 1, 0, 1], True, None),  # decode (an empty sequence among them)
    ([3, 2, 0, 4], True, None),  # several new tokens each, causal
    ([1, 1, 1, 1], False, [4, 16, 0, 39]),  # Q-early's held part: a prefix of each, one sequence holding none
])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch finds none here)"))])
def test_the_device_path_equals_the_kernel_over_scattered_slots(query_lens, causal, kv_lens, device):
    """lamina.model.device_attention (torch's operators, the path of every device but the
    CPU) gives the native kernel's out and lse on the same pools and slots."""
    from lamina.model.device_attention import PaddedSlots, padded_attention

    torch.manual_seed(0)
    slots_total, hkv, d, hq = 200, 3, 64, 9
    k_pool, v_pool = torch.randn(slots_total, hkv, d), torch.randn(slots_total, hkv, d)
    k_pool[0], v_pool[0] = float("nan"), float("nan")  # a slot no sequence holds (the padding's): never read
    order = torch.randperm(slots_total - 1).add(1).tolist()
    lens, per_seq, start = [5, 17, 0, 40], [], 0
    for n in lens:
        per_seq.append(order[start:start + n])
        start += n
    batch = SlotBatch.build(per_seq, slots_total)
    q = torch.randn(sum(query_lens), hq, d)
    out, lse = slot_attention(q, query_lens, k_pool, v_pool, batch, kv_lens, causal=causal)
    dev_out, dev_lse = padded_attention(q.to(device), query_lens, k_pool.to(device), v_pool.to(device),
                                        PaddedSlots.of(batch, device), kv_lens, causal=causal)
    assert dev_out.device.type == device
    # (A GPU's float32 products may use TF32 when torch is told to allow it; by default they do not.)
    torch.testing.assert_close(dev_out.cpu(), out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(dev_lse.cpu(), lse, atol=2e-6, rtol=1e-5)  # -inf where a query sees nothing, in both
    with pytest.raises(ValueError, match="kv_lens must not exceed"):
        padded_attention(q, query_lens, k_pool, v_pool, PaddedSlots.of(batch, "cpu"), [6, 17, 0, 40])


def _layers(num_layers, lens, hkv, d, seed):
    """Pools of several layers sharing one slot layout (scattered), and each sequence's slots."""
    pools = [_pool(lens, hkv, d, shuffle=True, seed=seed)[:2] for _ in range(num_layers)]
    per_seq = _pool(lens, hkv, d, shuffle=True, seed=seed)[2]
    return [k for k, _ in pools], [v for _, v in pools], per_seq


@pytest.mark.parametrize(("query_lens", "lens"), [([1, 1, 1], [5, 70, 33]), ([1, 3, 2], [9, 3, 200])])
def test_a_slot_step_writes_and_attends_as_the_plain_path_does(query_lens, lens):
    """SlotStep (addressed once per step) against index_put and slot_attention, layer by layer."""
    if kv_attention.NATIVE is None:
        pytest.skip(NOT_BUILT)
    k_pools, v_pools, per_seq = _layers(3, lens, 3, 64, seed=11)
    plain_k, plain_v = [k.clone() for k in k_pools], [v.clone() for v in v_pools]
    batch = SlotBatch.build(per_seq, k_pools[0].shape[0])
    new = torch.tensor([s for seq, n in zip(per_seq, query_lens) for s in seq[len(seq) - n:]], dtype=torch.int64)
    step = kv_attention.SlotStep(kv_attention.SlotPools(k_pools, v_pools), batch, query_lens, new)
    rows = sum(query_lens)
    for layer in (2, 0, 1):
        q, k, v = torch.randn(rows, 9, 64), torch.randn(rows, 3, 64), torch.randn(rows, 3, 64)
        step.append(layer, k, v)
        plain_k[layer][new], plain_v[layer][new] = k, v
        assert torch.equal(k_pools[layer], plain_k[layer]) and torch.equal(v_pools[layer], plain_v[layer])
        out = step.attend(layer, q)
        assert torch.equal(out, slot_attention(q, query_lens, plain_k[layer], plain_v[layer], batch,
                                               need_lse=False)[0])
        given = torch.full_like(q, float("nan"))
        assert step.attend(layer, q, given) is given and torch.equal(given, out)


def test_a_slot_step_keeps_the_pools_it_addresses_alive():
    """A step holds its pools' addresses: the pools must outlive every other reference
    to them (their memory freed under it would be read by the kernel)."""
    if kv_attention.NATIVE is None:
        pytest.skip(NOT_BUILT)
    import gc
    import weakref

    k_pools, v_pools, per_seq = _layers(2, [40, 7], 3, 64, seed=5)
    copies = [k.clone() for k in k_pools], [v.clone() for v in v_pools]
    batch = SlotBatch.build(per_seq, k_pools[0].shape[0])
    new = torch.tensor([seq[-1] for seq in per_seq], dtype=torch.int64)
    step = kv_attention.SlotStep(kv_attention.SlotPools(k_pools, v_pools), batch, [1, 1], new)
    gone = weakref.ref(k_pools[1])
    del k_pools, v_pools
    gc.collect()
    assert gone() is not None
    q = torch.randn(2, 9, 64)
    expected = slot_attention(q, [1, 1], copies[0][1], copies[1][1], batch, need_lse=False)[0]
    assert torch.equal(step.attend(1, q), expected)


def test_a_slot_step_refuses_what_its_kernel_cannot_take():
    if kv_attention.NATIVE is None:
        pytest.skip(NOT_BUILT)
    k_pools, v_pools, per_seq = _layers(2, [4, 6], 3, 8, seed=2)
    batch = SlotBatch.build(per_seq, k_pools[0].shape[0])
    new = torch.tensor([per_seq[0][-1], per_seq[1][-1]])
    pools = kv_attention.SlotPools(k_pools, v_pools)
    step = kv_attention.SlotStep(pools, batch, [1, 1], new)
    overlapping = torch.randn(3, 9, 8)
    shared = (overlapping[:2], overlapping[1:])  # q and an output that overlap by a row
    refused = [
        ("layer 2 of 2", lambda: step.attend(2, torch.randn(2, 9, 8))),
        ("contiguous float32 \\[2, 3, 8\\]", lambda: step.append(0, torch.randn(3, 3, 8), torch.randn(3, 3, 8))),
        ("contiguous float32", lambda: step.attend(0, torch.randn(2, 9, 8).double())),
        ("contiguous float32", lambda: step.attend(0, torch.randn(2, 9, 16)[:, :, :8])),
        ("contiguous float32", lambda: step.attend(0, torch.randn(2, 4, 8))),  # 4 query heads on 3 KV heads
        ("out must not share memory with q", lambda: step.attend(0, shared[0], shared[1])),
        ("out must be a contiguous", lambda: step.attend(0, torch.randn(2, 9, 8), torch.zeros(2, 9, 16)[:, :, ::2])),
        ("at most as many queries", lambda: kv_attention.SlotStep(pools, batch, [5, 1], new)),
        ("int64 \\[2\\]", lambda: kv_attention.SlotStep(pools, batch, [1, 1], new[:1])),
        ("outside the pool", lambda: kv_attention.SlotStep(pools, batch, [1, 1], torch.tensor([0, 99]))),
        ("several shapes", lambda: kv_attention.SlotPools([k_pools[0], torch.zeros(20, 3, 8)],
                                                          [v_pools[0], torch.zeros(20, 3, 8)])),
        ("pool of 17 does not fit a pool of 10", lambda: kv_attention.SlotStep(
            kv_attention.SlotPools([k[:10] for k in k_pools], [v[:10] for v in v_pools]), batch, [1, 1], new)),
    ]
    for match, call in refused:
        with pytest.raises(ValueError, match=match):
            call()


def test_a_step_built_before_the_pools_addresses_grew_still_attends_right():
    """A larger step makes new address arrays; a step of another micro-batch built before
    keeps the ones it was built with."""
    if kv_attention.NATIVE is None:
        pytest.skip(NOT_BUILT)
    lens = [3] * 20
    k_pools, v_pools, per_seq = _layers(2, lens, 3, 8, seed=4)
    pools = kv_attention.SlotPools(k_pools, v_pools)
    small = SlotBatch.build(per_seq[:2], k_pools[0].shape[0])
    first = kv_attention.SlotStep(pools, small, [1, 1], torch.tensor([per_seq[0][-1], per_seq[1][-1]]))
    before = pools.bases
    whole = SlotBatch.build(per_seq, k_pools[0].shape[0])
    kv_attention.SlotStep(pools, whole, [1] * 20, torch.tensor([s[-1] for s in per_seq]))
    assert pools.bases is not before
    q = torch.randn(2, 9, 8)
    assert torch.equal(first.attend(1, q), slot_attention(q, [1, 1], k_pools[1], v_pools[1], small, need_lse=False)[0])
