"""Packed weights: formats, the native kernel against dequantize-then-matmul, GGUF blocks
kept as they are, and greedy decoding with the file's own quantized weights."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (torch's conventional name)
from gguf import GGMLQuantizationType as QT  # noqa: N814 (gguf's enum, named on every row of the tables)
from reference_helpers import MAX_NEW, hf_greedy, reference_prompts
from test_loader import (
    TENSOR_TYPES,
    VOCAB,
    _our_logits,
    write_tiny_gguf,
)

from lamina.engine import Engine, SamplingParams
from lamina.model import gguf_file, quant
from lamina.model.loader import load_model
from lamina.model.quant import PackedWeight, QuantLinear, dequantize, pack_float, pack_gguf, packed_matmul, quantize

native = pytest.mark.skipif(quant.NATIVE is None, reason="model._qmatmul was not built (no C compiler at install)")
FORMATS = ["f32", "q8_0", "q4_0", "q4_1"]
_GGUF_TYPE = {"q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q4_1": QT.Q4_1}


def _weight(fmt: str, n: int, k: int, seed: int = 0) -> PackedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if fmt == "f32":
        return pack_float(w)
    raw = gguf.quants.quantize(w.numpy(), _GGUF_TYPE[fmt])  # gguf's own quantizer, all three formats
    return pack_gguf(fmt, raw, n, k)


def _run(x: torch.Tensor, pw: PackedWeight, bias=None, scalar: bool = False, threads: int = 1) -> torch.Tensor:
    y = torch.empty(x.shape[0], pw.n)
    args = (quant._FORMAT_CODE[pw.fmt], pw.k, pw.n, pw.values.data_ptr(),
            0 if pw.scale is None else pw.scale.data_ptr(), 0 if pw.minimum is None else pw.minimum.data_ptr(),
            0 if bias is None else bias.data_ptr())
    quant.NATIVE.matmul(x.data_ptr(), y.data_ptr(), x.shape[0], *args, scalar, threads)
    return y


# -- formats ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_gguf_blocks_decode_like_gguf(fmt):
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(1)) * 0.1
    raw = gguf.quants.quantize(w.numpy(), _GGUF_TYPE[fmt])
    pw = pack_gguf(fmt, raw, 48, 96)
    expected = gguf.quants.dequantize(raw, _GGUF_TYPE[fmt]).reshape(48, 96)
    np.testing.assert_array_equal(dequantize(pw).numpy(), expected)
    # Unpacking gives the file's bits back: quantized values, scales and mins.
    q, d, m = quant.unpack_quantized(pw)
    again = quant.pack_quantized(fmt, q, d, m)
    for name, t in pw.tensors().items():
        assert torch.equal(t, again.tensors()[name]), name
    rows = torch.tensor([0, 17, 47, 3])
    assert torch.equal(quant.dequantize_rows(pw, rows), dequantize(pw)[rows])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_quantize_equals_gguf_quantizer(fmt):
    """q8_0 and q4 (stored as q4_1: group-wise min-max 4-bit) quantize float weights bit for bit
    as gguf's quantizer does."""
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(2)) * 0.1
    w[3, :32] = 0.0  # a constant group: scale 0
    ours = quantize(w, fmt)
    theirs = pack_gguf(fmt, gguf.quants.quantize(w.numpy(), _GGUF_TYPE[fmt]), 40, 128)
    for name, t in ours.tensors().items():
        assert torch.equal(t, theirs.tensors()[name]), name


def test_stacked_rows_keep_every_format():
    for fmt in FORMATS:
        parts = [_weight(fmt, n, 64, seed=i) for i, n in enumerate((24, 16, 8))]
        both = quant.concat_rows(parts)
        assert both.fmt == fmt and both.n == 48
        assert torch.equal(dequantize(both), torch.cat([dequantize(p) for p in parts]))
    with pytest.raises(ValueError, match="one format"):
        quant.concat_rows([_weight("q8_0", 16, 64), _weight("q4_1", 16, 64)])


def test_packed_weight_is_checked():
    pw = _weight("q4_1", 32, 64)
    with pytest.raises(ValueError, match="minimum"):
        PackedWeight("q4_1", 32, 64, pw.values, pw.scale, None)
    with pytest.raises(ValueError, match="unknown packed format"):
        PackedWeight("q5_0", 32, 64, pw.values)
    with pytest.raises(ValueError, match="divide by 32"):
        quantize(torch.randn(4, 40), "q8_0")


