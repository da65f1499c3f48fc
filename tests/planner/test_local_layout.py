"""`lamina up --layout auto`: the layouts of one host ranked on a profile, the profile reused
only for the machine and version it was measured for, and lamina up's choice of when to rank."""

from __future__ import annotations

import argparse
import json

import pytest
from planner_helpers import figure, synthetic_entry

from lamina.planner import local_layout
from lamina.planner.hardware import CatalogueError
from lamina.planner.local_layout import (
    RATE_MAX_CONCURRENCY,
    LocalChoice,
    LocalWorkload,
    concurrency_at_rate,
    machine_profile,
    rank_layouts,
)
from lamina.planner.perf.quantization import FP32, INT4, Q8_0
from lamina.planner.shapes import BUILTIN
from lamina.planner.workload import load_trace

SMOLLM2 = BUILTIN["smollm2-135m"]
F32 = {"as_file": FP32}  # the weights of a float checkpoint: one choice, not ranked


def _entry(cores: int, slice_us: float, frame_us: float, exchange_us: float) -> dict:
    """The synthetic profile with a host of `cores` and the services' overheads of a stack run."""
    entry = synthetic_entry(False)
    entry.update(cores=figure(cores), host_cores=figure(cores), slice_overhead_us=figure(slice_us),
                 frame_overhead_us=figure(frame_us), exchange_overhead_us=figure(exchange_us))
    return entry


def test_the_ranking_follows_the_machine_and_the_workload():
    """One user on a host whose exchanges cost hundreds of microseconds: colocated first.
    32 long requests, where attention dominates: two attention workers first. Every
    layout lamina up can start is ranked, fastest first."""
    few = rank_layouts(_entry(2, 50, 50, 300), SMOLLM2, F32, LocalWorkload(1, 64, 32))
    many = rank_layouts(_entry(2, 50, 50, 300), SMOLLM2, F32, LocalWorkload(32, 2048, 256))
    for ranked in (few, many):
        assert len(ranked) == 5 and [c.tok_s for c in ranked] == sorted((c.tok_s for c in ranked), reverse=True)
        assert {(c.layout, c.attention_workers, c.micro_batches) for c in ranked} == {
            ("colocated", 0, 1), *(("disaggregated", a, m) for a in (1, 2) for m in (1, 2))}
    assert few[0].layout == "colocated"
    assert many[0].layout == "disaggregated" and many[0].attention_workers == 2
    assert few[0].overrides() == {"layout": "colocated"}
    assert many[0].overrides() == {"layout": "disaggregated", "attention.workers": 2,
                                   "pipeline.micro_batches": many[0].micro_batches}


def test_workloads_and_weights_are_read_as_the_flags_spell_them():
    assert LocalWorkload.parse("4,128,64") == LocalWorkload(4, 128, 64)
    assert LocalWorkload(4, 128, 64).mean_context == 160
    assert LocalWorkload.parse("512,256@2.5") == LocalWorkload(RATE_MAX_CONCURRENCY, 512, 256, 2.5)
    for bad in ("4,128", "4,x,64", "0,128,64", "4,128,64,1", "4,128,64@1", "512,256@0", "512,256@x", "512@2"):
        with pytest.raises(ValueError, match="CONCURRENCY,PROMPT_TOKENS,OUTPUT_TOKENS"):
            LocalWorkload.parse(bad)
    gguf = {"q4_1": 210, "q8_0": 1}
    assert local_layout.weights_precision("as_file", gguf) is INT4
    assert local_layout.weights_precision("as_file", {"q8_0": 200, "q4_0": 12}) is Q8_0
    assert local_layout.weights_precision("as_file", {}) is FP32  # a float checkpoint's as_file
    assert local_layout.weights_precision("float32", gguf) is FP32
    assert local_layout.weights_precision("q4", {}) is INT4 and local_layout.weights_precision("q8_0", {}) is Q8_0
    assert local_layout.lossless_weights(gguf) == ("as_file", "float32")
    assert local_layout.lossless_weights({}) == ("as_file",)
    assert LocalChoice("disaggregated", 1, 2, 10.0, "x").describe() == \
        "disaggregated, 1 attention worker, 2 micro-batches"


