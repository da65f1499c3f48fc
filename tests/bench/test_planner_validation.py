"""bench/planner_validation.py's order of measurement: the out-of-sample run itself takes
most of an hour, so the benchmark runs it, not this suite."""

from collections import Counter
from dataclasses import replace
from itertools import pairwise

# bench/planner_validation.py (bench/ is on the tests' path: pyproject.toml)
from planner_validation import OUT_OF_SAMPLE, Case, schedule


def test_cases_alternate_within_their_family_family_by_family():
    cases = [Case("e", None, "engine", 1, 32), Case("s", None, "stack", 4, 64, layout="colocated"),
             Case("s", None, "stack", 4, 64, layout="disaggregated", attention_workers=1),
             Case("e", None, "engine", 2, 32), Case("t", None, "stack", 4, 64, threads=2)]
    # Family "e" in three rounds, each member once a round, a different one first each
    # round; then family "s" likewise; then "t", alone in its family.
    assert schedule(cases, 3) == [0, 3, 3, 0, 0, 3, 1, 2, 2, 1, 1, 2, 4, 4, 4]
    assert schedule(cases, 1) == [0, 3, 1, 2, 4]


def test_every_out_of_sample_case_is_measured_rounds_times():
    assert Counter(schedule(list(OUT_OF_SAMPLE), 3)) == Counter({i: 3 for i in range(len(OUT_OF_SAMPLE))})
    assert len({c.family for c in OUT_OF_SAMPLE if c.kind == "stack"}) == 6 and len(OUT_OF_SAMPLE) >= 20


def test_the_in_sample_stack_cases_alternate_and_their_fastest_pass_counts(monkeypatch, capsys):
    """--stack: every case measured `rounds` times, alternating with the others (never one
    case's passes back to back), each row its fastest pass against the planner's figure."""
    import json
    from importlib import resources

    import planner_validation
    import yaml

    from lamina.planner.hardware import THIS_MACHINE

    catalogue = yaml.safe_load(resources.files("lamina.planner").joinpath("catalogue.yaml").read_text())
    calls: list[planner_validation.Case] = []

    def measure(case, models):  # each case's passes: 100, 110, 105 tok/s, plus its index
        calls.append(case)
        return {1: 100.0, 2: 110.0, 3: 105.0}[calls.count(case)] + planner_validation.STACK_CASES.index(case)

    monkeypatch.setattr(planner_validation, "measure", measure)
    monkeypatch.setattr(planner_validation.ForeignCpu, "cores", lambda self: 0.0)
    cpu = planner_validation.catalogue_of({"device": catalogue["CPU"]})
    rows = planner_validation.stack_cases(cpu, rounds=3)
    cases = list(planner_validation.STACK_CASES)
    assert len(calls) == 3 * len(cases) and all(a != b for a, b in pairwise(calls))
    assert [r["measured_tok_s"] for r in rows] == [110.0 + i for i in range(len(cases))]
    for row, case in zip(rows, cases):
        predicted, bottleneck = planner_validation.predict(case, {None: planner_validation.BUILTIN["smollm2-135m"]},
                                                           {1: cpu}, {None: {}})
        assert row["predicted_tok_s"] == round(predicted, 1) and row["bottleneck"] == bottleneck
        assert (row["attention_workers"], row["stack_micro_batches"]) == (case.attention_workers,
                                                                          case.micro_batches)
    assert THIS_MACHINE in cpu and json.dumps(rows)  # the rows go into the report's JSON line


def test_each_family_is_predicted_from_the_profile_it_needs():
    from planner_validation import profile_needs

    engine2 = [c for c in OUT_OF_SAMPLE if c.family == "engine, 2 threads"]
    assert engine2 and profile_needs(engine2) == (2, False)
    engine1 = [c for c in OUT_OF_SAMPLE if c.family == "engine, 360M shape"]
    assert profile_needs(engine1) == (1, False)
    # The stack on two model threads is predicted from the one-thread profile and its
    # measured speedup, as lamina up ranks it.
    threads = [c for c in OUT_OF_SAMPLE if c.family.startswith("stack colocated threads")]
    assert {c.threads for c in threads} == {1, 2} and profile_needs(threads) == (1, True)


def test_a_family_is_predicted_from_the_fastest_profile_of_its_kind_so_far():
    from planner_validation import predicting_profile

    def prof(gb_s: float) -> dict:
        return {"measurements": {"linear": {"1": {"weight_bytes_s": gb_s * 1e9}}}}

    earlier = [("the in-sample cases", prof(14.0)), ("engine, 360M shape", prof(12.4))]
    assert predicting_profile(earlier)[0] == "the in-sample cases"  # its own came in a slow stretch
    assert predicting_profile(earlier, latest=True)[0] == "engine, 360M shape"
    earlier.append(("engine, 1.7B shape", prof(16.1)))
    assert predicting_profile(earlier)[0] == "engine, 1.7B shape"


