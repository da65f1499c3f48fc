"""bench/load_generator.py: reading guidellm's JSON report and aiperf's JSON export, finding
each tool, the commands they get, the side-by-side figures, and the skips where a tool is
missing. The timed run itself takes minutes and is run by the benchmark, not here.

data/guidellm-0.8.1-report.json is the report of a real `guidellm run` (0.8.1, profile
concurrent with 8 streams, 16 requests of 128 prompt and 32 output tokens) against
`lamina up` on this 2-core host under load, with its per-request records removed (the
script reads only the aggregates). Its console summary read: 0.2 requests/s, 5.0 output
tokens/s, TTFT median 21651.2 ms, ITL median 790.8 ms, 102.4 s.

data/aiperf-0.13.0-export.json is the profile_export_aiperf.json of a real run of this
script's `aiperf profile` (0.13.0, concurrency 4, 16 requests of 128 prompt and 32 output
tokens) against `lamina up` on this host, without its input_config and run_info (paths
of that machine). Its figures: 33.38 output tokens/s, 1.043 requests/s, TTFT p50 1007.5
ms, ITL p50 74.1 ms, 15.33 s.
"""

import argparse
import copy
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from aiperf_client import aiperf_argv, aiperf_env, find_aiperf, parse_aiperf_export
from load_generator import (  # bench/load_generator.py (bench/ is on the tests' path: pyproject.toml)
    Figures,
    Workload,
    find_guidellm,
    find_tools,
    guidellm_argv,
    parse_guidellm_report,
    ratios,
    side_by_side,
)

BENCH = Path(__file__).resolve().parents[2] / "bench"

SAMPLE = Path(__file__).parent / "data" / "guidellm-0.8.1-report.json"
AIPERF_SAMPLE = Path(__file__).parent / "data" / "aiperf-0.13.0-export.json"


@pytest.fixture
def report() -> dict:
    return json.loads(SAMPLE.read_text())


@pytest.fixture
def export() -> dict:
    return json.loads(AIPERF_SAMPLE.read_text())