def test_the_weights_precision_is_ranked_by_its_measured_products():
    """A GGUF checkpoint's own 4-bit blocks against the same values in float32, each on
    the cost per weight its kernel measured: where the 4-bit kernel is the cheaper at one
    sequence but float32's is at many (it computes, where the 4-bit one also unpacks),
    the ranking follows the batch; the choice starts that precision."""
    entry = _entry(2, 50, 50, 300)
    entry["packed_linear_s_per_param"] = figure({"q4_1": {"1": 1.5e-10, "64": 3e-11}})
    entry["linear_s_per_param"] = figure({"1": 4e-10, "64": 5e-12})
    both = {"as_file": INT4, "float32": FP32}
    one = rank_layouts(entry, SMOLLM2, both, LocalWorkload(1, 64, 32))
    many = rank_layouts(entry, SMOLLM2, both, LocalWorkload(64, 64, 32))
    assert len(one) == 2 * 5 and {c.weights for c in one} == {"as_file", "float32"}
    assert one[0].weights == "as_file" and many[0].weights == "float32"
    assert one[0].overrides()["weights"] == "as_file" and many[0].overrides()["weights"] == "float32"
    assert one[0].describe().endswith(", weights as_file")
    # For every layout of one micro-batch (its products at the whole batch), the float32
    # weights' prediction against the 4-bit ones' follows the kernels.
    for ranked, float_wins in ((one, False), (many, True)):
        by = {(c.layout, c.attention_workers, c.micro_batches, c.threads, c.weights): c.tok_s for c in ranked}
        for (lay, a, m, t, w), tok_s in by.items():
            if w == "as_file" and m == 1:
                assert (by[(lay, a, m, t, "float32")] > tok_s) == float_wins
    # One choice (a float checkpoint, or weights set): not ranked, nothing overridden.
    (single,) = {c.weights for c in rank_layouts(entry, SMOLLM2, F32, LocalWorkload(1, 64, 32))}
    assert single == "" and "weights" not in rank_layouts(entry, SMOLLM2, F32, LocalWorkload(1, 64, 32))[0].overrides()


def test_a_trace_is_read_as_its_mean_lengths_and_rate(request):
    path = request.config.rootpath.parent / "shared" / "traces" / "azure_conv_2023.csv"
    if not path.is_file():
        pytest.skip(f"{path} is not here (the traces sit in ../shared beside the checkout)")
    stats = load_trace(path).stats()
    load = LocalWorkload.parse(str(path))
    assert load == LocalWorkload(RATE_MAX_CONCURRENCY, round(stats.mean_prompt), round(stats.mean_output), stats.rate,
                                 "azure_conv_2023.csv")
    assert load.describe().endswith("(the means of azure_conv_2023.csv)")


def test_an_open_workload_decodes_as_many_at_once_as_keeping_up_takes():
    """Little's law: c requests at once, each `output` steps of step_s(c), serve c /
    (output x step_s(c)) requests a second; the least c that serves the rate."""
    def step_s(c: int) -> float:
        return 0.01 + 0.001 * c  # 10 ms plus 1 ms a request

    # 5 requests/s of 100 tokens: c >= 5 x 100 x (0.01 + 0.001 c) = 5 + 0.5 c, so c = 10.
    assert concurrency_at_rate(step_s, 5.0, 100, 256) == (10, True)
    assert concurrency_at_rate(step_s, 0.001, 100, 256) == (1, True)
    # 10 requests/s would need c >= 10 + c: never.
    assert concurrency_at_rate(step_s, 10.0, 100, 256) == (256, False)


def test_an_open_workload_ranks_who_keeps_up_by_time_per_token():
    """A slow rate every layout keeps up with: the shortest time per token first (one
    user on a host whose exchanges are dear: colocated). A rate none keeps up with: the
    most tokens/s first, each at the cap."""
    entry = _entry(2, 50, 50, 300)
    slow = rank_layouts(entry, SMOLLM2, F32, LocalWorkload(RATE_MAX_CONCURRENCY, 64, 32, 0.01))
    assert all(c.keeps_up for c in slow) and [c.step_s for c in slow] == sorted(c.step_s for c in slow)
    assert slow[0].layout == "colocated" and slow[0].batch == 1
    assert slow[0].predicted().endswith("ms/token with 1 decoding")
    flood = rank_layouts(entry, SMOLLM2, F32, LocalWorkload(RATE_MAX_CONCURRENCY, 2048, 256, 1e6))
    assert not any(c.keeps_up for c in flood) and {c.batch for c in flood} == {RATE_MAX_CONCURRENCY}
    assert [c.tok_s for c in flood] == sorted((c.tok_s for c in flood), reverse=True)
    assert flood[0].predicted().startswith("falls behind")


