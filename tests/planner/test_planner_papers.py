"""The seed papers' analyses as docs/planner.md reports them (on synthetic workloads with
the traces' mean lengths, so the test stays fast)."""

import pytest

from lamina.planner.papers import (
    break_even_flops_per_byte,
    cpu_attention_threads,
    lamina_comparison,
    lm_offload_quantization,
)
from lamina.planner.shapes import BUILTIN
from lamina.planner.workload import synthetic

SHAPE = BUILTIN["llama-3-70b"]


def test_lamina_decode_phase_pays_more_with_longer_contexts(catalogue):
    short = synthetic(1155, 211, 5.5, 100).stats()  # Azure-Conv means
    long = synthetic(12035, 343, 3.4, 100).stats()  # Kimi-Conv means
    short_c = lamina_comparison(SHAPE, short, "short", catalogue, decode_only=True)
    long_c = lamina_comparison(SHAPE, long, "long", catalogue, decode_only=True)
    assert 1.0 < short_c.ratio < long_c.ratio
    assert "H20" in long_c.disaggregated and long_c.homogeneous.startswith("colocated H100")


def test_lamina_with_prefill_on_the_model_workers_does_not_pay(catalogue):
    st = synthetic(12035, 343, 3.4, 100).stats()
    assert lamina_comparison(SHAPE, st, "kimi", catalogue, decode_only=False).ratio < 1.0


def test_lm_offload_quantization_verdicts(catalogue):
    rows = {r.case.split(",")[0]: r for r in lm_offload_quantization(catalogue)}
    assert rows["weights or KV over PCIe 4.0 x16"].worth_it
    verdicts = [r.worth_it for r in lm_offload_quantization(catalogue)]
    assert verdicts == [True, True, True, False]
    assert break_even_flops_per_byte() == pytest.approx(5 / 1.4375)


def test_cpu_attention_threads_are_bounded_by_bandwidth(catalogue):
    few = cpu_attention_threads(SHAPE, catalogue, 32, 4096, cores=2)
    many = cpu_attention_threads(SHAPE, catalogue, 32, 4096, cores=96)
    assert many.makespan_s <= few.makespan_s
    assert many.inter_op * many.intra_op <= 96
