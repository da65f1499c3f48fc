"""The attention worker's core over several decode steps: plain and Q-early paths, with
micro-batches interleaving their layers, against attention over the whole history."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import INTERPRETED, NO_CUDA

from lamina.model import kv_attention
from lamina.model.attention import batched_attention
from lamina.model.config import ModelConfig
from lamina.services.attention import attention_core
from lamina.services.attention.attention_core import AttentionCore
from lamina.services.wire import RemoteError, StoreKV

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=9,
                  num_kv_heads=3, head_dim=8)


class History:
    """Every sequence's K and V per layer, as the reference sees them."""

    def __init__(self, kv_heads: int, dtype: torch.dtype = torch.float32) -> None:
        self.kv_heads = kv_heads
        self.dtype = dtype  # the cores' KV dtype: the history holds K, V as rounded to it
        self.kv: dict[str, list[list[torch.Tensor]]] = {}  # seq -> layer -> [K rows, V rows]

    def prompt(self, cores: list[AttentionCore], seq: str, n: int) -> None:
        self.kv[seq] = []
        for layer in range(CFG.num_layers):
            k, v = _rounded(torch.randn(n, self.kv_heads, 8), self.dtype), _rounded(torch.randn(n, self.kv_heads, 8),
                                                                                     self.dtype)
            self.kv[seq].append([k, v])
            for core in cores:
                core.store(StoreKV(seq, layer, CFG.num_layers, k, v))

    def append(self, layer: int, seqs: list[tuple[str, int]], k: torch.Tensor, v: torch.Tensor) -> None:
        start = 0
        for s, n in seqs:
            self.kv[s][layer][0] = torch.cat([self.kv[s][layer][0], k[start : start + n]])
            self.kv[s][layer][1] = torch.cat([self.kv[s][layer][1], v[start : start + n]])
            start += n

    def attention(self, layer: int, seqs: list[tuple[str, int]], q: torch.Tensor):
        return batched_attention(q, [n for _, n in seqs], [self.kv[s][layer][0] for s, _ in seqs],
                                 [self.kv[s][layer][1] for s, _ in seqs])


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a KV pool of `dtype` holds it, in float32 (exact for float32 itself)."""
    return t.to(dtype).float()


def _step_inputs(seqs: list[tuple[str, int]], hq: int, kv_heads: int, dtype: torch.dtype = torch.float32):
    rows = sum(n for _, n in seqs)
    return (torch.randn(rows, hq, 8), _rounded(torch.randn(rows, kv_heads, 8), dtype),
            _rounded(torch.randn(rows, kv_heads, 8), dtype))


@pytest.mark.parametrize("kv_heads", [3, 1])  # all of the model's KV heads (G = 3), or a head-level share
@pytest.mark.parametrize("new_tokens", [[1, 1, 1], [2, 1, 3]])  # decode, or several new tokens per sequence
# float32: the native kernel; bfloat16 on the CPU: torch's operators over a bfloat16 slab,
# or the GPU's paged Triton kernel (under Triton's interpreter, its products in float32),
# given K and V it holds exactly, so the same tolerance. On a GPU the paged kernel takes
# its products in bfloat16, as FlashAttention does: bfloat16's tolerance.
@pytest.mark.parametrize(("device", "dtype", "paged"), [
    ("cpu", torch.float32, False), ("cpu", torch.bfloat16, False),
    pytest.param("cpu", torch.bfloat16, True, marks=INTERPRETED),
    pytest.param("cuda", torch.bfloat16, True, marks=NO_CUDA),
])
def test_plain_and_q_early_steps_equal_attention_over_the_history(kv_heads, new_tokens, device, dtype, paged,
                                                                   monkeypatch):
    if paged:  # on a GPU the core takes the paged kernel itself; on the CPU only when told to
        monkeypatch.setattr("lamina.services.attention.attention_core.paged_available", lambda device: True)
    tol = {"atol": 2e-2, "rtol": 2e-2} if device == "cuda" else {"atol": 1e-5, "rtol": 1e-4}
    torch.manual_seed(0)
    hq = CFG.num_groups * kv_heads
    # Small slabs: sequences that grow in turn get slots scattered over the pool.
    plain = AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=kv_heads, tokens_per_slab=4, device=device,
                          dtype=dtype)
    early = AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=kv_heads, tokens_per_slab=4, device=device,
                          dtype=dtype)
    native = device == "cpu" and dtype == torch.float32
    assert plain.native == native and plain.paged == paged and plain.slabs.k_pools[0].dtype == dtype
    assert plain.slabs.k_pools[0].device.type == device
    history = History(kv_heads, dtype)
    micro_batches = [["a", "b"], ["c", "d", "e"]]  # disjoint sets of sequences on one worker
    for i, s in enumerate("abcde"):
        history.prompt([plain, early], s, 3 + 5 * i)
    for _step in range(3):
        batches = [[(s, n) for s, n in zip(mb, new_tokens)] for mb in micro_batches]
        inputs = [[_step_inputs(seqs, hq, kv_heads, dtype) for _ in range(CFG.num_layers)] for seqs in batches]
        for layer in range(CFG.num_layers):
            for seqs, per_layer in zip(batches, inputs):  # layer l of one micro-batch, then of the other
                q, k, v = per_layer[layer]
                out, lse = plain.attend(layer, seqs, q, k, v, need_lse=True)
                held_out, held_lse = early.attend_held(layer, seqs, q)
                combined = early.append_and_combine(layer, seqs, q, k, v, held_out, held_lse)
                history.append(layer, seqs, k, v)
                ref, ref_lse = history.attention(layer, seqs, q)
                torch.testing.assert_close(out, ref, **tol)
                torch.testing.assert_close(lse, ref_lse, atol=tol["atol"], rtol=tol["rtol"] / 10)
                torch.testing.assert_close(combined, out, **tol)
    for core in (plain, early):
        assert core.slabs.num_tokens("e") == 3 + 5 * 4 + 3 * new_tokens[2]
        core.free(list(history.kv))
        assert core.num_sequences == 0 and core.used_bytes == 0


def test_q_early_interleaves_its_halves_across_micro_batches():
    """Micro-batch B's first half arrives between A's halves, at every layer."""
    torch.manual_seed(1)
    core = AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=3, tokens_per_slab=4)
    history = History(3)
    for s, n in [("a", 4), ("b", 9), ("c", 1)]:
        history.prompt([core], s, n)
    mb_a, mb_b = [("a", 1), ("b", 1)], [("c", 1)]
    for _step in range(2):
        for layer in range(CFG.num_layers):
            qa, ka, va = _step_inputs(mb_a, 9, 3)
            qb, kb, vb = _step_inputs(mb_b, 9, 3)
            held_a = core.attend_held(layer, mb_a, qa)
            held_b = core.attend_held(layer, mb_b, qb)
            out_a = core.append_and_combine(layer, mb_a, qa, ka, va, *held_a)
            out_b = core.append_and_combine(layer, mb_b, qb, kb, vb, *held_b)
            history.append(layer, mb_a, ka, va)
            history.append(layer, mb_b, kb, vb)
            torch.testing.assert_close(out_a, history.attention(layer, mb_a, qa)[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(out_b, history.attention(layer, mb_b, qb)[0], atol=1e-5, rtol=1e-4)


def test_a_sequence_freed_and_stored_again_is_read_afresh():
    """The slots kept for a micro-batch follow its sequences: one freed and prefilled
    again under the same id, reaching the same length, is read from its new slots."""
    torch.manual_seed(2)
    core = AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=3, tokens_per_slab=4)
    history = History(3)
    seqs = [("a", 1)]
    for prompt_len in (5, 5):
        history.prompt([core], "a", prompt_len)
        for layer in range(CFG.num_layers):
            q, k, v = _step_inputs(seqs, 9, 3)
            out, _ = core.attend(layer, seqs, q, k, v)
            history.append(layer, seqs, k, v)
            torch.testing.assert_close(out, history.attention(layer, seqs, q)[0], atol=1e-5, rtol=1e-4)
        core.free(["a"])
        history.prompt([core], "x", 3)  # takes the freed slots


def test_a_frame_that_does_not_fit_changes_nothing():
    core = AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=1)
    History(1).prompt([core], "a", 4)
    q, k, v = torch.randn(1, 3, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    bad = [
        (torch.randn(2, 3, 8), k, v),  # rows for two tokens
        (torch.randn(1, 9, 8), k, v),  # the model's query heads, not this share's
        (q, torch.randn(2, 1, 8), torch.randn(2, 1, 8)),
        (q, torch.randn(1, 3, 8), torch.randn(1, 3, 8)),  # KV heads this worker does not hold
    ]
    for qq, kk, vv in bad:
        with pytest.raises(RemoteError, match="bad_request"):
            core.attend(0, [("a", 1)], qq, kk, vv)
        with pytest.raises(RemoteError, match="bad_request"):
            core.append_and_combine(0, [("a", 1)], qq, kk, vv, torch.zeros(1, 3, 8), torch.zeros(1, 3))
    with pytest.raises(RemoteError, match="bad_request"):
        core.attend_held(0, [("a", 1)], torch.randn(1, 9, 8))
    assert core.slabs.num_tokens("a") == 4
    out, _ = core.attend(0, [("a", 1)], q, k, v)
    assert out.shape == (1, 3, 8) and core.slabs.num_tokens("a") == 5


@pytest.mark.parametrize("sent", [torch.bfloat16, torch.float16])
def test_a_float32_worker_serves_a_sender_of_another_dtype_in_its_dtype(sent):
    """A bfloat16 model worker beside a float32 attention worker: its Q, K and V are
    widened, attended by the native kernel (plain and Q-early), and the outputs go back in
    the sender's dtype, equal to the float32 answer on the same (rounded) values."""
    torch.manual_seed(0)
    cores = [AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=3, tokens_per_slab=4) for _ in range(3)]
    assert all(c.native for c in cores)
    prompt_k, prompt_v = torch.randn(5, 3, 8).to(sent), torch.randn(5, 3, 8).to(sent)
    for core in cores:
        for layer in range(CFG.num_layers):
            core.store(StoreKV("a", layer, CFG.num_layers, prompt_k, prompt_v))
    q, k, v = torch.randn(1, 9, 8).to(sent), torch.randn(1, 3, 8).to(sent), torch.randn(1, 3, 8).to(sent)
    out, _ = cores[0].attend(0, [("a", 1)], q, k, v)
    ref, _ = cores[1].attend(0, [("a", 1)], q.float(), k.float(), v.float())
    held_out, held_lse = cores[2].attend_held(0, [("a", 1)], q)
    early = cores[2].append_and_combine(0, [("a", 1)], q, k, v, held_out, held_lse)
    assert out.dtype == early.dtype == sent
    torch.testing.assert_close(out, ref.to(sent), atol=0, rtol=0)
    torch.testing.assert_close(early.float(), ref, atol=1e-2, rtol=1e-2)  # rounded once more on the way


