"""bench/prefill_chunks.py end to end at its smallest: both variants measured, in
alternating order, the JSON line complete."""

import json

# bench/prefill_chunks.py (bench/ is on the tests' path: pyproject.toml)
from prefill_chunks import VARIANTS, main


def test_the_bench_times_the_short_prompt_behind_the_long_one_both_ways(capsys):
    assert main(["--long", "96", "--short", "8", "--chunk", "32", "--tries", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    report = json.loads(out[-1])
    assert (report["long"], report["short"], report["chunk"]) == (96, 8, 32)
    for v in VARIANTS:
        rows = report["tries"][v]
        assert len(rows) == 2 and all(r["short_s"] > 0 and r["long_s"] > 0 for r in rows)
        assert report["alone_s"][v] > 0
    assert report["chunked_over_whole"]["short_s"] > 0
    order = [line.split()[0] for line in out if line.startswith("  ") and "first token" in line]
    assert order == ["whole", "chunked", "chunked", "whole"]