def _executable(path: Path, prints: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho '{prints}'\n")
    path.chmod(0o755)
    return path


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


def test_side_by_side_gives_each_figure_and_each_tools_ratio():
    a = Figures(10.0, 0.5, 2.0, 4.0, 0.1, 0.2, 0.15, requests=8, output_tokens=256, seconds=25.6, client_cpu_s=2.0)
    b = Figures(9.0, 0.45, 3.0, 4.0, 0.12, 0.1, 0.15, requests=8, output_tokens=256, seconds=28.4, client_cpu_s=5.0)
    c = Figures(12.0, 0.6, 1.0, 2.0, 0.05, 0.1, 0.1, requests=8, output_tokens=256, seconds=21.3, client_cpu_s=20.0)
    r = ratios(a, b)
    assert r == pytest.approx({"output_tok_s": 0.9, "requests_s": 0.9, "ttft_p50": 1.5, "ttft_p99": 1.0,
                               "itl_p50": 1.2, "itl_p99": 0.5, "itl_mean": 1.0, "client_cpu_s": 2.5})
    lines = side_by_side(a, {"guidellm": b}).splitlines()
    assert lines[0].split() == ["serving.py", "guidellm", "guidellm/serving"]
    assert lines[1].split() == ["output", "tokens/s", "10.00", "9.00", "0.90"]
    assert lines[5].split() == ["inter-token", "p50", "(ms)", "100", "120", "1.20"]
    assert lines[8].split() == ["client", "CPU", "(s)", "2.0", "5.0", "2.50"]
    both = side_by_side(a, {"guidellm": b, "aiperf": c}).splitlines()
    assert both[0].split() == ["serving.py", "guidellm", "guidellm/serving", "aiperf", "aiperf/serving"]
    assert both[1].split() == ["output", "tokens/s", "10.00", "9.00", "0.90", "12.00", "1.20"]


def test_without_either_tool_the_run_is_skipped_naming_each(tmp_path):
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, str(BENCH / "load_generator.py"), "--guidellm", str(tmp_path / "none")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    first, last = out.stdout.splitlines()[0], out.stdout.splitlines()[-1]
    assert first.startswith("skipped: guidellm is not installed")
    assert "aiperf is not installed (looked at --aiperf, $AIPERF and PATH)" in first
    assert "guidellm is not installed" in json.loads(last)["skipped"]
    only = subprocess.run([sys.executable, str(BENCH / "load_generator.py"), "--tools", "aiperf"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert only.returncode == 0, only.stderr
    assert only.stdout.splitlines()[0] == (
        "skipped: aiperf is not installed (looked at --aiperf, $AIPERF and PATH); install it in its own virtualenv "
        "(pip install torch==2.13.0 'aiperf==0.13.*') and pass --aiperf")


def test_a_missing_tool_is_skipped_and_the_other_runs(tmp_path, monkeypatch):
    aiperf = _executable(tmp_path / "bin" / "aiperf", "0.13.0")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("GUIDELLM", raising=False)
    monkeypatch.delenv("AIPERF", raising=False)
    args = argparse.Namespace(tools="guidellm,aiperf", guidellm=None, aiperf=str(aiperf), guidellm_workers=1,
                              aiperf_workers=2)
    found, skipped = find_tools(args)
    assert [(t.name, t.binary, t.version, t.workers) for t in found] == [("aiperf", aiperf, "0.13.0", 2)]
    assert list(skipped) == ["guidellm"] and skipped["guidellm"].startswith("guidellm is not installed")
    w = Workload(requests=4, prompt_tokens=16, output_tokens=2, concurrency=2)
    argv = found[0].argv("http://127.0.0.1:9", "m", tmp_path / "tok", w, tmp_path)
    assert argv[:2] == [str(aiperf), "profile"] and found[0].result(tmp_path).parent == tmp_path / "aiperf"


# -- aiperf -----------------------------------------------------------------------------------
def test_the_recorded_aiperf_export_parses_into_its_figures(export):
    f = parse_aiperf_export(export)
    assert (f.requests, f.errored, f.output_tokens) == (16, 0, 16 * 32)
    assert f.seconds == pytest.approx(15.3325, abs=1e-3)
    assert f.output_tok_s == pytest.approx(f.output_tokens / f.seconds, rel=1e-3)
    assert f.requests_s == pytest.approx(f.requests / f.seconds, rel=1e-3)
    # Latencies: aiperf's milliseconds as seconds.
    assert (f.ttft_p50, f.ttft_p99) == (pytest.approx(1.00746, abs=1e-5), pytest.approx(2.67209, abs=1e-5))
    assert (f.itl_p50, f.itl_p99) == (pytest.approx(0.074087, abs=1e-6), pytest.approx(0.106810, abs=1e-6))
    assert f.itl_mean == pytest.approx(0.074886, abs=1e-6) and f.client_cpu_s == 0.0  # measured by the script
    # Its token counts are the server's usage: exactly the workload's.
    assert export["usage_prompt_tokens"]["avg"] == 128 and export["usage_completion_tokens"]["avg"] == 32


def test_an_aiperf_export_of_another_schema_or_a_cancelled_run_is_refused(export):
    other = copy.deepcopy(export)
    other["schema_version"] = "2.0"
    with pytest.raises(ValueError, match=r"schema version '2\.0'"):
        parse_aiperf_export(other)
    cancelled = copy.deepcopy(export)
    cancelled["was_cancelled"] = True
    with pytest.raises(ValueError, match="cancelled"):
        parse_aiperf_export(cancelled)
    seconds = copy.deepcopy(export)
    seconds["time_to_first_token"]["unit"] = "minutes"
    with pytest.raises(ValueError, match="unit 'minutes'"):
        parse_aiperf_export(seconds)


def test_the_aiperf_command_carries_the_workload_offline(tmp_path, monkeypatch):
    w = Workload(requests=32, prompt_tokens=128, output_tokens=32, concurrency=8)
    argv = aiperf_argv(Path("/x/aiperf"), "http://127.0.0.1:9", "m", tmp_path / "tok", w, tmp_path / "a", 1)
    assert argv[:2] == ["/x/aiperf", "profile"] and "--streaming" in argv and "--use-server-token-count" in argv
    assert "--use-legacy-max-tokens" in argv  # the completions API's field is max_tokens
    opts = {}
    for flag, value in itertools.pairwise(argv[2:]):
        if flag.startswith("--") and not value.startswith("--"):
            opts.setdefault(flag, []).append(value)
    assert opts["--url"] == ["http://127.0.0.1:9"] and opts["--model"] == ["m"]
    assert opts["--endpoint-type"] == ["completions"] and opts["--tokenizer"] == [str(tmp_path / "tok")]
    assert (opts["--isl"], opts["--isl-stddev"], opts["--osl"], opts["--osl-stddev"]) == (["128"], ["0"], ["32"], ["0"])
    assert opts["--extra-inputs"] == ["ignore_eos:true", "temperature:0"]
    assert (opts["--concurrency"], opts["--request-count"], opts["--num-dataset-entries"]) == (["8"], ["32"], ["32"])
    assert opts["--artifact-dir"] == [str(tmp_path / "a")] and opts["--ui-type"] == ["none"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = aiperf_env()
    assert "HF_HUB_OFFLINE" not in env and "TRANSFORMERS_OFFLINE" not in env  # aiperf 0.13 then misreads a path
    assert env["HF_ENDPOINT"].startswith("http://127.0.0.1:")  # nothing reaches a model hub


def test_aiperf_is_found_where_it_is_asked_for_then_on_path(tmp_path, monkeypatch):
    exe = _executable(tmp_path / "bin" / "aiperf", "0.13.0")
    monkeypatch.delenv("AIPERF", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_aiperf(None) is None
    assert find_aiperf(str(tmp_path / "missing")) is None
    assert find_aiperf(str(exe)) == exe
    monkeypatch.setenv("AIPERF", str(exe))
    assert find_aiperf(None) == exe
    monkeypatch.delenv("AIPERF")
    monkeypatch.setenv("PATH", str(exe.parent))
    assert find_aiperf(None) == exe
