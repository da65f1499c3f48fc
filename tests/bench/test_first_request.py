"""bench/first_request.py end to end at its smallest: `lamina up` started with and without
the warm-up, each timed and stopped, the JSON line complete."""

import json

import pytest

# bench/first_request.py (bench/ is on the tests' path: pyproject.toml)
from first_request import VARIANTS, main

pytestmark = pytest.mark.timeout(600)


def test_the_bench_starts_the_stack_both_ways_and_times_its_first_requests(capsys):
    report = main(["--tries", "1", "--requests", "2", "--layouts", "colocated"])
    out = capsys.readouterr().out.splitlines()
    assert json.loads(out[-1]) == json.loads(json.dumps(report))
    layout = report["layouts"]["colocated"]
    for v in VARIANTS:
        (row,) = layout["tries"][v]
        assert row["start_s"] > 0 and row["first_ms"] > 0 and row["later_ms"] > 0
    assert layout["first_warm_over_cold"] > 0
    order = [line.split()[3].rstrip(":") for line in out if line.startswith("  colocated")]
    assert order == ["warm", "cold"]
