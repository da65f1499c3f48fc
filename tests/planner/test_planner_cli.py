"""`lamina plan` end to end, through lamina.cli.main, on the real trace."""

import json
import re

import pytest

from lamina.cli import main


@pytest.fixture
def trace_path(request):
    from pathlib import Path

    path = Path(request.config.rootpath).parent / "shared" / "traces" / "azure_conv_2023.csv"
    if not path.is_file():
        pytest.skip(f"{path} is not here")
    return str(path)


def test_plan_json_on_the_azure_trace(trace_path, capsys):
    rc = main(["plan", "--model", "llama-3-70b", "--hardware", "H100,H20", "--trace", trace_path,
               "--json", "--simulate", "--simulate-top", "1", "--simulate-requests", "300"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["requests"] == 19366
    configs = out["configurations"]
    assert len(configs) == 10
    for c in configs:
        assert {"layout", "throughput_tok_s", "tbt_ms", "ttft_ms", "usd_per_mtok", "bottleneck"} <= set(c)
        assert set(c["devices"]) <= {"H100", "H20"}
    assert [c["usd_per_mtok"] for c in configs if c["meets_targets"]] == sorted(
        c["usd_per_mtok"] for c in configs if c["meets_targets"])
    assert configs[0]["simulated"]["completed"] == 300
    assert configs[0]["simulated"]["shortfalls_p90"] == []  # no targets given


def test_plan_table_with_targets_and_counts(trace_path, capsys):
    rc = main(["plan", "--model", "Llama-3-70B", "--hardware", "H100:8,H20:16", "--trace", trace_path,
               "--tbt-ms", "50", "--ttft-ms", "2000", "--budget", "60", "--top", "3"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "layout" in out and "bottleneck" in out
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+ (colocated|disagg)", line)]
    assert len(rows) == 3


def test_plan_from_lengths_and_rate(capsys):
    rc = main(["plan", "--model", "smollm2-135m", "--hardware", "CPU", "--prompt-tokens", "200",
               "--output-tokens", "50", "--rate", "2", "--json", "--quantize", "none"])
    assert rc == 0
    configs = json.loads(capsys.readouterr().out)["configurations"]
    assert configs and all(c["weights"] == "fp16" for c in configs)
    assert any(c["threads"] for c in configs)  # CPU attention gets a thread choice


def test_plan_refuses_a_bad_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    assert main(["plan", "--model", str(tmp_path), "--hardware", "H100", "--prompt-tokens", "1",
                 "--output-tokens", "1", "--rate", "1"]) == 2
    assert "unsupported architecture" in capsys.readouterr().err


def test_plan_with_a_budget_and_no_hardware_picks_from_the_catalogue(capsys):
    rc = main(["plan", "--model", "llama-2-7b", "--budget", "5", "--prompt-tokens", "500", "--output-tokens", "100",
               "--rate", "1", "--json", "--quantize", "none", "--colocated-only"])
    assert rc == 0
    configs = json.loads(capsys.readouterr().out)["configurations"]
    assert {c["model_device"] for c in configs} <= {"H100", "H200", "H20", "A100", "L40S", "CPU"}
    assert all(c["usd_per_hour"] <= 5 for c in configs)


@pytest.mark.parametrize("argv", [
    ["--hardware", "TPU", "--prompt-tokens", "1", "--output-tokens", "1", "--rate", "1"],
    ["--hardware", "H100"],  # no workload
])
def test_plan_refuses_bad_input(argv, capsys):
    assert main(["plan", "--model", "llama-2-7b", *argv]) == 2
    assert "lamina plan:" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "text", "said"), [
    ("other.csv", "a,b\n1,2\n", "line 2: not an Azure CSV trace (TIMESTAMP,ContextTokens,GeneratedTokens): "
                                "no field 'TIMESTAMP'"),
    ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12,x\n",
     "line 2: not an Azure CSV trace"),
    ("short.csv", "ContextTokens,GeneratedTokens,TIMESTAMP\n3,4,2023-11-16 18:15:46.68\n\n5,6\n",
     "line 4: not an Azure CSV trace (TIMESTAMP,ContextTokens,GeneratedTokens): no field 'TIMESTAMP'"),
    ("other.jsonl", '{"timestamp": 1, "input_length": 3, "output_length": 4}\n{"x": 1}\n',
     "line 2: not a Kimi JSONL trace (timestamp, input_length, output_length): no field 'timestamp'"),
    ("text.jsonl", "not json\n", "line 1: not a Kimi JSONL trace"),
])
def test_plan_names_the_line_of_a_trace_it_cannot_read(tmp_path, capsys, name, text, said):
    path = tmp_path / name
    path.write_text(text)
    assert main(["plan", "--model", "llama-2-7b", "--hardware", "H100", "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lamina plan: {path}: {said}") and err.count("\n") == 1  # one line, no traceback
