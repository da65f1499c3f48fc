"""Limits and monotonicity every performance model must keep."""

from dataclasses import replace

import pytest

from lamina.planner.perf.attention import attention_layer_time
from lamina.planner.perf.memory import kv_bytes_per_token, kv_token_capacity, min_tensor_parallel, weight_bytes
from lamina.planner.perf.pipeline import StageTimes, colocated_step, pipeline_step
from lamina.planner.perf.prefill import prefill_time
from lamina.planner.perf.quantization import FP16, INT4, quantization_verdict
from lamina.planner.perf.slices import slice_time
from lamina.planner.perf.threads import CpuOp, choose_threads, makespan
from lamina.planner.perf.transfer import allreduce_time, layer_traffic, layer_transfer_s, link_time
from lamina.planner.shapes import BUILTIN

SHAPE = BUILTIN["llama-3-8b"]
BATCHES = (1, 2, 8, 32, 128, 512, 2048)


def faster_memory(device, factor=2.0):
    return replace(device, memory_bw=device.memory_bw * factor)


def test_slice_step_is_at_least_both_rooflines(catalogue):
    h100 = catalogue["H100"]
    for b in BATCHES:
        step = slice_time(SHAPE, h100, b).step_s(SHAPE.num_layers)
        compute_bound = 2 * SHAPE.matmul_params_per_token * b / h100.matmul_flops
        memory_bound = SHAPE.matmul_params_per_token * 2 / h100.achieved_bw
        assert step >= compute_bound * (1 - 1e-9) and step >= memory_bound * (1 - 1e-9)


def test_bigger_batch_never_lowers_per_token_time_below_the_compute_bound(catalogue):
    h100 = catalogue["H100"]
    per_token_floor = 2 * SHAPE.matmul_params_per_token / h100.matmul_flops
    prev_step, prev_per_token = 0.0, float("inf")
    for b in BATCHES:
        step = slice_time(SHAPE, h100, b).step_s(SHAPE.num_layers)
        assert step >= prev_step  # a bigger batch never takes less time
        assert step / b <= prev_per_token * (1 + 1e-9)  # nor more time per token
        assert step / b >= per_token_floor * (1 - 1e-9)
        prev_step, prev_per_token = step, step / b


def test_small_batch_slices_are_memory_bound_large_ones_compute_bound(catalogue):
    h100 = catalogue["H100"]
    assert slice_time(SHAPE, h100, 1).layer.is_memory_bound
    assert not slice_time(SHAPE, h100, 4096).layer.is_memory_bound


@pytest.mark.parametrize("kind", ["H100", "H20", "L40S", "CPU"])
def test_more_bandwidth_never_slows_any_model(catalogue, kind):
    dev, fast = catalogue[kind], faster_memory(catalogue[kind])
    for b in BATCHES:
        assert slice_time(SHAPE, fast, b).step_s(32) <= slice_time(SHAPE, dev, b).step_s(32)
        assert attention_layer_time(SHAPE, fast, b, 2000).seconds <= attention_layer_time(SHAPE, dev, b, 2000).seconds
    assert prefill_time(SHAPE, fast, 500) <= prefill_time(SHAPE, dev, 500)
    assert link_time(1e6, 2e9, 1e-5) <= link_time(1e6, 1e9, 1e-5)


def test_attention_is_kv_bytes_over_bandwidth_and_linear_in_context(catalogue):
    h20 = catalogue["H20"]
    t = attention_layer_time(SHAPE, h20, 64, 4096)
    kv_bytes = 64 * 4096 * 2 * SHAPE.kv_size * 2
    assert t.is_memory_bound
    assert t.seconds == pytest.approx(kv_bytes / h20.achieved_bw)
    assert attention_layer_time(SHAPE, h20, 64, 8192).seconds == pytest.approx(2 * t.seconds)
    assert attention_layer_time(SHAPE, h20, 64, 4096, workers=4).seconds == pytest.approx(t.seconds / 4)
    assert attention_layer_time(SHAPE, h20, 0, 4096).seconds == 0


def test_kv_quantization_reads_fewer_bytes_but_adds_vector_work(catalogue):
    h20 = catalogue["H20"]
    fp, q = attention_layer_time(SHAPE, h20, 64, 4096), attention_layer_time(SHAPE, h20, 64, 4096, kv=INT4)
    assert q.memory_s == pytest.approx(fp.memory_s * INT4.bytes_per_element / 2)
    assert q.compute_s > fp.compute_s