def test_a_profile_is_reused_only_for_this_machine_and_version(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "profile.json"
    measured, said = [], []

    def measure():
        measured.append(1)
        return {"device": {"n": len(measured)}}

    first = machine_profile(path, measure, said.append)  # none yet: measured, written
    assert measured == [1] and "none yet" in said[0] and json.loads(path.read_text()) == first
    assert machine_profile(path, measure, said.append) == first and measured == [1]  # reused
    monkeypatch.setattr(local_layout, "machine_fingerprint", lambda: "another machine")
    assert machine_profile(path, measure, said.append)["device"] == {"n": 2}
    assert "another machine or by another version" in said[-1]
    path.write_text("{not json")
    assert machine_profile(path, measure, said.append)["device"] == {"n": 3} and "unreadable" in said[-1]


def test_a_profile_measured_while_the_host_was_busy_is_measured_again_once(tmp_path):
    """Other processes busy during the measurement: the next start measures again; two busy
    measurements in a row: the second is kept, so a host that is always busy does not pay
    the measurement at every start. A quiet measurement is kept at once."""
    path = tmp_path / "profile.json"
    loads, said = [1.6, 1.2, 0.1], []

    def measure():
        return {"device": {"n": len(said)}, "measurements": {"foreign_cores": loads.pop(0)}}

    first = machine_profile(path, measure, said.append)
    assert first["busy_measurements"] == 1 and "took 1.6 cores" in said[-1] and "measures again" in said[-1]
    second = machine_profile(path, measure, said.append)
    assert "suspect: other processes took 1.6 cores" in said[-2]
    assert second["busy_measurements"] == 2 and "kept: 2 measurements in a row" in said[-1]
    assert machine_profile(path, measure, said.append) == second and loads == [0.1]  # kept: not measured
    path.write_text(json.dumps({**second, "busy_measurements": 1}))  # as `lamina profile` writes a busy one
    quiet = machine_profile(path, measure, said.append)
    assert loads == [] and "busy_measurements" not in quiet and said[-1].startswith("measuring this machine")
    assert machine_profile(path, measure, said.append) == quiet
    assert not local_layout.remeasure_busy({"device": {}})  # a profile without the figure: as measured quiet


def test_a_profile_whose_thread_speedup_did_not_settle_is_measured_again_once(tmp_path):
    """The compute threads' speedup still suspect after its last round (a neighbour on a
    core all along): measured again at the next start, kept the second time; a settled
    one, or one measured before `settled` was recorded, is kept at once."""
    path = tmp_path / "profile.json"
    settles, said = [False, False, True], []

    def measure():
        return {"device": {"n": len(said)}, "measurements": {
            "foreign_cores": 0.0, "thread_speedup": {"2": {"linear": {"1": 0.8}, "attention": 0.9, "rounds": 12,
                                                           "settled": settles.pop(0)}}}}

    first = machine_profile(path, measure, said.append)
    assert first["busy_measurements"] == 1 and "speedup on 2 compute threads did not settle" in said[-1]
    assert "the next start measures again" in said[-1]
    second = machine_profile(path, measure, said.append)
    assert "suspect: the speedup on 2" in said[-2] and "kept: 2 measurements in a row" in said[-1]
    assert machine_profile(path, measure, said.append) == second and settles == [True]
    assert local_layout.suspect({"measurements": {"thread_speedup": {"2": {"linear": {}, "attention": 1.5}}}}) is None


def test_the_foreign_cpu_meter_sees_a_neighbour_and_not_its_own_work():
    """This process's own spinning does not count; a busy process this test did not start
    (about one core) does."""
    import subprocess
    import sys
    import time

    from lamina.planner.measure.host_load import ForeignCpu

    meter = ForeignCpu()
    t = time.perf_counter()
    while time.perf_counter() - t < 1.0:
        pass
    alone = meter.cores()
    spin = "import time\nt = time.time()\nwhile time.time() - t < 30: pass"
    # Started by a shell that exits at once: the spinner is nobody's child here.
    subprocess.run(["sh", "-c", f"{sys.executable} -c '{spin}' >/dev/null 2>&1 &"], check=True)
    try:
        time.sleep(0.3)
        meter = ForeignCpu()
        time.sleep(1.0)
        neighbour = meter.cores()
    finally:
        subprocess.run(["pkill", "-f", "while time.time\\(\\) - t < 30"], check=False)
    assert neighbour > 0.5, neighbour
    assert neighbour > alone + 0.5, (alone, neighbour)


def _up_args(*argv: str) -> argparse.Namespace:
    from lamina.commands import up

    p = argparse.ArgumentParser()
    up.add_arguments(p)
    return p.parse_args(list(argv))


def test_lamina_up_ranks_only_when_no_layout_is_named(tmp_path, monkeypatch, capsys):
    from lamina.commands.up import _auto_layout

    monkeypatch.delenv("LAMINA_LAYOUT", raising=False)
    assert _auto_layout(_up_args()) is True
    assert _auto_layout(_up_args("--layout", "auto")) is True
    for named in (["--layout", "colocated"], ["--attention-workers", "1"], ["--micro-batches", "1"],
                  ["--partition", "head"], ["--pipeline", "rotational"]):
        assert _auto_layout(_up_args(*named)) is False, named
    config = tmp_path / "stack.yaml"
    config.write_text("pipeline:\n  micro_batches: 1\n")
    assert _auto_layout(_up_args("--config", str(config))) is False
    config.write_text("model_worker:\n  threads: 2\n")
    assert _auto_layout(_up_args("--config", str(config))) is True
    monkeypatch.setenv("LAMINA_LAYOUT", "disaggregated")
    assert _auto_layout(_up_args()) is False
    assert _auto_layout(_up_args("--layout", "auto", "--ray", "auto")) is None
    assert "under --ray name one" in capsys.readouterr().err


def test_lamina_up_chooses_on_the_cached_profile_without_measuring(tmp_path, monkeypatch, capsys):
    """The profile for this machine is there: nothing is measured, the first of the
    ranking is chosen and the three best are printed with their predictions."""
    import lamina.planner.profile as prof
    from lamina.commands.up import choose_layout
    from lamina.services.config import load_config

    monkeypatch.setattr(prof, "profile", lambda *a, **k: pytest.fail("measured although a profile was there"))
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"device": _entry(2, 50, 50, 300), "fingerprint": local_layout.machine_fingerprint()}))
    choice = choose_layout(load_config(env={}), "1,64,32", path)
    assert choice is not None and choice.layout == "colocated"
    err = capsys.readouterr().err
    assert ("layout auto: colocated, 1 thread, weights as_file; predicted for 1 request at once, 64-token prompts, "
            "32 output tokens") in err
    assert err.count("tok/s") == 3
    assert choose_layout(load_config(env={}), "1,64", path) is None
    assert "CONCURRENCY,PROMPT_TOKENS,OUTPUT_TOKENS" in capsys.readouterr().err
    choice = choose_layout(load_config(env={}), "64,32@0.01", path)  # an open workload: time per token
    assert choice is not None and choice.layout == "colocated"
    err = capsys.readouterr().err
    assert ("predicted for 0.01 requests/s of 64-token prompts and 32 output tokens: colocated, 1 thread, "
            "weights as_file ") in err
    assert err.count("ms/token with 1 decoding") == 3