def test_retain_frees_what_no_request_holds_once_untouched_for_idle_s(monkeypatch):
    """The scheduler's reconciliation: sequences outside `live` go once untouched for
    idle_s (a whole prompt, a store cut off after its first layer); live ones, and any
    touched more recently (a step, a store still arriving), stay and keep working."""
    import lamina.services.attention.attention_core as attention_core

    now = [100.0]
    monkeypatch.setattr(attention_core, "monotonic", lambda: now[0])
    torch.manual_seed(3)
    core = AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=3, tokens_per_slab=4)
    history = History(3)
    for seq in ("live", "leaked", "stepped"):
        history.prompt([core], seq, 4)
    k = v = torch.randn(2, 3, 8)
    core.store(StoreKV("half", 0, CFG.num_layers, k, v))  # its other layers never came
    core.fork("live", ["child"], 4)
    now[0] = 110.0
    q, sk, sv = _step_inputs([("stepped", 1)], 9, 3)
    core.attend(0, [("stepped", 1)], q, sk, sv)  # a step at 110 s: touched then
    live = {"live", "child"}
    assert core.retain(live, idle_s=20.0) == [] and core.num_sequences == 5  # nothing 20 s old yet
    now[0] = 125.0
    assert sorted(core.retain(live, idle_s=20.0)) == ["half", "leaked"]  # 25 s untouched; "stepped": 15 s
    assert core.num_sequences == 3
    with pytest.raises(RemoteError, match="without its layer 0"):
        core.store(StoreKV("half", 1, CFG.num_layers, k, v))  # the rest of the freed store is refused
    now[0] = 131.0
    assert core.retain(live, idle_s=20.0) == ["stepped"]
    for layer in range(CFG.num_layers):  # the live ones are whole
        q, sk, sv = _step_inputs([("live", 1), ("child", 1)], 9, 3)
        out, _ = core.attend(layer, [("live", 1), ("child", 1)], q, sk, sv)
        assert out.shape == (2, 9, 8)
    assert core.retain(set(), idle_s=1000.0) == []  # just stepped


