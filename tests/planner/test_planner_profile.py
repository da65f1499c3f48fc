"""`lamina profile` on tiny sizes: its measurements (planner/measure/) run, and what it
writes is a catalogue entry `lamina plan` reads (the full profile takes seconds to a
minute and is bench/planner_validation.py's first step)."""

import pytest

torch = pytest.importorskip("torch")

from lamina.planner.hardware import THIS_MACHINE, device_from_entry  # noqa: E402
from lamina.planner.profile import (  # noqa: E402
    measure_attention,
    measure_linear,
    measure_linears,
    overhead_terms,
)


def test_linear_and_attention_measurements_are_positive_and_ordered():
    linear = measure_linear((1, 8), layers=1, repeats=1)
    assert set(linear) == {1, 8}
    assert all(v["seconds"] > 0 and v["s_per_param"] > 0 for v in linear.values())
    assert linear[8]["flops"] > 0
    attention = measure_attention(((2, 64),), repeats=1)
    assert attention["2x64"]["kv_bytes_s"] > 0 and attention["2x64"]["q4_s_per_element"] > 0
    q4 = measure_linear((1,), layers=1, repeats=1, fmt="q4_1")
    assert q4[1]["weight_bytes_s"] < linear[1]["weight_bytes_s"] * 10  # packed bytes, not float32's