def _speedups(entry: dict, linear: dict[int, float], attention: float, threads: int = 2) -> dict:
    """`entry` with a measured speedup on `threads` compute threads (linear: by batch)."""
    return {**entry, "thread_speedup": figure({str(threads): {"linear": {str(b): x for b, x in linear.items()},
                                                               "attention": attention}})}


def test_a_colocated_model_workers_threads_are_ranked_by_their_measured_speedup():
    """Each thread count the profile measured is a colocated candidate, predicted by its
    speedup: threads that pay rank first, threads that do not (a host whose second core
    is taken) rank below one thread; a profile without speedups ranks one thread only."""
    from lamina.planner.hardware import device_from_entry

    base = _entry(2, 50, 50, 300)
    assert [c.threads for c in rank_layouts(base, SMOLLM2, F32, LocalWorkload(4, 64, 32))
            if c.layout == "colocated"] == [1]
    paying = rank_layouts(_speedups(base, {1: 1.6, 64: 1.9}, 1.5), SMOLLM2, F32, LocalWorkload(4, 64, 32))
    colocated = [c for c in paying if c.layout == "colocated"]
    assert [c.threads for c in colocated] == [2, 1] and paying[0].threads == 2
    # The products sped up by their speedup at batch 4, attention by its own: in between.
    assert 1.5 < colocated[0].tok_s / colocated[1].tok_s <= 1.6 + (4 - 1) / (64 - 1) * 0.3 + 1e-9
    # Overheads (one thread's) do not speed up: with a per-layer one the gain is smaller.
    overhead = {**base, "layer_overhead_us": figure(500.0)}
    slowed = [c for c in rank_layouts(_speedups(overhead, {1: 1.6, 64: 1.9}, 1.5), SMOLLM2, F32,
                                      LocalWorkload(4, 64, 32)) if c.layout == "colocated"]
    assert 1.0 < slowed[0].tok_s / slowed[1].tok_s < 1.5
    assert paying[0].describe() == "colocated, 2 threads" and colocated[1].describe() == "colocated, 1 thread"
    slower = rank_layouts(_speedups(base, {1: 0.8, 64: 0.9}, 0.9), SMOLLM2, F32, LocalWorkload(4, 64, 32))
    assert [c.threads for c in slower if c.layout == "colocated"] == [1, 2]
    # Disaggregated model workers keep one thread; a count beyond the host's cores is not ranked.
    assert all(c.threads == 1 for c in paying if c.layout == "disaggregated")
    beyond = rank_layouts(_speedups(base, {1: 1.6}, 1.5, threads=4), SMOLLM2, F32, LocalWorkload(4, 64, 32))
    assert [c.threads for c in beyond if c.layout == "colocated"] == [1]

    device = device_from_entry("m", _speedups(base, {1: 1.2, 16: 1.8}, 1.4))
    assert device.measured_threads == (1, 2)
    assert device.linear_speedup(1, 8) == 1.0 and device.linear_speedup(2, 1) == 1.2
    assert device.linear_speedup(2, 64) == 1.8 and abs(device.linear_speedup(2, 8) - (1.2 + 7 / 15 * 0.6)) < 1e-9
    assert device.attention_speedup(2) == 1.4
    with pytest.raises(ValueError, match="no measured speedup for 4 threads"):
        device.linear_speedup(4, 1)
    for bad in ({"2": {"linear": {}, "attention": 1.0}}, {"2": {"linear": {"1": 0}, "attention": 1.0}},
                {"2": {"linear": {"1": 1.0}}}):
        with pytest.raises(CatalogueError, match="thread_speedup"):
            device_from_entry("m", {**base, "thread_speedup": figure(bad)})
    assert local_layout.thread_choices(1) == (1,) and local_layout.thread_choices(2) == (1, 2)
    assert local_layout.thread_choices(6) == (1, 2, 4, 6) and local_layout.thread_choices(64) == (1, 2, 4, 8)