def test_transfer_latency_bandwidth_and_allreduce():
    assert link_time(0, 1e9, 1e-5) == 0
    assert link_time(1e9, 1e9, 1e-5) == pytest.approx(1 + 1e-5)
    assert link_time(1e6, 1e9, 2e-5) > link_time(1e6, 1e9, 1e-5)
    assert allreduce_time(1e6, 1, 1e9, 1e-5) == 0
    assert allreduce_time(1e6, 2, 1e9, 0) == pytest.approx(1e6 / 1e9)  # 2 (d-1)/d = 1
    traffic = layer_traffic(SHAPE, 10)
    assert traffic.to_attention == 10 * (4096 + 2 * 1024) * 2 and traffic.to_model == 10 * 4096 * 2
    assert layer_transfer_s(traffic, 1e9, 1e-5) == pytest.approx(2e-5 + traffic.total / 1e9)


def test_prefill_is_compute_bound_and_superlinear_in_the_prompt(catalogue):
    h100 = catalogue["H100"]
    short, long = prefill_time(SHAPE, h100, 1000), prefill_time(SHAPE, h100, 8000)
    assert short >= 2 * 1000 * SHAPE.num_layers * SHAPE.layer_matmul_params / h100.matmul_flops
    assert long > 8 * short
    assert prefill_time(SHAPE, h100, 1000, tp=2) < short
    assert prefill_time(SHAPE, h100, 0) == 0


STAGES = StageTimes(model_s=1.0, attention_s=0.5, transfer_s=0.2, transfer_bytes_s=0.1, head_s=0.0)


def test_one_micro_batch_overlaps_nothing():
    p = pipeline_step(STAGES, num_layers=10, micro_batches=1, model_workers=1)
    assert p.step_s == pytest.approx(10 * 1.7) and p.bottleneck == "chain"


def test_two_micro_batches_keep_the_slower_side_busy():
    p = pipeline_step(STAGES, num_layers=10, micro_batches=2, model_workers=1)
    assert p.period_s == pytest.approx(2.0) and p.bottleneck == "model"  # two slices per layer
    # Two micro-batches finish in 2.0 per layer instead of 2 x 1.7 one after the other.
    assert p.step_s < 2 * pipeline_step(STAGES, 10, 1, 1).step_s


def test_rotational_pipeline_hides_a_slow_model_slice():
    rot = pipeline_step(STAGES, num_layers=10, micro_batches=3, model_workers=2)
    assert rot.period_s == pytest.approx(max(1.7, 1.5, 1.5, 0.3))
    for n in (1, 2, 3, 4):  # more model workers never slow a step
        assert pipeline_step(STAGES, 10, n, 2).step_s <= pipeline_step(STAGES, 10, n, 1).step_s
    faster = replace(STAGES, attention_s=0.25, transfer_bytes_s=0.05, transfer_s=0.1)
    assert pipeline_step(faster, 10, 3, 2).step_s <= rot.step_s


def test_services_sharing_a_host_are_bound_by_its_cores():
    shared = replace(STAGES, host_cpu_s=2.2, host_cores=2)  # all processes' work per micro-batch and layer
    assert pipeline_step(shared, 10, 1, 1).bottleneck == "chain"  # 1.1 of 1.7 on 2 cores: the chain waits
    p = pipeline_step(shared, 10, 2, 1)
    assert p.period_s == pytest.approx(2.2) and p.bottleneck == "host cpu"
    one_core = pipeline_step(replace(shared, host_cores=1), 10, 2, 1)
    assert one_core.period_s == pytest.approx(4.4)  # no better than one micro-batch after the other
    assert pipeline_step(STAGES, 10, 2, 1).step_s <= p.step_s  # separate devices: no such term


def test_workers_sharing_an_accelerator_take_turns_on_it():
    shared = replace(STAGES, device_s=1.5)  # the slice and the attention of one micro-batch, on the one device
    assert pipeline_step(shared, 10, 1, 1).bottleneck == "chain"  # the exchange's latency adds to 1.5
    p = pipeline_step(shared, 10, 2, 1)
    assert p.period_s == pytest.approx(3.0) and p.bottleneck == "device"  # overlapping hides the exchange only
    assert pipeline_step(STAGES, 10, 2, 1).period_s == pytest.approx(2.0)  # devices of their own: no such term