def test_the_fastest_of_the_rounds_is_kept(monkeypatch):
    """Each format is timed once a round, the rounds in turn; a round slowed (here the
    first, by a neighbour) is not the one kept."""
    import lamina.planner.measure.kernels as kernels

    clock = iter([5.0, 1.0, 5.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # round 1: f32 b1, b2, q4_1 b1, b2; round 2
    calls = []
    monkeypatch.setattr(kernels, "fastest_compute_time", lambda fn, repeats: (calls.append(fn), next(clock))[1])
    tables = measure_linears(("f32", "q4_1"), (1, 2), layers=1, repeats=1, rounds=2)
    assert {fmt: {b: v["seconds"] for b, v in t.items()} for fmt, t in tables.items()} == {
        "f32": {1: 2.0, 2: 1.0}, "q4_1": {1: 2.0, 2: 1.0}}
    assert len(calls) == 8


def test_a_kernel_on_several_threads_is_timed_in_wall_seconds(monkeypatch):
    """On one thread a kernel's CPU seconds are its compute; on two they add up to about
    twice its wall time, so there the profile counts wall seconds."""
    import lamina.planner.measure.kernels as kernels
    from lamina.model.quant import kernel_threads, set_kernel_threads

    monkeypatch.setattr(kernels, "fastest_cpu_time", lambda fn, repeats: "cpu")
    monkeypatch.setattr(kernels, "fastest_wall_time", lambda fn, repeats: "wall")
    before, torch_before = kernel_threads(), torch.get_num_threads()
    try:
        set_kernel_threads(1)
        torch.set_num_threads(1)
        assert kernels.fastest_compute_time(lambda: None, 1) == "cpu"
        set_kernel_threads(2)
        assert kernels.fastest_compute_time(lambda: None, 1) == "wall"
    finally:
        set_kernel_threads(before)
        torch.set_num_threads(torch_before)


def test_profile_command_writes_what_plan_reads(tmp_path, monkeypatch, capsys):
    import json

    import lamina.planner.profile as prof
    from lamina.cli import main

    fake = {"rtt_us_64B": 100.0, "gbit_s_1MiB": 4.0}
    measured = []

    def fake_transport(quick=True, scheme="tcp"):  # no server process in a unit test
        measured.append(scheme)
        return fake

    monkeypatch.setattr(prof, "measure_transport", fake_transport)
    monkeypatch.setattr(prof, "measure_linears", lambda formats, b, layers, repeats, rounds=1:
                        measure_linears(formats, (1, 2), 1, 1, rounds))
    monkeypatch.setattr(prof, "measure_attention", lambda cases, repeats: measure_attention(((1, 32),), 1))
    # Loading the engine's model takes seconds; the overhead's arithmetic is tested below.
    monkeypatch.setattr(prof, "measure_engine_overhead",
                        lambda entry, steps, threads: {"layer_s": 1e-4, "token_s": 0.0})
    monkeypatch.setattr(prof, "measure_thread_speedup", lambda counts, layers, repeats: {
        t: {"linear": {1: 1.5, 64: 1.8}, "attention": 1.4, "rounds": 3, "settled": True}
        for t in counts if t > 1})
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    # The stack run starts every service; its arithmetic is tested below.
    monkeypatch.setattr(prof, "measure_stack_overhead",
                        lambda entry: {"slice_s": 2e-4, "frame_s": 3e-4, "exchange_s": 5e-4})
    out = tmp_path / "profile.json"
    assert main(["profile", "--quick", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    dev = device_from_entry(THIS_MACHINE, written["device"])
    # Every transport this machine runs is measured; the others say why not.
    from lamina import transports

    runnable = [s for s in prof.TRANSPORTS if transports.availability(s) is None]
    assert measured == runnable and "tcp" in runnable
    for scheme in prof.TRANSPORTS:
        figures = written["measurements"]["transports"][scheme]
        assert figures == fake if scheme in runnable else figures["unavailable"]
    assert dev.network_latency == pytest.approx(50e-6) and dev.linear_s_per_param
    assert dev.layer_overhead_s == pytest.approx(1e-4) and dev.token_overhead_s == 0.0
    assert set(dev.packed_linear_s_per_param) == {"q8_0", "q4_0", "q4_1"}
    assert (dev.slice_overhead_s, dev.frame_overhead_s, dev.exchange_overhead_s) == pytest.approx((2e-4, 3e-4, 5e-4))
    assert dev.host_cores == 2 and dev.measured_threads == (1, 2) and dev.linear_speedup(2, 64) == 1.8
    assert dev.attention_q4_s_per_element > 0 and dev.kv_q4_quantize_s_per_element > 0
    assert main(["plan", "--model", "smollm2-135m", "--hardware", "this-machine", "--profile", str(out),
                 "--prompt-tokens", "64", "--output-tokens", "16", "--rate", "0.5", "--json"]) == 0
    assert "this-machine" in capsys.readouterr().out


def test_thread_speedup_is_measured_for_each_count_above_one_and_leaves_the_threads_as_they_were():
    from lamina.model.quant import kernel_threads
    from lamina.planner.profile import SPEEDUP_BATCHES, measure_thread_speedup

    before = kernel_threads()
    speedup = measure_thread_speedup((1, 2), layers=1, repeats=1)
    assert set(speedup) == {2} and set(speedup[2]["linear"]) == set(SPEEDUP_BATCHES)
    assert all(x > 0 for x in speedup[2]["linear"].values()) and speedup[2]["attention"] > 0
    assert kernel_threads() == before
    assert measure_thread_speedup((1,), layers=1, repeats=1) == {}


def _timed_speedup(monkeypatch, two_thread_times):
    """measure_thread_speedup((1, 2)) where one thread takes 2 s at every case and two take
    the next of `two_thread_times` (one per case, in each round's order); how many
    two-thread timings it took."""
    import lamina.planner.measure.kernels as kernels
    from lamina.model.quant import kernel_threads
    from lamina.planner.profile import measure_thread_speedup

    two = iter(two_thread_times)
    taken = []

    def timed(fn, repeats):
        if kernel_threads() == 1:
            return 2.0
        taken.append(next(two))
        return taken[-1]

    monkeypatch.setattr(kernels, "fastest_wall_time", timed)
    return measure_thread_speedup((1, 2), layers=1, repeats=1), len(taken)


def test_thread_speedup_keeps_each_side_fastest_round(monkeypatch):
    """One thread and two are timed alternately, case by case, in SPEEDUP_ROUNDS rounds;
    two slowed rounds of the two-thread side (a neighbour) do not make two threads look
    slower than one."""
    from lamina.planner.profile import SPEEDUP_ATTENTION, SPEEDUP_BATCHES, SPEEDUP_ROUNDS

    per_round = len(SPEEDUP_BATCHES) + len(SPEEDUP_ATTENTION)
    assert SPEEDUP_ROUNDS == 3
    speedup, taken = _timed_speedup(monkeypatch, [1.0] * per_round + [4.0] * per_round * 2)
    assert speedup[2] == {"linear": dict.fromkeys(SPEEDUP_BATCHES, 2.0), "attention": 2.0, "rounds": 3,
                          "settled": True}
    assert taken == 3 * per_round


def test_thread_speedup_goes_on_until_its_figures_settle(monkeypatch):
    """Two threads slowed in every one of the first rounds (a neighbour on one core for
    seconds: 0.8x) are measured again, round after round, until a quiet round gives a
    plausible figure and the next one confirms it; so is a round that still moves the
    figures by more than a tenth; a machine slowed throughout keeps its figure after
    SPEEDUP_MAX_ROUNDS rounds."""
    from lamina.planner.profile import (
        SPEEDUP_ATTENTION,
        SPEEDUP_BATCHES,
        SPEEDUP_MAX_ROUNDS,
        SPEEDUP_ROUNDS,
        fastest_ratios,
        speedup_suspect,
    )

    per_round = len(SPEEDUP_BATCHES) + len(SPEEDUP_ATTENTION)
    slowed = [2.5] * per_round * (SPEEDUP_ROUNDS + 1)
    speedup, taken = _timed_speedup(monkeypatch, slowed + [1.1] * per_round * SPEEDUP_MAX_ROUNDS)
    assert speedup[2]["rounds"] == SPEEDUP_ROUNDS + 3 and taken == (SPEEDUP_ROUNDS + 3) * per_round
    assert speedup[2]["linear"] == pytest.approx(dict.fromkeys(SPEEDUP_BATCHES, 2 / 1.1))
    # 1.33x, then 1.67x in the third round: plausible, but moved; a fourth round confirms.
    moving = [1.5] * per_round * 2 + [1.2] * per_round * SPEEDUP_MAX_ROUNDS
    speedup, taken = _timed_speedup(monkeypatch, moving)
    assert speedup[2]["rounds"] == 4 and speedup[2]["attention"] == pytest.approx(2 / 1.2)
    assert speedup[2]["settled"]
    speedup, taken = _timed_speedup(monkeypatch, [2.5] * per_round * SPEEDUP_MAX_ROUNDS)
    assert speedup[2]["rounds"] == SPEEDUP_MAX_ROUNDS and speedup[2]["attention"] == pytest.approx(0.8)
    assert not speedup[2]["settled"]
    # Suspect: barely faster on T threads than on one at some case.
    assert not speedup_suspect({("linear", 1): 1.3, ("attention", 0): 2.2})
    assert speedup_suspect({("linear", 1): 1.2, ("attention", 0): 1.8})
    # Each side's fastest round, whichever rounds they came from.
    rounds = [{("linear", 1): (2.0, 3.0)}, {("linear", 1): (4.0, 1.0)}]
    assert fastest_ratios(rounds) == {("linear", 1): 2.0}


def test_overhead_terms_meet_both_points():
    # 10 layers; gaps of 1 ms per layer at batch 1 and 2.5 ms at batch 16.
    layer, token = overhead_terms([(1, 0.030, 0.020), (16, 0.060, 0.035)], num_layers=10)
    assert token == pytest.approx(0.0001)
    assert layer == pytest.approx(0.0009)
    assert layer + 16 * token == pytest.approx(0.0025)
    assert overhead_terms([(1, 0.01, 0.02), (16, 0.01, 0.03)], 10) == (0.0, 0.0)  # never negative


def test_stack_overhead_terms_close_the_gap_to_the_run():
    from planner_helpers import synthetic_entry

    from lamina.planner.estimate import decode_step
    from lamina.planner.layouts import Layout
    from lamina.planner.perf.quantization import FP32
    from lamina.planner.profile import StackRun, stack_overhead_terms
    from lamina.planner.shapes import BUILTIN

    shape = BUILTIN["smollm2-135m"]
    entry = synthetic_entry(False)
    dev = device_from_entry(THIS_MACHINE, entry)
    run = StackRun(batch=8, context=70, step_s=0.5, model_cpu_s=0.2, attention_cpu_s=0.05)
    terms = stack_overhead_terms(shape, dev, run)
    assert min(terms.values()) > 0
    for key in ("slice", "frame", "exchange"):
        entry[f"{key}_overhead_us"] = {"value": terms[f"{key}_s"] * 1e6, "source": "test"}
    calibrated = {THIS_MACHINE: device_from_entry(THIS_MACHINE, entry)}
    layout = Layout(THIS_MACHINE, 1, 1, THIS_MACHINE, 1, 1, "head", FP32, FP32, shared_host=True)
    # One micro-batch on an idle host: the calibrated chain is the run's step.
    assert decode_step(shape, layout, calibrated, 8, 70).step_s == pytest.approx(0.5)
    # A faster run than the kernels allow: no negative overhead.
    assert stack_overhead_terms(shape, dev, StackRun(8, 70, 1e-4, 1e-4, 1e-5)) == \
        {"slice_s": 0.0, "frame_s": 0.0, "exchange_s": 0.0}


def test_the_profile_says_fhbn_is_host_driven_rdma(monkeypatch):
    """Measured or not, the fhbn entry names the path its frames take today."""
    from lamina.planner import profile

    monkeypatch.setattr(profile, "TRANSPORTS", ("fhbn",))
    entry = profile.measure_transports(quick=True)["fhbn"]
    assert entry["path"].startswith("host-driven RDMA") and "not wired" in entry["path"]


def test_the_engine_overhead_is_timed_in_wall_seconds_with_more_than_one_thread(monkeypatch):
    """CPU seconds count every thread's: with two, the overhead terms came out about double
    (bench/planner_validation.py --out-of-sample's two-thread cases, 33-56% slow)."""
    from planner_helpers import synthetic_entry

    import lamina.planner.measure.engine_step as engine_step
    from lamina.planner import profile as prof

    timed: list[str] = []
    monkeypatch.setattr(engine_step, "decode_step_cpu", lambda *a, **k: timed.append("cpu") or 0.03)
    monkeypatch.setattr(engine_step, "decode_step_wall", lambda *a, **k: timed.append("wall") or 0.03)
    entry = synthetic_entry(False)
    prof.measure_engine_overhead(entry, 2, threads=2)
    assert timed == ["wall", "wall"]
    timed.clear()
    prof.measure_engine_overhead(entry, 2)
    assert timed == ["cpu", "cpu"]


def test_a_kernel_counts_its_fastest_repeat():
    """A neighbour inflates a call's time, never deflates it: of three timed calls (after
    an untimed warm-up) the fastest counts, not the median."""
    import lamina.planner.measure.kernels as kernels

    ticks = iter([0.0, 5.0, 10.0, 11.0, 20.0, 23.0])  # calls of 5, 1 and 3 seconds
    calls = []
    assert kernels._fastest_time(lambda: calls.append(1), 3, lambda: next(ticks)) == 1.0
    assert len(calls) == 4


def test_every_transport_the_profile_measures_has_a_loopback_address():
    """measure_transports pingpongs each scheme this machine runs: each one but the verbs
    transports (their address names a device) listens on this host as its own scheme. A
    GPU machine's profile once stopped at cuda_ipc, which had none."""
    from lamina.planner.measure.pingpong import loopback_address
    from lamina.planner.profile import TRANSPORTS

    for scheme in set(TRANSPORTS) - {"rdma", "fhbn"}:
        assert loopback_address(scheme).startswith(f"{scheme}://")
    with pytest.raises(ValueError, match="no loopback address for 'carrier-pigeon'"):
        loopback_address("carrier-pigeon")