def test_a_colocated_choice_gives_the_model_workers_its_threads_unless_set(tmp_path, monkeypatch):
    """auto_model_threads: colocated, the thread count the planner ranked first, within the
    host's cores shared among the model workers; disaggregated, the default. lamina up
    applies it only where neither the flag, the file nor the environment sets the threads."""
    from lamina.commands.up import _auto_threads
    from lamina.planner.local_layout import auto_model_threads

    colocated = LocalChoice("colocated", 0, 1, 100.0, "compute", threads=2)
    disaggregated = LocalChoice("disaggregated", 1, 2, 90.0, "compute")
    assert auto_model_threads(colocated, 2, 1) == 2
    assert auto_model_threads(colocated, 8, 3) == 2
    assert auto_model_threads(colocated, 2, 4) == 1
    assert auto_model_threads(LocalChoice("colocated", 0, 1, 100.0, "compute"), 96, 1) == 1
    assert auto_model_threads(disaggregated, 8, 1) is None

    monkeypatch.delenv("LAMINA_MODEL_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    assert _auto_threads(_up_args(), colocated, 1) == 2
    assert _auto_threads(_up_args(), disaggregated, 1) == 0
    assert _auto_threads(_up_args("--model-threads", "1"), colocated, 1) == 0
    config = tmp_path / "stack.yaml"
    config.write_text("model_worker:\n  threads: 1\n")
    assert _auto_threads(_up_args("--config", str(config)), colocated, 1) == 0
    monkeypatch.setenv("LAMINA_MODEL_THREADS", "1")
    assert _auto_threads(_up_args(), colocated, 1) == 0


def test_an_open_workload_decodes_no_more_at_once_than_the_scheduler_admits(tmp_path, monkeypatch, capsys):
    """scheduler.max_batch_size auto is 64 with the model workers on the CPU (256 on a GPU):
    a rate that would need more decoding at once falls behind at 64, as the scheduler
    would hold the rest back."""
    import lamina.planner.profile as prof
    from lamina.commands.up import choose_layout
    from lamina.services.config import load_config

    config = load_config(env={})
    assert config.scheduler.max_batch_size == 64
    assert load_config(env={"LAMINA_MODEL_DEVICE": "cuda"}).scheduler.max_batch_size == 256
    assert load_config(env={}, overrides={"scheduler.max_batch_size": 8}).scheduler.max_batch_size == 8
    monkeypatch.setattr(prof, "profile", lambda *a, **k: pytest.fail("measured although a profile was there"))
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"device": _entry(2, 50, 50, 300), "fingerprint": local_layout.machine_fingerprint()}))
    choice = choose_layout(config, "64,32@1000", path)
    assert choice is not None and choice.batch == 64 and choice.keeps_up is False
    assert capsys.readouterr().err.count("falls behind") == 3
    capped = choose_layout(load_config(env={}, overrides={"scheduler.max_batch_size": 8}), "64,32@1000", path)
    assert capped is not None and capped.batch == 8
