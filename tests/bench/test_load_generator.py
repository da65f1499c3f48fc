"""bench/load_generator.py: reading guidellm's JSON report, finding guidellm, the side-by-side
figures, and the skip where guidellm is missing. The timed run itself takes minutes and
is run by the benchmark, not here.

data/guidellm-0.8.1-report.json is the report of a real `guidellm run` (0.8.1, profile
concurrent with 8 streams, 16 requests of 128 prompt and 32 output tokens) against
`lamina up` on this 2-core host under load, with its per-request records removed (the
script reads only the aggregates). Its console summary read: 0.2 requests/s, 5.0 output
tokens/s, TTFT median 21651.2 ms, ITL median 790.8 ms, 102.4 s.
"""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
from load_generator import (  # bench/load_generator.py (bench/ is on the tests' path: pyproject.toml)
    Figures,
    Workload,
    find_guidellm,
    guidellm_argv,
    parse_guidellm_report,
    ratios,
    side_by_side,
)

BENCH = Path(__file__).resolve().parents[2] / "bench"

SAMPLE = Path(__file__).parent / "data" / "guidellm-0.8.1-report.json"


@pytest.fixture
def report() -> dict:
    return json.loads(SAMPLE.read_text())


def test_the_recorded_report_parses_into_its_console_figures(report):
    f = parse_guidellm_report(report)
    assert (f.requests, f.errored, f.output_tokens) == (16, 0, 16 * 32)
    assert f.seconds == pytest.approx(102.4386, abs=1e-3)
    # Rates: the totals over the measured window, as the console's "Per Sec Mean" shows them.
    assert f.output_tok_s == pytest.approx(f.output_tokens / f.seconds, rel=1e-3)
    assert f.requests_s == pytest.approx(f.requests / f.seconds, rel=1e-3)
    assert (f.output_tok_s, f.requests_s) == (pytest.approx(4.998, abs=1e-3), pytest.approx(0.1562, abs=1e-4))
    # Latencies: guidellm's milliseconds as seconds.
    assert (f.ttft_p50, f.ttft_p99) == (pytest.approx(21.6512, abs=1e-4), pytest.approx(35.1632, abs=1e-4))
    assert (f.itl_p50, f.itl_p99) == (pytest.approx(0.7908, abs=1e-4), pytest.approx(0.9341, abs=1e-4))
    assert f.itl_mean == pytest.approx(0.8278, abs=1e-4) and f.client_cpu_s == 0.0  # measured by the script


def test_a_report_of_another_format_or_with_several_benchmarks_is_refused(report):
    other = copy.deepcopy(report)
    other["metadata"]["version"] = 3
    with pytest.raises(ValueError, match="format version 3"):
        parse_guidellm_report(other)
    two = copy.deepcopy(report)
    two["benchmarks"] *= 2
    with pytest.raises(ValueError, match="found 2"):
        parse_guidellm_report(two)


def test_the_guidellm_command_carries_the_workload(tmp_path):
    w = Workload(requests=32, prompt_tokens=128, output_tokens=32, concurrency=8)
    argv = guidellm_argv(Path("/x/guidellm"), "http://127.0.0.1:9", "m", tmp_path / "tok", w, tmp_path / "r.json")
    opts = dict(zip(argv[2::2], argv[3::2]))
    assert argv[:2] == ["/x/guidellm", "run"] and argv[-1] == "--disable-console-interactive"
    assert opts["--backend"] == "kind=openai_http,target=http://127.0.0.1:9,model=m,request_format=/v1/completions"
    assert opts["--tokenizer"] == f"kind=huggingface_auto,model={tmp_path / 'tok'}"
    assert opts["--data"] == "kind=synthetic_text,prompt_tokens=128,output_tokens=32"
    assert opts["--profile"] == "kind=concurrent,streams=8"
    assert opts["--constraint"] == "kind=max_requests,count=32"
    assert opts["--output"] == f"kind=json,path={tmp_path / 'r.json'}"


def test_guidellm_is_found_where_it_is_asked_for_then_on_path(tmp_path, monkeypatch):
    exe = tmp_path / "bin" / "guidellm"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.delenv("GUIDELLM", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_guidellm(None) is None
    assert find_guidellm(str(tmp_path / "missing")) is None
    assert find_guidellm(str(exe)) == exe
    monkeypatch.setenv("GUIDELLM", str(exe))
    assert find_guidellm(None) == exe
    monkeypatch.delenv("GUIDELLM")
    monkeypatch.setenv("PATH", str(exe.parent))
    assert find_guidellm(None) == exe


def test_side_by_side_gives_each_figure_and_the_ratio():
    a = Figures(10.0, 0.5, 2.0, 4.0, 0.1, 0.2, 0.15, requests=8, output_tokens=256, seconds=25.6, client_cpu_s=2.0)
    b = Figures(9.0, 0.45, 3.0, 4.0, 0.12, 0.1, 0.15, requests=8, output_tokens=256, seconds=28.4, client_cpu_s=5.0)
    r = ratios(a, b)
    assert r == pytest.approx({"output_tok_s": 0.9, "requests_s": 0.9, "ttft_p50": 1.5, "ttft_p99": 1.0,
                               "itl_p50": 1.2, "itl_p99": 0.5, "itl_mean": 1.0, "client_cpu_s": 2.5})
    lines = side_by_side(a, b).splitlines()
    assert lines[1].split() == ["output", "tokens/s", "10.00", "9.00", "0.90"]
    assert lines[5].split() == ["inter-token", "p50", "(ms)", "100", "120", "1.20"]
    assert lines[8].split() == ["client", "CPU", "(s)", "2.0", "5.0", "2.50"]


def test_without_guidellm_the_run_is_skipped_with_the_reason(tmp_path):
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, str(BENCH / "load_generator.py"), "--guidellm", str(tmp_path / "none")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    first, last = out.stdout.splitlines()[0], out.stdout.splitlines()[-1]
    assert first.startswith("skipped: guidellm is not installed")
    assert "guidellm is not installed" in json.loads(last)["skipped"]