@pytest.mark.parametrize("new_tokens", [[1, 1, 1], [2, 1, 3]])
def test_the_decode_path_attends_through_one_addressed_step_per_micro_batch(monkeypatch, new_tokens):
    """Without lse (what a model worker asks), CPU float32: every layer writes and attends
    through the step's SlotStep, built once per step and micro-batch, equal to attention
    over the history, whatever the other micro-batch did in between."""
    if kv_attention.NATIVE is None:
        pytest.skip("model/_kv_attention is not built on this machine (no C compiler at install)")
    built, attended = [], []
    monkeypatch.setattr(attention_core, "SlotStep", lambda *a: built.append(kv_attention.SlotStep(*a)) or built[-1])
    real_attend = kv_attention.SlotStep.attend
    monkeypatch.setattr(kv_attention.SlotStep, "attend", lambda self, *a: attended.append(1) or real_attend(self, *a))
    torch.manual_seed(1)
    core = AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=3, tokens_per_slab=4)
    history = History(3)
    micro_batches = [["a", "b"], ["c", "d", "e"]]
    for i, s in enumerate("abcde"):
        history.prompt([core], s, 3 + 5 * i)
    steps = 3
    for _step in range(steps):
        batches = [[(s, n) for s, n in zip(mb, new_tokens)] for mb in micro_batches]
        inputs = [[_step_inputs(seqs, 9, 3) for _ in range(CFG.num_layers)] for seqs in batches]
        for layer in range(CFG.num_layers):
            for seqs, per_layer in zip(batches, inputs):
                q, k, v = per_layer[layer]
                out, lse = core.attend(layer, seqs, q, k, v)
                history.append(layer, seqs, k, v)
                assert lse is None
                torch.testing.assert_close(out, history.attention(layer, seqs, q)[0], atol=1e-5, rtol=1e-4)
    assert len(built) == steps * len(micro_batches) and len(attended) == steps * len(micro_batches) * CFG.num_layers


