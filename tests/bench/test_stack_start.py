"""bench/stack_start.py end to end at its smallest: one stack with forked services and one
with fresh interpreters, each started, its attention worker restarted, and stopped."""

import json

import pytest

# bench/stack_start.py (bench/ is on the tests' path: pyproject.toml)
from stack_start import VARIANTS, main

pytestmark = pytest.mark.timeout(600)


def test_the_bench_starts_and_restarts_both_ways(capsys):
    report = main(["--tries", "1"])
    out = capsys.readouterr().out.splitlines()
    assert json.loads(out[-1]) == json.loads(json.dumps(report))
    assert set(report["median"]) == set(VARIANTS) == {"forked", "fresh"}
    for row in report["median"].values():
        assert row["start_s"] > 0 and row["cpu_s"] > 0 and row["restart_s"] > 0 and row["pss_mib"] > 100
    assert set(report["forked_over_fresh"]) == {"start_s", "cpu_s", "pss_mib", "restart_s"}
    assert [line.split()[2].rstrip(":") for line in out if line.startswith("  try")] == ["forked", "fresh"]
