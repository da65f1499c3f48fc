"""The estimate on hand-checked cases, and the ranking policy."""

import math
from dataclasses import replace

import pytest

from lamina.planner.estimate import TARGET_UTILIZATION, Targets, decode_step, estimate
from lamina.planner.hardware import parse_hardware
from lamina.planner.layouts import Layout, enumerate_layouts
from lamina.planner.plan import plan, unit_limit
from lamina.planner.rank import rank
from lamina.planner.shapes import BUILTIN
from lamina.planner.workload import synthetic

SMALL = BUILTIN["llama-2-7b"]


def stats(prompt=1000, output=100, rate=2.0):
    return synthetic(prompt, output, rate, requests=200).stats()


def test_colocated_estimate_by_hand(catalogue):
    st = stats()
    layout = Layout("H100", tp=1)
    e = estimate(SMALL, layout, catalogue, st)
    # KV capacity: 90% of 80 GB less 13.48 GB of weights, at 0.5 MiB per token; a request
    # holds on average its prompt and half its output, 1000 + 50 = 1050 tokens.
    capacity = int((0.9 * 80e9 - SMALL.num_params * 2) // (2 * 32 * 4096 * 2))
    expect_batch = capacity // int(st.mean_context)
    assert e.batch == expect_batch
    step = decode_step(SMALL, layout, catalogue, e.batch, st.mean_context).step_s
    assert e.tbt_s == pytest.approx(step)
    decode_tok_s = e.batch / step
    req_s = decode_tok_s / (st.mean_output + e.prefill_s * decode_tok_s)
    assert e.unit_tok_s == pytest.approx(req_s * st.mean_output)
    assert e.usd_per_mtok == pytest.approx(2.99 / (e.unit_tok_s * 3600) * 1e6)
    assert e.replicas == max(1, math.ceil(st.output_tok_s / (TARGET_UTILIZATION * e.unit_tok_s)))
    assert e.feasible and e.network_gbit_s == 0


def test_tbt_target_caps_the_batch(catalogue):
    st = stats()
    layout = Layout("H100", tp=1)
    free = estimate(SMALL, layout, catalogue, st)
    capped = estimate(SMALL, layout, catalogue, st, Targets(tbt_s=free.tbt_s / 2))
    assert capped.tbt_s <= free.tbt_s / 2 and capped.batch < free.batch
    assert decode_step(SMALL, layout, catalogue, capped.batch + 1, st.mean_context).step_s > free.tbt_s / 2
    impossible = estimate(SMALL, layout, catalogue, st, Targets(tbt_s=1e-6))
    assert "tbt" in impossible.shortfalls


def test_weights_that_do_not_fit_give_no_estimate(catalogue):
    assert estimate(BUILTIN["llama-3-70b"], Layout("H100", tp=1), catalogue, stats()) is None


def test_ranking_puts_feasible_then_cheapest_first(catalogue):
    base = estimate(SMALL, Layout("H100", tp=1), catalogue, stats())
    cheap_miss = replace(base, usd_per_mtok=0.01, shortfalls=("tbt",))
    cheap = replace(base, usd_per_mtok=0.5)
    dear = replace(base, usd_per_mtok=0.9)
    dear_fast = replace(base, usd_per_mtok=0.9, throughput_tok_s=base.throughput_tok_s * 2)
    two_misses = replace(base, usd_per_mtok=0.001, shortfalls=("tbt", "ttft"))
    assert rank([two_misses, dear, cheap_miss, dear_fast, cheap]) == [cheap, dear_fast, dear, cheap_miss, two_misses]


def test_counts_and_budget_are_respected(catalogue):
    st = stats(rate=50.0)
    offer = parse_hardware("H100:2,H20:4", catalogue)
    ranked = plan(SMALL, offer, catalogue, st, Targets(budget_usd_h=10.0))
    assert ranked
    for e in ranked:
        for kind, n in e.layout.device_counts().items():
            assert n * e.replicas <= offer.limits[kind]
        assert e.usd_per_hour <= 10.0 + 1e-9
    assert unit_limit(Layout("H100", 1, 1, "H20", 2, 2, "head"), offer) == 2


def test_enumeration_covers_both_kinds_and_quantization(catalogue):
    layouts = enumerate_layouts(SMALL, parse_hardware("H100,H20", catalogue), catalogue)
    assert any(not lay.is_disaggregated for lay in layouts)
    assert any(lay.is_disaggregated and lay.attention_device == "H20" and lay.model_device == "H100" for lay in layouts)
    assert {(lay.weights.name, lay.kv.name) for lay in layouts} == {
        ("fp16", "fp16"), ("int4", "fp16"), ("fp16", "int4"), ("int4", "int4")}
    only_fp16 = enumerate_layouts(SMALL, parse_hardware("H100", catalogue), catalogue, quantize="none",
                                  disaggregate=False)
    assert only_fp16 == [Layout("H100", 1), Layout("H100", 2)]
    # Head partitioning where the KV heads split evenly, request partitioning otherwise.
    smol = enumerate_layouts(BUILTIN["smollm2-135m"], parse_hardware("CPU", catalogue), catalogue, "none")
    small_pools = {(lay.attention_workers, lay.partition) for lay in smol
                   if lay.is_disaggregated and lay.attention_workers <= 4}
    assert small_pools == {(1, "head"), (2, "request"), (4, "request")}


def _best_per_dollar(ranked, disaggregated):
    return min(e.usd_per_mtok for e in ranked if e.layout.is_disaggregated == disaggregated
               and e.layout.model_device == "H100" and e.layout.attention_device in (None, "H20"))


def test_long_context_decode_favours_cheap_memory_for_attention(catalogue):
    """Lamina's premise, in its own terms (the decode phase, fp16 everywhere): with long
    contexts attention dominates, and moving it to H20s beats H100s alone per dollar."""
    st = stats(prompt=8000, output=400, rate=5.0)
    ranked = plan(BUILTIN["llama-3-70b"], parse_hardware("H100,H20", catalogue), catalogue, st,
                  quantize="none", decode_only=True)
    assert _best_per_dollar(ranked, True) < _best_per_dollar(ranked, False) / 1.5


def test_prefill_heavy_workloads_are_a_dead_zone_for_disaggregation(catalogue):
    """When the model workers also prefill 8k-token prompts, prefill compute dominates and
    the cheaper attention pool no longer pays."""
    st = stats(prompt=8000, output=400, rate=5.0)
    ranked = plan(BUILTIN["llama-3-70b"], parse_hardware("H100,H20", catalogue), catalogue, st, quantize="none")
    assert _best_per_dollar(ranked, True) > _best_per_dollar(ranked, False)


def test_disaggregated_step_never_slows_with_more_network_or_attention_workers(catalogue):
    big = BUILTIN["llama-3-70b"]
    fast_net = dict(catalogue)
    fast_net["H20"] = replace(catalogue["H20"], network_bw=catalogue["H20"].network_bw * 4)
    fast_net["H100"] = replace(catalogue["H100"], network_bw=catalogue["H100"].network_bw * 4)
    for n_micro in (1, 2, 3):
        base = Layout("H100", 2, 2, "H20", 4, n_micro, "head")
        for batch in (8, 64, 512):
            t = decode_step(big, base, catalogue, batch, 2000).step_s
            assert decode_step(big, base, fast_net, batch, 2000).step_s <= t
            more = replace(base, attention_workers=8)
            assert decode_step(big, more, catalogue, batch, 2000).step_s <= t * (1 + 1e-9)


def test_a_stack_on_one_gpu_reads_the_weights_once_per_micro_batch(catalogue):
    """Layout.shared_device (bench/gpu_decode.py's stack, model and attention workers on one
    GPU): the device runs each micro-batch's slice, which reads every weight, and the
    attention in turn, so two micro-batches add a weight read where devices of their own
    would overlap; the exchange's latency is hidden, the device's time is not."""
    def step(micro_batches: int, shared: bool = True, batch: int = 64) -> float:
        layout = Layout("H200", 1, 1, "H200", 1, micro_batches, "request", shared_device=shared)
        return decode_step(SMALL, layout, catalogue, batch, 2048).step_s

    engine = decode_step(SMALL, Layout("H200", 1), catalogue, 64, 2048).step_s
    assert step(1) > engine  # the exchange's latency on top of the engine's device time
    assert step(2) > engine * 1.1  # a second read of the weights: 13.5 GB on the engine's 82 (KV 68.7)
    assert step(2, shared=False) < step(2)  # devices of their own overlap the two sides
    shared = Layout("H200", 1, 1, "H200", 1, 2, "request", shared_device=True)
    assert decode_step(SMALL, shared, catalogue, 64, 2048).bottleneck == "shared device"
    with pytest.raises(ValueError, match="shared device"):
        Layout("H200", 1, 1, "H20", 1, 2, "request", shared_device=True)
