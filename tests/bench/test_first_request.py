"""bench/first_request.py end to end at its smallest: `lamina up` started with and without
the warm-up, each timed and stopped, the JSON line complete."""

import json

import pytest
import torch

# bench/first_request.py (bench/ is on the tests' path: pyproject.toml)
from first_request import main, variants_for

pytestmark = pytest.mark.timeout(600)


def test_the_bench_starts_the_stack_both_ways_and_times_its_first_requests(capsys):
    """On the CPU: warm and cold (no CUDA graphs, so no `lazy`), each request's first token
    and longest wait between chunks, and a burst of 2 at once."""
    assert variants_for("cpu") == ["warm", "cold"] and variants_for("cuda") == ["warm", "lazy", "cold"]
    report = main(["--tries", "1", "--requests", "2", "--layouts", "colocated", "--burst", "2"])
    out = capsys.readouterr().out.splitlines()
    assert json.loads(out[-1]) == json.loads(json.dumps(report))
    assert report["device"] == "cpu" and report["burst"] == 2
    layout = report["layouts"]["colocated"]
    for v in ("warm", "cold"):
        (row,) = layout["tries"][v]
        assert row["start_s"] > 0 and row["first_ms"] > 0 and row["later_ms"] > 0
        # 8 output tokens a request: gaps between their chunks, each shorter than the request
        assert row["first_gap_ms"] > 0 and row["later_gap_ms"] > 0 and 0 < row["burst_gap_ms"] < 60_000
    assert layout["first_warm_over_cold"] > 0 and "gap_warm_over_lazy" not in layout
    order = [line.split()[3].rstrip(":") for line in out if line.startswith("  colocated")]
    assert order == ["warm", "cold"]


def test_a_gpu_run_without_a_gpu_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without one
    with pytest.raises(SystemExit) as exited:
        main(["--device", "cuda"])
    assert exited.value.code == 2
    assert "--device cuda: torch finds no CUDA device here" in capsys.readouterr().err