def test_colocated_adds_model_and_attention():
    assert colocated_step(1.0, 0.5, 0.3, 10) == pytest.approx(15.3)


def test_memory_capacity(catalogue):
    s = BUILTIN["llama-2-7b"]
    assert weight_bytes(s) == pytest.approx(s.num_params * 2)
    assert kv_bytes_per_token(s) == 2 * 32 * 4096 * 2  # 0.5 MiB per token
    assert (kv_token_capacity(80e9, 1, weight_bytes(s), kv_bytes_per_token(s))
            == int((72e9 - s.num_params * 2) // 524288))
    assert kv_token_capacity(80e9, 1, 100e9, 1.0) == 0
    assert kv_token_capacity(80e9, 2, 0, 1.0) > kv_token_capacity(80e9, 1, 0, 1.0)
    big = BUILTIN["llama-3-70b"]
    assert min_tensor_parallel(big, 80e9, FP16) == 2  # 141 GB over 2 x 72 GB
    assert min_tensor_parallel(big, 80e9, INT4) == 1
    assert min_tensor_parallel(big, 24e9, FP16) == 8
    assert min_tensor_parallel(big, 10e9, FP16) is None


def test_group_wise_int4_bytes():
    assert INT4.bytes_per_element == pytest.approx(0.5 + 4 / 64)
    assert FP16.bytes_per_element == 2 and FP16.dequant_ops_per_element == 0


def test_quantization_pays_over_slow_links_not_beside_slow_vector_units(catalogue):
    n = 1e9
    pcie = quantization_verdict(n, bandwidth=32e9, vector_flops=catalogue["H100"].vector_flops)
    assert pcie.worth_it  # KV or weights crossing PCIe to a GPU
    cpu = catalogue["CPU"]
    slow_cores = quantization_verdict(n, bandwidth=cpu.achieved_bw, vector_flops=cpu.vector_flops / 96 * 4)
    assert not slow_cores.worth_it  # a CPU attention with 4 cores to dequantize
    assert slow_cores.saved_s == pytest.approx(n * (2 - INT4.bytes_per_element) / cpu.achieved_bw)


def test_threads_memory_bound_ops_gain_nothing_from_more_threads():
    ops = [CpuOp(compute_s=0.001, memory_s=0.01)] * 8
    choice = choose_threads(ops, cores=8)
    assert choice.makespan_s == pytest.approx(0.08)  # bandwidth is the limit however split
    assert choice.efficiency == pytest.approx(1.0)


def test_threads_compute_bound_ops_spread_over_cores():
    ops = [CpuOp(compute_s=1.0, memory_s=0.0, serial_fraction=0.2)] * 4
    choice = choose_threads(ops, cores=4)
    # Inter-op wins: 4 ops on 4 lanes take 1.0; one op at a time on 4 threads takes 4 x 0.4.
    assert (choice.inter_op, choice.intra_op) == (4, 1)
    assert choice.makespan_s == pytest.approx(1.0)
    assert makespan(ops, 1, 4) == pytest.approx(4 * (0.2 + 0.8 / 4))
    single = choose_threads([CpuOp(1.0, 0.0, 0.0)], cores=4)
    assert (single.inter_op, single.intra_op) == (1, 4) and single.makespan_s == pytest.approx(0.25)


def test_a_profiled_machine_uses_its_measured_kernels(catalogue):
    cpu = catalogue["CPU"]
    table = {1: 1e-9, 8: 2e-9, 64: 10e-9}
    profiled = replace(cpu, linear_s_per_param=table, attention_bw=1e9)
    sl = slice_time(SHAPE, profiled, 8)
    assert sl.layer.seconds == pytest.approx(SHAPE.layer_matmul_params * 2e-9)
    att = attention_layer_time(SHAPE, profiled, 4, 1000)
    assert att.memory_s == pytest.approx(4 * 1000 * 2 * SHAPE.kv_size * 2 / 1e9)
    prev = 0.0
    for b in BATCHES:  # the measured model keeps the monotonicity too
        t = slice_time(SHAPE, profiled, b).step_s(SHAPE.num_layers)
        assert t >= prev
        prev = t
