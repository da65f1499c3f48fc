"""bench/thread_speedup.py end to end at its smallest: each variant measured, its busy
loop stopped, the JSON line complete."""

import json
import os
from pathlib import Path

import pytest

# bench/thread_speedup.py (bench/ is on the tests' path: pyproject.toml)
from thread_speedup import main


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable cores (this process has fewer)")
def test_the_bench_compares_its_variants_and_stops_its_busy_loop(capsys):
    before = set(os.listdir("/proc"))
    assert main(["--tries", "1", "--busy", "0.3", "--layers", "1", "--repeats", "1"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(report["summary"]) == {"three rounds", "settled", "settled, idle"}
    assert report["tries"]["three rounds"][0]["rounds"] == 3 and report["settled_over_three_rounds"] > 0
    assert all(3 <= row["rounds"] <= 12 for rows in report["tries"].values() for row in rows)
    # No process it started outlives it (the busy loop is killed, not left spinning).
    left = [_cmdline(Path(f"/proc/{p}/cmdline")) for p in set(os.listdir("/proc")) - before if p.isdigit()]
    assert not [c for c in left if b"sched_setaffinity" in c]


def _cmdline(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # a process that ended meanwhile
        return b""