def test_a_local_step_equals_attend_and_checks_its_first_layer_whole(monkeypatch):
    """local_step (a colocated model worker's step): every layer's output bit-equal to
    `attend` on a twin core; its later layers go through the step's SlotStep without
    `attend`'s frame checks, a layer out of order goes through `attend` again, and a
    frame `attend` refuses is refused at layer 0 with nothing changed."""
    if kv_attention.NATIVE is None:
        pytest.skip("model/_kv_attention is not built on this machine (no C compiler at install)")
    torch.manual_seed(3)
    cores = [AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=3, tokens_per_slab=4) for _ in range(2)]
    history = History(3)
    for i, s in enumerate("ab"):
        history.prompt(cores, s, 5 + 7 * i)
    checked = []
    real_check = cores[0]._check
    monkeypatch.setattr(cores[0], "_check", lambda *a: checked.append(a[0]) or real_check(*a))
    seqs = [("a", 1), ("b", 1)]
    for order in ([0, 1, 2], [0, 2, 1]):
        step = cores[0].local_step(seqs)
        checked.clear()
        for layer in order:
            q, k, v = _step_inputs(seqs, 9, 3)
            out = step(layer, q, k, v)
            assert torch.equal(out, cores[1].attend(layer, seqs, q, k, v)[0])
        # In order, only layer 0 is checked; out of order, every layer from the jump on.
        assert checked == ([0] if order == [0, 1, 2] else [0, 2, 1])
    assert cores[0].slabs.num_tokens("a") == cores[1].slabs.num_tokens("a") == 7
    q, k, v = _step_inputs(seqs, 9, 3)
    with pytest.raises(RemoteError, match="unknown_sequence"):
        cores[0].local_step([("a", 1), ("nobody", 1)])(0, q, k, v)
    assert cores[0].slabs.num_tokens("a") == 7


@pytest.mark.parametrize(("device", "dtype", "paged", "calls"), [
    ("cpu", torch.float32, False, 0),  # the native kernel: nothing to compile
    pytest.param("cpu", torch.bfloat16, True, 2, marks=INTERPRETED),
    pytest.param("cuda", torch.bfloat16, True, 2, marks=NO_CUDA),
])
def test_the_paged_kernel_is_warmed_up_without_storing_anything(device, dtype, paged, calls, monkeypatch):
    """warm_up: the paged kernel run once per query dtype a frame may bring (the pools' and
    float32) before any frame; the core holds nothing after, and serves a step as before."""
    if paged:
        monkeypatch.setattr("lamina.services.attention.attention_core.paged_available", lambda device: True)
    launched: list[torch.dtype] = []
    real = attention_core.paged_attention
    monkeypatch.setattr(attention_core, "paged_attention",
                        lambda q, *a, **k: launched.append(q.dtype) or real(q, *a, **k))
    core = AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=3, tokens_per_slab=4, device=device, dtype=dtype)
    assert core.warm_up() == calls and launched == [dtype, torch.float32][:calls]
    assert core.num_sequences == 0 and core.used_bytes == 0
    history = History(3, dtype)
    history.prompt([core], "a", 5)
    q, k, v = _step_inputs([("a", 1)], CFG.num_groups * 3, 3, dtype)
    out, _ = core.attend(0, [("a", 1)], q, k, v)
    assert out.shape == q.shape and torch.isfinite(out.float()).all()


