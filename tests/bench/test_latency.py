"""bench/latency.py's arithmetic: token timings, medians over passes, the order of the
passes, the step breakdowns and the targets. The runs themselves start three servers and
take minutes; they are the benchmark's, not this test's."""

import math

import pytest

# bench/latency.py (bench/ is on the tests' path: pyproject.toml)
from latency import (
    COUNTERS,
    ENGINE,
    LLAMA,
    check_targets,
    engine_breakdown,
    latency_row,
    median_row,
    pass_order,
    stack_breakdown,
    token_timings,
)


def test_token_timings_first_token_and_every_gap():
    ttft, tbt = token_timings([[1.5, 2.0, 2.25], [3.0], []], start=1.0)
    assert ttft == [0.5, 2.0]  # a sequence with no token has no TTFT
    assert tbt == [0.5, 0.25]


def test_latency_row_percentiles_and_rate():
    tbt = [float(i) for i in range(1, 101)]  # 1..100
    row = latency_row([0.2, 0.1, 0.3], tbt, tokens=50, seconds=2.0)
    assert row["ttft_p50"] == 0.2
    assert row["tbt_p50"] == 51.0  # nearest rank of sorted values (serving.pct)
    assert row["tbt_p99"] == 99.0
    assert row["tbt_mean"] == 50.5
    assert row["tok_s"] == 25.0
    assert math.isnan(latency_row([], [], 0, 1.0)["tbt_p50"])


def test_median_row_takes_each_figure_on_its_own():
    runs = [{"ttft_p50": 1, "ttft_p99": 9, "tbt_p50": 3, "tbt_p99": 4, "tbt_mean": 3, "tok_s": 10,
             "foreign_cores": 0.0, "chunks": 7},
            {"ttft_p50": 2, "ttft_p99": 1, "tbt_p50": 5, "tbt_p99": 8, "tbt_mean": 5, "tok_s": 30,
             "foreign_cores": 0.5, "chunks": 7}]
    assert median_row(runs) == {"ttft_p50": 1.5, "ttft_p99": 5, "tbt_p50": 4, "tbt_p99": 6, "tbt_mean": 4,
                                "tok_s": 20, "foreign_cores": 0.25}


def test_passes_alternate_the_order():
    systems = ["a", "b", "c"]
    assert pass_order(systems, 0) == ["a", "b", "c"]
    assert pass_order(systems, 1) == ["c", "b", "a"]
    assert pass_order(systems, 2) == ["a", "b", "c"]


def test_engine_breakdown_python_is_the_rest():
    parts = dict(engine_breakdown(0.010, {"products": 0.006, "attention": 0.001}, 0.002))
    assert parts["products"] == 0.006 and parts["torch operators"] == 0.002
    assert parts["Python and the rest"] == pytest.approx(0.001)
    # instrumented passes that sum past the plain step leave no negative rest
    assert dict(engine_breakdown(0.005, {"products": 0.006}, 0.001))["Python and the rest"] == 0.0


def test_stack_breakdown_per_model_worker_step():
    def counters(steps, compute, send, wall, attention):
        return {"model-0": {COUNTERS["steps"]: steps, COUNTERS["compute"]: compute, COUNTERS["send"]: send,
                            COUNTERS["step_wall"]: wall},
                "attention-0": {COUNTERS["attention"]: attention / 2},
                "attention-1": {COUNTERS["attention"]: attention / 2}}

    before = counters(10, 1.0, 0.1, 2.0, 0.2)
    after = counters(110, 2.0, 0.3, 4.0, 0.6)  # 100 steps: 10 ms compute, 2 ms send, 20 ms wall, 4 ms attention
    rows, steps = stack_breakdown(before, after, tbt_mean_s=0.025)
    parts = {name: s for name, s in rows}
    assert steps == 100
    assert parts["model worker: slices (CPU time)"] == pytest.approx(0.010)
    assert parts["attention (CPU time)"] == pytest.approx(0.004)
    assert parts["model worker: sending frames"] == pytest.approx(0.002)
    assert parts["rest of the model worker's step"] == pytest.approx(0.020 - 0.010 - 0.004 - 0.002)
    assert parts["outside the step (TBT mean - step)"] == pytest.approx(0.005)
    assert sum(parts.values()) == pytest.approx(0.025)  # the parts add up to the measured TBT
    assert stack_breakdown(before, before, 0.025) == ([], 0)


def test_targets_against_llama_server():
    def row(tbt_p50, tok_s):
        return {"tbt_p50": tbt_p50, "tok_s": tok_s}

    table = {1: {LLAMA: row(0.010, 100), "up": row(0.012, 95), ENGINE: row(0.013, 80)},
             4: {LLAMA: row(0.020, 200), "up": row(0.030, 150), ENGINE: row(0.02, 200)}}
    t = check_targets(table, ENGINE, "up")
    engine, up_tbt, up_1, up_4, up_12 = t.values()
    assert engine["value"] == pytest.approx(1.3) and engine["met"] is False  # limit 1.2x
    assert up_tbt["value"] == pytest.approx(1.2) and up_tbt["met"] is True  # limit 1.3x
    assert up_1["met"] is True and up_4["met"] is False  # 0.95x and 0.75x against 0.9x
    assert up_12 == {"value": None, "limit": 0.9, "met": None}  # concurrency 12 not run