def test_gpu_rows_are_compared_with_the_planner_on_a_device_profile(tmp_path, capsys):
    """--gpu: each engine row of bench/gpu_decode.py's --out against the planner's decode
    step on the device profile (here the catalogue's H200 entry standing in for one that
    lamina profile --device cuda measured); skipped points are left out; of a point's rows
    (one after each contender) the last counts, with the steps it names."""
    import json
    from importlib import resources

    import yaml
    from planner_validation import gpu_validation

    from lamina.model.random_models import SHAPES
    from lamina.planner.estimate import decode_step
    from lamina.planner.hardware import THIS_MACHINE, device_from_entry
    from lamina.planner.layouts import Layout
    from lamina.planner.perf.quantization import FP16
    from lamina.planner.shapes import ModelShape

    catalogue = yaml.safe_load(resources.files("lamina.planner").joinpath("catalogue.yaml").read_text())
    # cuda_ipc's round trips of CUDA tensors: 40 us at 64 B, 400 Gbit/s at 1 MiB.
    transports = {"tcp": {"rtt_us_64B": 30.0, "gbit_s_1MiB": 20.0},
                  "cuda_ipc_device": {"rtt_us_64B": 40.0, "gbit_s_1MiB": 400.0}}
    (tmp_path / "profile.json").write_text(json.dumps({"device": catalogue["H200"],
                                                       "measurements": {"transports": transports}}))
    rows = [{"point": "llama-3.2-1b/bfloat16/b64/c2048", "engine_tok_s": 5000.0, "steps": 16,
             "stack_colocated_tok_s": 4600.0, "stack_mb2_aw1_tok_s": 3000.0, "stack_mb1_aw1_tok_s": 2500.0,
             "stack_mb1_aw2_error": "RuntimeError"},
            {"point": "smollm2/float32/b1/c512", "engine_tok_s": 900.0},
            {"point": "llama-3.1-8b/bfloat16/b256/c8192", "skipped": "does not fit"}]
    earlier = {"point": rows[0]["point"], "engine_tok_s": 1.0, "steps": 16}  # that point's first row
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [earlier, *rows]))
    out = gpu_validation(tmp_path / "rows.jsonl", tmp_path / "profile.json", steps=32)
    assert [(r["point"], r["contender"]) for r in out] == [
        (rows[0]["point"], "engine"), (rows[0]["point"], "stack colocated"), (rows[0]["point"], "stack mb1 aw1"),
        (rows[0]["point"], "stack mb2 aw1"), (rows[1]["point"], "engine")]
    device = {THIS_MACHINE: device_from_entry(THIS_MACHINE, catalogue["H200"])}
    shape = ModelShape.of(SHAPES["llama-3.2-1b"], "llama-3.2-1b")
    step = decode_step(shape, Layout(THIS_MACHINE, 1, weights=FP16, kv=FP16), device, 64, 2048 + 1 + 16 / 2)
    assert abs(out[0]["predicted_tok_s"] - 64 / step.step_s) < 1e-6
    assert abs(out[0]["rel_error"] - (64 / step.step_s - 5000) / 5000) < 1e-9
    # The colocated stack is predicted as the engine is.
    assert out[1]["predicted_tok_s"] == out[0]["predicted_tok_s"] and out[1]["measured_tok_s"] == 4600.0
    assert out[4]["measured_tok_s"] == 900.0 and out[4]["predicted_tok_s"] > 0
    # The stack: one device for every worker, its link cuda_ipc's (20 us and 25 GB/s one way).
    gpu = replace(device[THIS_MACHINE], network_bw=400 / 2 * 1e9 / 8, network_latency=20e-6)
    for row, micro in ((out[2], 1), (out[3], 2)):
        layout = Layout(THIS_MACHINE, 1, 1, THIS_MACHINE, 1, micro, "request", FP16, FP16, shared_device=True)
        stack = decode_step(shape, layout, {THIS_MACHINE: gpu}, 64, 2048 + 1 + 16 / 2)
        assert abs(row["predicted_tok_s"] - 64 / stack.step_s) < 1e-6, row
        assert row["predicted_tok_s"] < out[0]["predicted_tok_s"]  # never faster than the engine on one device
    assert out[3]["bottleneck"] == "shared device"
    printed = capsys.readouterr().out
    assert "engine: 2 points, median error" in printed and "stack: 3 points, median error" in printed
    assert json.loads(printed.splitlines()[-1])["gpu"] == out


def test_gpu_stack_rows_need_a_profile_with_cuda_ipc(tmp_path, capsys):
    """A device profile without cuda_ipc's round trips predicts the engine (and a colocated
    stack, which has no link) only, and says why the disaggregated stack rows are left out."""
    import json
    from importlib import resources

    import yaml
    from planner_validation import gpu_validation

    catalogue = yaml.safe_load(resources.files("lamina.planner").joinpath("catalogue.yaml").read_text())
    (tmp_path / "profile.json").write_text(json.dumps({"device": catalogue["H200"]}))
    row = {"point": "llama-3.2-1b/bfloat16/b64/c2048", "engine_tok_s": 5000.0, "stack_mb2_aw1_tok_s": 3000.0}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    out = gpu_validation(tmp_path / "rows.jsonl", tmp_path / "profile.json", steps=32)
    assert [r["contender"] for r in out] == ["engine"]
    assert "stack rows left out: the profile measured no cuda_ipc round trip" in capsys.readouterr().out