SENTINEL = 7.0  # what every pool slot holds where nothing was stored or written


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=INTERPRETED), pytest.param("cuda", marks=NO_CUDA)])
def test_decode_frames_through_the_attention_graphs_equal_the_history_and_write_nothing_else(device, monkeypatch):
    """cuda_graphs: decode frames (a new token a sequence, in the pools' dtype, no lse)
    attend through lamina.model.attend_graphs (on the CPU its bodies run eagerly, the
    kernels under Triton's interpreter; on a GPU they are captured and replayed). Two
    micro-batches interleave their layers over three steps: one of 3 rows (a bucket of 4,
    a padding row) whose longest sequence crosses a context bucket, one of 1 row. Each
    frame equals attention over the history; each step writes its new K, V into the new
    slots and nothing else anywhere in the pools; one capture per (layer, batch bucket,
    context bucket). Frames the graphs do not serve (several new tokens, lse asked, Q in
    another dtype) take the eager path, agree with the history and replay nothing."""
    from lamina.model import step_graphs

    monkeypatch.setattr(step_graphs, "CONTEXT_MIN", 16)
    if device == "cpu":  # the paged kernel serves the CPU only when told to (under the interpreter)
        monkeypatch.setattr("lamina.services.attention.attention_core.paged_available", lambda device: True)
    dtype, kv_heads, hq = torch.bfloat16, 3, CFG.num_heads
    tol = {"atol": 2e-2, "rtol": 2e-2}  # the output in bfloat16
    assert AttentionCore(CFG, capacity_bytes=1 << 20, num_kv_heads=kv_heads, cuda_graphs=True).graphs is None  # native
    core = AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=kv_heads, tokens_per_slab=4, device=device,
                         dtype=dtype, cuda_graphs=True)
    graphs = core.graphs
    assert graphs is not None and graphs.capture == (device == "cuda")
    pools = [*core.slabs.k_pools, *core.slabs.v_pools]
    for pool in pools:
        pool.fill_(SENTINEL)
    torch.manual_seed(0)
    history = History(kv_heads, dtype)
    for s, n in {"a": 14, "b": 3, "c": 8, "d": 20}.items():
        history.prompt([core], s, n)
    micro_batches = [["a", "b", "c"], ["d"]]
    for _step in range(3):
        batches = [[(s, 1) for s in mb] for mb in micro_batches]
        before = [p.clone() for p in pools]
        written: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # seq -> per layer (k row, v row)
        for layer in range(CFG.num_layers):
            for seqs in batches:  # layer l of one micro-batch, then of the other
                # On the core's device, as cuda_ipc delivers a frame there (the output
                # comes back on Q's device); the history is kept on the CPU.
                q, k, v = (t.to(device, dtype) for t in _step_inputs(seqs, hq, kv_heads))
                out, lse = core.attend(layer, seqs, q, k, v)
                assert lse is None and out.dtype == dtype and out.device == q.device
                history.append(layer, seqs, k.float().cpu(), v.float().cpu())
                torch.testing.assert_close(out.float().cpu(), history.attention(layer, seqs, q.float().cpu())[0],
                                           **tol)
                for i, (s, _) in enumerate(seqs):
                    written.setdefault(s, []).append((k[i], v[i]))
        for pool, old, layer, kind in zip(pools, before, [*range(CFG.num_layers)] * 2, [0] * CFG.num_layers
                                          + [1] * CFG.num_layers):
            new = [core.slabs.slots(s)[-1] for s in written]
            rows = torch.stack([written[s][layer][kind] for s in written])
            assert torch.equal(pool[new], rows.to(device))  # the new K, V as sent, in their slots
            pool[new] = old[new]
            assert torch.equal(pool, old)  # nothing else written
            pool[new] = rows.to(device)
    # (layer, bucket 4, context 16), (layer, bucket 4, context 32), (layer, bucket 1, context 32)
    assert (graphs.captures, graphs.replays, graphs.failures) == (3 * CFG.num_layers, 3 * 2 * CFG.num_layers, 0)
    served = graphs.replays
    for layer in range(CFG.num_layers):
        for seqs, need_lse, q_dtype in (([("b", 2)], False, dtype), ([("a", 1), ("c", 1)], True, dtype),
                                        ([("d", 1)], False, torch.float32)):
            q, k, v = (t.to(device) for t in _step_inputs(seqs, hq, kv_heads, dtype))
            k, v = k.to(dtype), v.to(dtype)
            out, _ = core.attend(layer, seqs, q.to(q_dtype), k, v, need_lse=need_lse)
            assert out.device == q.device
            history.append(layer, seqs, k.float().cpu(), v.float().cpu())
            want = history.attention(layer, seqs, q.to(q_dtype).float().cpu())[0]
            torch.testing.assert_close(out.float().cpu(), want, **tol)
    assert graphs.replays == served


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=INTERPRETED), pytest.param("cuda", marks=NO_CUDA)])
def test_attention_graphs_captured_at_start_write_nothing_and_serve_the_later_frames(device, monkeypatch):
    """A worker's warm-up captures the decode attention's graphs before any frame
    (`AttendGraphs.prepare`: on the CPU each body runs once over its static tensors, the
    kernels under Triton's interpreter): one per (layer, batch bucket, context bucket),
    none again, and nothing written into the pools by their padding rows; out of memory
    at one key, those before it are kept and the next prepare makes the rest. Frames then
    replay them without a capture and equal attention over the history."""
    from lamina.model import step_graphs

    monkeypatch.setattr(step_graphs, "CONTEXT_MIN", 16)
    if device == "cpu":
        monkeypatch.setattr("lamina.services.attention.attention_core.paged_available", lambda device: True)
    dtype, kv_heads = torch.bfloat16, 3
    core = AttentionCore(CFG, capacity_bytes=4 << 20, num_kv_heads=kv_heads, tokens_per_slab=4, device=device,
                         dtype=dtype, cuda_graphs=True)
    graphs = core.graphs
    assert graphs is not None
    pools = [*core.slabs.k_pools, *core.slabs.v_pools]
    for pool in pools:
        pool.fill_(SENTINEL)
    capture = graphs._capture

    def out_of_memory_at_the_last_key(key, st):  # (layer, batch bucket, context bucket)
        if key[1:] == (4, 32):
            raise torch.OutOfMemoryError("CUDA out of memory (made up)")
        return capture(key, st)

    graphs._capture = out_of_memory_at_the_last_key  # type: ignore[method-assign]
    with pytest.raises(torch.OutOfMemoryError):  # the graphs made before it kept, that key left to later
        graphs.prepare(CFG.num_layers, (1, 2, 4), step_graphs.context_buckets_up_to(20))  # contexts 16, 32
    assert graphs.captures == CFG.num_layers * 5
    del graphs._capture
    made = CFG.num_layers * 5 + graphs.prepare(CFG.num_layers, (1, 2, 4), step_graphs.context_buckets_up_to(20))
    assert made == CFG.num_layers * 3 * 2 == graphs.captures and graphs.replays == 0
    assert graphs.prepare(CFG.num_layers, (1, 4), (16,)) == 0  # made already
    assert all(bool((pool == SENTINEL).all()) for pool in pools)
    torch.manual_seed(0)
    history = History(kv_heads, dtype)
    for s, n in {"a": 14, "b": 20, "c": 8}.items():
        history.prompt([core], s, n)
    seqs = [("a", 1), ("b", 1), ("c", 1)]  # a bucket of 4 over up to 21 keys: context 32
    for layer in range(CFG.num_layers):
        q, k, v = (t.to(device, dtype) for t in _step_inputs(seqs, CFG.num_heads, kv_heads))
        out, _ = core.attend(layer, seqs, q, k, v)
        history.append(layer, seqs, k.float().cpu(), v.float().cpu())
        torch.testing.assert_close(out.float().cpu(), history.attention(layer, seqs, q.float().cpu())[0],
                                   atol=2e-2, rtol=2e-2)
    assert (graphs.captures, graphs.replays, graphs.failures) == (made, CFG.num_layers, 0)