# -- the kernel --------------------------------------------------------------------------------


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scalar", [False, True], ids=["avx2", "portable"])
def test_kernel_decodes_the_reference_values_exactly(fmt, scalar):
    """x = the identity: every output is a single weight times one, so any difference from
    dequantize() would be a decoding difference (Q4_1's d * q + m rounded twice included)."""
    if not scalar and not quant.NATIVE.has_avx2():
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    pw = _weight(fmt, 40, 64)  # 40 outputs: the last panel is padded
    expected = dequantize(pw).t()  # [K, N]
    for rows in (slice(0, 64), slice(5, 6), slice(0, 3)):  # many rows (panel decoded once), one, a few
        eye = torch.eye(64)[rows].contiguous()
        assert torch.equal(_run(eye, pw, scalar=scalar), expected[rows])


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 6, 7, 10, 64, 200])
def test_kernel_matches_dequantize_then_matmul(fmt, m):
    """The product differs from dequantize-then-matmul only by the order of accumulation:
    each output within 2^-20 of sum_k |x_k w_k| (the kernel's float32 sums of 1536 terms
    reach about 2^-22 of it here, torch's blocked ones 2^-24; any order is within K * 2^-24)."""
    n, k = 200, 1536
    pw = _weight(fmt, n, k)
    w = dequantize(pw)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n)
    exact = F.linear(x.double(), w.double(), bias.double())
    scale = x.abs().double() @ w.abs().double().t() + bias.abs().double()
    for y in (packed_matmul(x, pw, bias), _run(x, pw, bias, scalar=True)):
        assert ((y.double() - exact).abs() <= scale * 2**-20).all()


@native
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_one_row_products_equal_the_register_blocks_bit_for_bit(fmt):
    """A single row (a decode step at batch 1) decodes each group in registers instead of
    through a tile; its sums are the blocked path's, in the same order: the row alone
    equals the same row computed with others, and with the bias and a padded panel."""
    if not quant.NATIVE.has_avx2():
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    pw = _weight(fmt, 200, 1536)  # 13 panels, the last one padded
    bias = torch.randn(200)
    x = torch.randn(3, 1536)
    together = _run(x, pw, bias)  # three rows: the register-block path
    for r in range(3):
        assert torch.equal(_run(x[r : r + 1].contiguous(), pw, bias), together[r : r + 1])
        assert torch.equal(_run(x[r : r + 1].contiguous(), pw, bias, threads=2), together[r : r + 1])


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scalar", [False, True], ids=["avx2", "portable"])
def test_threads_split_the_outputs_without_changing_a_bit(fmt, scalar):
    """Each output is computed by one thread in the one-thread order, so any thread count
    gives the same bits: uneven splits (33 panels over 2, 3 and 7 threads), more threads
    than panels, calls too small to split, and the pool reused call after call."""
    if not scalar and not quant.NATIVE.has_avx2():
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    pw = _weight(fmt, 520, 256)  # 33 panels, the last one padded
    bias = torch.randn(520)
    for m in (1, 7, 40):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
        one = _run(x, pw, bias, scalar=scalar)
        for threads in (2, 3, 7, 64):
            assert torch.equal(_run(x, pw, bias, scalar=scalar, threads=threads), one), (m, threads)
    small = _weight(fmt, 16, 32)  # one panel: nothing to split
    x = torch.randn(2, 32)
    assert torch.equal(_run(x, small, threads=4), _run(x, small))
    with pytest.raises(ValueError):
        _run(x, small, threads=0)
    # Jobs of other shapes back to back, as a decode step makes them: a worker late for one
    # job must find no range of it left, or take the next job's ranges, never mix the two.
    other = _weight(fmt, 264, 256)
    x7 = torch.randn(7, 256)
    want = (_run(x7, pw, bias, scalar=scalar), _run(x7, other, scalar=scalar))
    for _ in range(100):
        assert torch.equal(_run(x7, pw, bias, scalar=scalar, threads=3), want[0])
        assert torch.equal(_run(x7, other, scalar=scalar, threads=2), want[1])


