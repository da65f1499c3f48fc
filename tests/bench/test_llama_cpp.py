"""bench/llama_cpp.py: where llama-server is found, what a build needs, and its version line;
bench/cpu_anchor.py's prompts. The build itself downloads a source package and compiles
for minutes, so it is run by the benchmark, not here."""

from pathlib import Path

import pytest

# bench/llama_cpp.py (bench/ is on the tests' path: pyproject.toml)
from llama_cpp import LlamaServerUnavailable, build_llama_server, cache_dir, find_llama_server, server_version


def _executable(path: Path, body: str = "exit 0") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    """No LLAMA_SERVER, an empty PATH of our own, the cache under tmp_path."""
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    monkeypatch.setenv("LAMINA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_cache_dir_follows_the_environment(clean_env, monkeypatch):
    assert cache_dir("1.2") == clean_env / "cache" / "llama.cpp" / "1.2"
    monkeypatch.delenv("LAMINA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(clean_env / "xdg"))
    assert cache_dir("1.2") == clean_env / "xdg" / "lamina" / "llama.cpp" / "1.2"


def test_found_in_order_env_then_path_then_cache(clean_env, monkeypatch):
    assert find_llama_server() is None
    cached = _executable(cache_dir() / "bin" / "llama-server")
    assert find_llama_server() == cached
    on_path = _executable(clean_env / "path" / "llama-server")
    assert find_llama_server() == on_path
    chosen = _executable(clean_env / "mine" / "llama-server")
    monkeypatch.setenv("LLAMA_SERVER", str(chosen))
    assert find_llama_server() == chosen


def test_a_named_server_that_cannot_run_is_refused(clean_env, monkeypatch):
    not_executable = clean_env / "llama-server"
    not_executable.write_text("")
    monkeypatch.setenv("LLAMA_SERVER", str(not_executable))
    with pytest.raises(LlamaServerUnavailable, match="is not an executable"):
        find_llama_server()


def test_a_build_without_its_tools_says_which_are_missing(clean_env):
    with pytest.raises(LlamaServerUnavailable, match="cmake, c\\+\\+ not found"):
        build_llama_server()
    assert not cache_dir().exists()  # nothing half-made


def test_version_line_is_read_from_the_binary(clean_env):
    server = _executable(clean_env / "llama-server", 'echo "load_backend: cpu" >&2; echo "version: 42 (abc)" >&2')
    assert server_version(server) == "version: 42 (abc)"
    silent = _executable(clean_env / "silent")
    assert server_version(silent) == "unknown"
    assert server_version(clean_env / "absent").startswith("unknown (")


def test_anchor_prompts_are_distinct_and_of_the_asked_length():
    from cpu_anchor import make_prompts

    class Words:  # a tokenizer of one id per character: lengths are easy to see
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    prompts = make_prompts(Words(), 30, 15)
    assert len(prompts) == 30 and all(len(p) == 15 for p in prompts)
    long = make_prompts(Words(), 3, 200)  # extended past the text
    assert all(len(p) == 200 for p in long)
    assert len({tuple(p) for p in make_prompts(Words(), 12, 40)}) == 12


def test_anchor_rounds_alternate_and_ratios_pair_passes_of_the_same_round():
    from cpu_anchor import Contender, paired_ratio, round_order, target_units, unit_order

    # Every system once a round, a different one first each round.
    orders = [round_order(3, r) for r in range(3)]
    assert all(sorted(o) == [0, 1, 2] for o in orders)
    assert [o[0] for o in orders] == [0, 1, 2]

    def contender(*tok_s: float) -> Contender:
        return Contender("x", "lamina_up", lambda: {}, passes=[{"tok_s": t} for t in tok_s])

    # The target's pair (lamina up, the engine on 2 threads, same weights) back to back in
    # every round, each first in turn; the other contenders rotate around it.
    def labelled(system: str, **labels) -> Contender:
        return Contender(system, system, lambda: {}, labels)

    contenders = [labelled("llama_cpp"), labelled("lamina_up", weights="as_file"),
                  labelled("local_engine", weights="as_file", threads=1),
                  labelled("local_engine", weights="as_file", threads=2),
                  labelled("local_engine", weights="float32", threads=2)]
    units = target_units(contenders, "as_file")
    assert units == [(0,), (1, 3), (2,), (4,)]
    orders = [unit_order(units, r) for r in range(4)]
    assert all(sorted(o) == [0, 1, 2, 3, 4] for o in orders)
    for r, o in enumerate(orders):
        up, engine = o.index(1), o.index(3)
        assert abs(up - engine) == 1 and (up < engine) == (r % 2 == 0)
    assert [o[0] for o in orders] == [0, 3, 2, 4]  # a different unit first each round
    assert target_units(contenders[:3], "as_file") == [(0,), (1,), (2,)]  # no 2-thread engine: no pair

    # The machine slowed by half in round 2: pairing by round keeps the ratio at 2, where a
    # ratio of the medians (200 / 50) would say 4.
    fast, slow = contender(200.0, 100.0, 200.0), contender(100.0, 50.0, 25.0)
    assert fast.tok_s == 200.0 and slow.tok_s == 50.0
    assert paired_ratio(fast, slow) == 2.0
    with pytest.raises(ValueError):  # passes of different rounds are never paired
        paired_ratio(fast, contender(1.0))
