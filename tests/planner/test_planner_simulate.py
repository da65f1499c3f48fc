"""The discrete-event simulator: conservation, light-load latencies, KV capacity, scale."""

import time

import pytest

from lamina.planner.estimate import decode_step
from lamina.planner.layouts import Layout
from lamina.planner.perf.prefill import prefill_time
from lamina.planner.shapes import BUILTIN
from lamina.planner.simulate import Simulator, simulate, simulated_shortfalls, weighted_percentiles
from lamina.planner.workload import Request, Workload, synthetic

SHAPE = BUILTIN["llama-2-7b"]


def test_every_request_completes_with_its_tokens(catalogue):
    w = synthetic(500, 50, rate=20.0, requests=300)
    r = simulate(SHAPE, Layout("H100", 1), catalogue, w, replicas=2, max_batch=64)
    assert r.completed == 300 and r.output_tokens == 300 * 50
    assert r.preemptions == 0 and r.decode_tokens + r.admissions == r.output_tokens
    assert r.duration_s >= w.requests[-1].arrival_s


def test_one_request_alone_takes_prefill_then_its_steps(catalogue):
    layout = Layout("H100", 1)
    w = Workload("one", (Request(0.0, 1000, 11),))
    r = simulate(SHAPE, layout, catalogue, w, replicas=1, max_batch=8)
    prefill = prefill_time(SHAPE, catalogue["H100"], 1000)
    assert r.ttft.p50 == pytest.approx(prefill)
    # 10 decode steps after the first token, the first one behind the prefill.
    steps = sum(decode_step(SHAPE, layout, catalogue, 1, 1001 + i).step_s for i in range(10))
    assert r.duration_s == pytest.approx(prefill + steps, rel=0.02)


def test_kv_capacity_bounds_the_batch_and_overflow_preempts(catalogue):
    sim = Simulator(SHAPE, Layout("H100", 1), catalogue, replicas=1, max_batch=1000)
    sim.units[0].capacity = 5000  # tokens: room for four 1000-token prompts, not their growth
    w = Workload("burst", tuple(Request(0.0, 1000, 400) for _ in range(6)))
    r = sim.run(w)
    assert r.completed == 6 and r.output_tokens == 6 * 400
    assert r.preemptions > 0 and r.admissions == 6 + r.preemptions
    assert r.mean_batch <= 4
    # Every token is made once: by a prefill (one per admission) or by a decode step.
    assert r.decode_tokens + r.admissions == r.output_tokens


def test_disaggregated_units_with_hundreds_of_workers_simulate_quickly(catalogue):
    big = BUILTIN["llama-3-70b"]
    layout = Layout("H100", 2, 4, "H20", 32, 5, "request")  # 8 H100 + 32 H20 per unit
    w = synthetic(1155, 211, rate=60.0, requests=1500)
    start = time.perf_counter()
    r = simulate(big, layout, catalogue, w, replicas=8, max_batch=2000)  # 320 workers
    assert time.perf_counter() - start < 5.0
    assert r.completed == 1500
    assert r.tbt.p50 <= r.tbt.p99


def test_one_token_requests_need_no_decode_step(catalogue):
    w = Workload("ones", tuple(Request(0.01 * i, 100, 1) for i in range(20)))
    r = simulate(SHAPE, Layout("H100", 1), catalogue, w, replicas=1, max_batch=8)
    assert r.completed == 20 and r.decode_tokens == 0 and r.admissions == 20
    assert r.ttft.p50 > 0


def test_weighted_percentiles():
    p = weighted_percentiles([1.0, 2.0, 3.0], [1.0, 1.0, 98.0])
    assert (p.p50, p.p99) == (3.0, 3.0) and p.mean == pytest.approx((1 + 2 + 294) / 100)
    assert weighted_percentiles([5.0, 1.0], [1.0, 1.0]).p50 == 1.0


def test_simulated_shortfalls_read_the_90th_percentiles(catalogue):
    w = synthetic(500, 50, rate=20.0, requests=100)
    r = simulate(SHAPE, Layout("H100", 1), catalogue, w, replicas=1, max_batch=64)
    assert simulated_shortfalls(r, None, None) == ()
    assert simulated_shortfalls(r, r.tbt.p90 * 2, r.ttft.p90 * 2) == ()
    assert simulated_shortfalls(r, r.tbt.p90 / 2, r.ttft.p90 / 2) == ("tbt", "ttft")
