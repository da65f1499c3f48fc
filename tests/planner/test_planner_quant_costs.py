"""On a profiled machine the quantized choices take their costs from the measured kernels
(packed-weight matmuls, attention over q4 KV, quantizing new KV rows) where the profile
has them, and from the generic dequantization model where it does not."""

from __future__ import annotations

import json

import pytest
from planner_helpers import synthetic_entry

from lamina.planner.estimate import decode_step, quant_sources
from lamina.planner.hardware import THIS_MACHINE, device_from_entry
from lamina.planner.layouts import Layout
from lamina.planner.perf.attention import attention_layer_time
from lamina.planner.perf.quantization import FP32, INT4, device_verdicts
from lamina.planner.perf.slices import slice_time
from lamina.planner.shapes import BUILTIN

SHAPE = BUILTIN["smollm2-135m"]


def _device(measured_quant: bool, **kw):
    return device_from_entry(THIS_MACHINE, json.loads(json.dumps(synthetic_entry(measured_quant, **kw))))


def test_measured_packed_kernel_replaces_the_dequantization_model():
    measured, generic = _device(True), _device(False)
    t = slice_time(SHAPE, measured, 1, weights=INT4).layer
    assert t.seconds == pytest.approx(SHAPE.layer_matmul_params * 2e-10)
    # Without the packed table: the roofline with 4-bit bytes and dequantization FLOPs.
    g = slice_time(SHAPE, generic, 1, weights=INT4).layer
    p = SHAPE.layer_matmul_params
    assert g.compute_s == pytest.approx(2 * p / 0.05e12 + p * INT4.dequant_ops_per_element / 0.05e12)
    assert g.seconds != pytest.approx(t.seconds)
    # Float32 weights use the float32 table either way.
    assert slice_time(SHAPE, generic, 1, weights=FP32).layer.seconds == pytest.approx(p * 4e-10)


def test_measured_q4_attention_replaces_the_dequantization_model():
    batch, context = 8, 512
    elements = batch * context * 2 * SHAPE.kv_size
    t = attention_layer_time(SHAPE, _device(True), batch, context, kv=INT4)
    assert t.memory_s == pytest.approx(elements * 0.2e-9 + batch * 2 * SHAPE.kv_size * 1e-9)
    g = attention_layer_time(SHAPE, _device(False), batch, context, kv=INT4)
    assert g.memory_s == pytest.approx(elements * INT4.bytes_per_element / 0.01e12)
    assert g.compute_s > t.compute_s  # the model's dequantization FLOPs; the measured time includes them


def test_sources_are_reported_and_follow_the_profile():
    layout = Layout(THIS_MACHINE, 1, weights=INT4, kv=INT4)
    assert quant_sources(layout, {THIS_MACHINE: _device(True)}) == {"weights": "measured", "kv": "measured"}
    assert quant_sources(layout, {THIS_MACHINE: _device(False)}) == {"weights": "dequant model",
                                                                      "kv": "dequant model"}
    assert quant_sources(Layout(THIS_MACHINE, 1, weights=FP32, kv=FP32), {THIS_MACHINE: _device(True)}) == {}


def test_a_slower_measured_kernel_slows_the_step_and_flips_the_verdict():
    fast, slow = _device(True, q4_linear=2e-10), _device(True, q4_linear=8e-10)
    layout = Layout(THIS_MACHINE, 1, weights=INT4, kv=FP32)
    assert decode_step(SHAPE, layout, {THIS_MACHINE: slow}, 4, 256).step_s > \
        decode_step(SHAPE, layout, {THIS_MACHINE: fast}, 4, 256).step_s
    assert device_verdicts(fast)["weights"] == (pytest.approx(device_verdicts(fast)["weights"][0]), "measured")
    assert device_verdicts(fast)["weights"][0].worth_it  # 2e-10 < 4e-10 s per weight
    assert not device_verdicts(slow)["weights"][0].worth_it  # 8e-10 > 4e-10
    # q4 KV: 0.2 ns per element against float32's 4 bytes at 5 GB/s (0.8 ns): pays.
    assert device_verdicts(fast)["kv"][0].worth_it and device_verdicts(fast)["kv"][1] == "measured"
    assert not device_verdicts(_device(True, q4_attention_ns=1.0))["kv"][0].worth_it


def test_without_measured_quant_costs_the_verdict_is_the_model():
    verdicts = device_verdicts(_device(False))
    assert {source for _, source in verdicts.values()} == {"dequant model"}
    # 5 vector FLOP per element at 50 GFLOP/s against 3.4375 bytes saved at 10 GB/s: pays.
    assert verdicts["weights"][0].cost_s == pytest.approx(1e9 * 5 / 0.05e12)
