"""planner/measure/stack_run.py's figures from the services' counters (window_shares):
each share is one kind of time over the window's wall seconds, and the run's figures say
what they measure. Counters are made up; the stack run itself is the benchmark's."""

import pytest

from lamina.planner.measure.stack_run import window_shares


def _counters(kind: str, compute: float, send: float, cpu: float, device_wait: float = 0.0,
              reply_wait: float = 0.0) -> dict[str, float]:
    out = {f"lamina_{kind}_compute_seconds_total": compute, f"lamina_{kind}_send_seconds_total": send,
           "process_cpu_seconds_total": cpu, f"lamina_{kind}_device_wait_seconds_total": device_wait}
    if kind == "model":
        out["lamina_model_reply_wait_seconds_total"] = reply_wait
    return out


def test_shares_are_counter_increases_over_the_window():
    before = {"model-0": _counters("model", 10.0, 1.0, 20.0, 1.0, 3.0),
              "attention-0": _counters("attention", 5.0, 0.0, 6.0, 0.5)}
    after = {"model-0": _counters("model", 16.0, 2.0, 27.0, 2.5, 15.0),
             "attention-0": _counters("attention", 7.0, 0.5, 9.0, 0.7)}
    got = window_shares(before, after, wall=10.0)
    # The waits are wall seconds summed over the tasks waiting: over 1 where several waited at once.
    assert got["shares"]["model-0"] == pytest.approx({"compute": 0.6, "send": 0.1, "cpu": 0.7, "device_wait": 0.15,
                                                      "reply_wait": 1.2})
    assert got["shares"]["attention-0"] == pytest.approx({"compute": 0.2, "send": 0.05, "cpu": 0.3,
                                                          "device_wait": 0.02})
    assert got["model_idle"] == pytest.approx(0.3)  # 1 - the model worker's process CPU share
    assert got["cores_busy"] == pytest.approx(1.0)
    assert got["model_compute_s"] == pytest.approx(6.0)  # CPU seconds in the slices


def test_two_attention_workers_computing_together_are_not_model_overlap():
    # Two attention workers each busy for the whole window, the model worker idle: the old
    # figure (model + attention compute - wall) called 1.0 of the window overlap. Here the
    # model worker's idle share says it did nothing, and the cores busy count both workers.
    zero = {"model-0": _counters("model", 0, 0, 0), "attention-0": _counters("attention", 0, 0, 0),
            "attention-1": _counters("attention", 0, 0, 0)}
    after = {"model-0": _counters("model", 0, 0, 0), "attention-0": _counters("attention", 4.0, 0, 4.0),
             "attention-1": _counters("attention", 4.0, 0, 4.0)}
    got = window_shares(zero, after, wall=4.0)
    assert "overlap" not in got
    assert got["model_idle"] == 1.0
    assert got["cores_busy"] == pytest.approx(2.0)


def test_idle_is_of_the_model_workers_threads_and_never_negative():
    before = {"model-0": _counters("model", 0, 0, 0), "model-1": _counters("model", 0, 0, 0)}
    after = {"model-0": _counters("model", 1.0, 0, 3.0), "model-1": _counters("model", 1.0, 0, 1.0)}
    # Two compute threads each: 1 - 1.5 / 2 and 1 - 0.5 / 2, averaged over the workers.
    assert window_shares(before, after, wall=2.0, model_threads=2)["model_idle"] == pytest.approx(0.5)
    # One thread: a process whose threads used more than one core is not idle, not less than that.
    assert window_shares(before, after, wall=2.0)["model_idle"] == pytest.approx((0.0 + 0.5) / 2)


def test_colocated_attention_shares_its_model_workers_process():
    # A colocated attention service exports its host process's CPU: counted once.
    before = {"model-0": _counters("model", 0, 0, 0), "attention-0": _counters("attention", 0, 0, 0)}
    after = {"model-0": _counters("model", 2.0, 0, 3.0), "attention-0": _counters("attention", 0.5, 0, 3.0)}
    assert window_shares(before, after, wall=4.0, colocated=True)["cores_busy"] == pytest.approx(0.75)
    assert window_shares(before, after, wall=4.0)["cores_busy"] == pytest.approx(1.5)
