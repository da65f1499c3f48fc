"""bench/prefill_forward.py end to end at its smallest: both variants measured on every
length, in alternating order, the JSON line complete."""

import json

# bench/prefill_forward.py (bench/ is on the tests' path: pyproject.toml)
from prefill_forward import VARIANTS, main


def test_the_bench_measures_both_variants_on_every_length(capsys):
    assert main(["--lengths", "8,24", "--tries", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    report = json.loads(out[-1])
    assert report["lengths"] == [8, 24] and report["threads"] == 1
    for n in ("8", "24"):
        for v in VARIANTS:
            rows = report["tries"][n][v]
            assert len(rows) == 2 and all(r["seconds"] > 0 and r["stall_s"] >= 0 for r in rows)
        assert report["summary"][n]["thread_over_loop_seconds"] > 0
    order = [line.split()[2] for line in out if line.startswith("  ") and "tokens" in line]
    assert order[:4] == ["loop", "thread", "thread", "loop"]