@native
def test_compute_threads_reach_the_kernel_and_survive_a_fork():
    """set_compute_threads gives the products their threads and torch one; a forked child
    has none of the parent's workers and starts its own."""
    import multiprocessing as mp

    from lamina.model.threads import compute_threads, set_compute_threads

    pw = _weight("q4_1", 1024, 512)
    x = torch.randn(24, 512)
    before = torch.get_num_threads()
    try:
        one = packed_matmul(x, pw)
        set_compute_threads(2)
        assert (compute_threads(), torch.get_num_threads()) == (2, 1)
        assert torch.equal(packed_matmul(x, pw), one)  # starts the parent's workers
        ctx = mp.get_context("fork")
        with ctx.Pool(1) as child:
            got = child.apply_async(_fork_product, (x, pw)).get(timeout=60)
        assert torch.equal(got, one)
        with pytest.raises(ValueError, match="at least 1"):
            set_compute_threads(0)
    finally:
        set_compute_threads(1)
        torch.set_num_threads(before)


def _fork_product(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    from lamina.model.threads import compute_threads

    assert compute_threads() == 2  # inherited: the setting, not the workers
    return packed_matmul(x, pw)


@native
def test_kernel_takes_any_input_size_for_float_panels():
    pw = _weight("f32", 19, 37)
    x = torch.randn(5, 37)
    torch.testing.assert_close(packed_matmul(x, pw), F.linear(x, dequantize(pw)), rtol=0, atol=1e-5)


def test_torch_path_computes_the_same_product():
    for fmt in FORMATS:
        pw = _weight(fmt, 24, 64)
        x = torch.randn(4, 64)
        torch.testing.assert_close(packed_matmul(x, pw, native=False), F.linear(x, dequantize(pw)),
                                   rtol=0, atol=0)


def test_quant_linear_replaces_a_linear():
    lin = torch.nn.Linear(64, 24)
    x = torch.randn(3, 5, 64)  # any leading dimensions
    for fmt in ("f32", "q8_0", "q4_1"):
        q = QuantLinear.from_linear(lin, fmt)
        with torch.no_grad():
            expected = F.linear(x, quant.float_weight(q), lin.bias)
        torch.testing.assert_close(q(x), expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        q(torch.randn(3, 32))


# -- loading -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """The tiny LLaMA of test_loader with layer 0's Q, K, V all Q4_1 (one fused packed matrix)
    and its other matrices in mixed formats."""
    path = tmp_path_factory.mktemp("gguf-quant") / "tiny.gguf"
    write_tiny_gguf(path, types=dict(TENSOR_TYPES, **{"blk.0.attn_q.weight": QT.Q4_1,
                                                       "blk.0.attn_v.weight": QT.Q4_1}))
    return path


def test_read_packed_keeps_the_files_blocks(tiny_path):
    reader = gguf.GGUFReader(str(tiny_path))
    cfg = gguf_file.read_config(tiny_path, reader)
    floats = gguf_file.read_state_dict(tiny_path, cfg, reader)
    packed = gguf_file.read_packed(tiny_path, cfg, reader)
    stored = {gguf_file._hf_name(t.name): t.tensor_type.name for t in reader.tensors}
    assert {n for n, t in stored.items() if t in gguf_file.PACKED_TYPES} == set(packed)
    for name, pw in packed.items():
        assert pw.fmt == gguf_file.PACKED_TYPES[stored[name]]
        # The same values the float32 conversion holds (Q and K rows un-permuted alike).
        assert torch.equal(dequantize(pw), floats[name]), name


def test_as_file_loads_the_files_formats(tiny_path, cache_dir):
    ref = load_model(tiny_path)
    ours = load_model(tiny_path, weights="as_file")
    assert ours.weights == "as_file"
    layers = ours.model.model.layers
    assert layers[0].self_attn.qkv_proj.fmt == "q4_1"  # Q, K, V all Q4_1: stacked, still packed
    assert layers[1].self_attn.qkv_proj.fmt == "f32"  # F32, F16, Q4_1 mixed: float panels
    assert layers[1].self_attn.o_proj.fmt == "q8_0" and layers[1].mlp.down_proj.fmt == "q4_0"
    assert ours.model.lm_head.fmt == "f32"  # the file's F16 output matrix
    assert ours.model.model.embed_tokens.table.fmt == "q8_0"  # untied: the file's Q8_0 embedding
    ids = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_our_logits(ours, ids), _our_logits(ref, ids), rtol=0, atol=1e-5)


def test_file_blocks_are_repacked_once_into_the_cache(tiny_path, cache_dir):
    first = load_model(tiny_path, weights="as_file")
    cached = first.weights_dir / "packed" / "as_file.safetensors"
    assert cached.is_file()
    again = load_model(tiny_path, weights="as_file")  # read from the cache, not the GGUF
    for (name, a), (_, b) in zip(first.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(a, b), name
    cached.write_bytes(cached.read_bytes()[:200])  # damaged: repacked from the file again
    third = load_model(tiny_path, weights="as_file")
    assert torch.equal(third.model.lm_head.values, first.model.lm_head.values)
    assert cached.stat().st_size > 200


def test_the_files_weight_formats_come_from_a_cache_of_this_version(tiny_path, cache_dir):
    """file_weight_formats reads the repacked cache's header; a cache of another packed
    layout (an older version's) or a damaged one is repacked, not believed."""
    from safetensors.torch import save_file

    from lamina.model.checkpoints import file_weight_formats

    formats = file_weight_formats(tiny_path)  # repacks: no cache yet
    assert {"q4_1", "q8_0", "q4_0"} <= formats.keys(), formats  # the tiny file's blocks (tiny_path)
    cached = load_model(tiny_path, weights="as_file").weights_dir / "packed" / "as_file.safetensors"
    stale = {"layout": str(quant.PACKED_LAYOUT_VERSION + 1), "weights": '{"w": ["q8_0", 32, 32]}'}
    save_file({"w:values": torch.zeros(1)}, str(cached), metadata=stale)
    assert file_weight_formats(tiny_path) == formats  # repacked from the file
    assert '"q8_0", 32, 32' not in cached.read_bytes()[:4096].decode("latin-1")
    cached.write_bytes(cached.read_bytes()[:100])  # damaged
    assert file_weight_formats(tiny_path) == formats


def test_weights_choices_are_checked(tiny_path, cache_dir):
    with pytest.raises(ValueError, match="unknown weights"):
        load_model(tiny_path, weights="q3")
    with pytest.raises(ValueError, match="float32"):
        load_model(tiny_path, dtype=torch.bfloat16, weights="q4")
    q4 = load_model(tiny_path, weights="q4")
    assert q4.weight_formats == {"q4_1": 2 * 4, "q8_0": 2}  # decoder linears; head and untied embedding


# -- the default model with the file's own quantized weights ----------------------------------


@pytest.fixture(scope="module")
def as_file_model():
    return load_model(weights="as_file")


def test_default_model_keeps_its_quantized_blocks(as_file_model, loaded_model):
    # SmolLM2-135M-Instruct.Q4_1.gguf: every decoder matrix Q4_1, the tied embedding Q8_0.
    assert as_file_model.weight_formats == {"q4_1": 4 * loaded_model.config.num_layers, "q8_0": 1}
    head = as_file_model.model.lm_head
    assert as_file_model.model.model.embed_tokens.table is head and head.fmt == "q8_0"


def test_greedy_tokens_with_file_weights_equal_transformers(as_file_model, hf_reference):
    """transformers dequantizes the same blocks to float32; computing on the blocks gives
    the same greedy tokens on the held-out prompts of test_reference.py."""
    engine = Engine(as_file_model)
    prompts = reference_prompts(as_file_model.tokenizer)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    for ids, out in zip(prompts, outs):
        assert out.output_token_ids == hf_greedy(hf_reference, ids)


def test_logits_with_file_weights_match_transformers(as_file_model, hf_reference):
    ids = torch.tensor(reference_prompts(as_file_model.tokenizer)[5])
    with torch.no_grad():
        ref = hf_reference(ids[None]).logits[0]
    torch.testing.assert_close(_our_logits(as_file_model, ids), ref, rtol=0, atol=2e-4)


def test_lamina_generate_threads_give_the_same_tokens(loaded_model, capsys):
    """`lamina generate --threads N` runs the products on N threads and prints the same
    greedy tokens whatever N; a count below one is refused."""
    import json

    from lamina.cli import main
    from lamina.model.threads import set_compute_threads

    argv = ["generate", "--prompt", "The capital of France is", "--max-tokens", "6", "--json"]
    try:
        outs = []
        for threads in ("1", "2"):
            assert main([*argv, "--threads", threads]) == 0
            outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"])
        assert outs[0] == outs[1] and len(outs[0]) == 6
        assert main([*argv, "--threads", "0"]) == 2
        assert "--threads must be at least 1" in capsys.readouterr().err
    finally:
        set_compute_threads(1)
