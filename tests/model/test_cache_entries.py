"""The model cache's entries and `lamina cache` (lamina.model.cache_entries): which entries
a prune removes, read from a real cache (a tiny GGUF file converted into it), and the
command run as a user runs it, outside the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from test_loader import write_tiny_gguf

from lamina.model.cache_entries import CURRENT, INCOMPLETE, OLD_FORMAT, PARTIAL_GRACE_S, CacheEntry, scan, to_remove
from lamina.model.checkpoints import CACHE_MARKER, resolve_checkpoint

DAY = 86400.0


def _entry(name: str, state: str, last_used: float) -> CacheEntry:
    return CacheEntry(Path(name), "gguf" if state != INCOMPLETE else "?", "", state, 10, last_used)


def test_a_prune_removes_old_formats_and_dead_conversions_and_with_options_more():
    now = 100 * DAY
    entries = [_entry("current", CURRENT, now - 30 * DAY), _entry("recent", CURRENT, now - DAY),
               _entry("old", OLD_FORMAT, now), _entry("dead", INCOMPLETE, now - PARTIAL_GRACE_S),
               _entry("converting", INCOMPLETE, now - 60)]
    names = lambda **kw: [e.path.name for e in to_remove(entries, now, **kw)]  # noqa: E731
    assert names() == ["old", "dead"]  # a conversion a minute old may be in progress: kept
    assert names(unused_days=7) == ["current", "old", "dead"]
    assert names(unused_days=0) == ["current", "recent", "old", "dead"]
    assert names(everything=True) == ["current", "recent", "old", "dead"]


def _cache_with_three_entries(cache_dir: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A converted GGUF file (current), a second one whose marker names an older cache
    format, and a conversion's directory without a marker, left two hours ago."""
    current = resolve_checkpoint(_tiny(tmp_path / "a.gguf"))[1]
    old = resolve_checkpoint(_tiny(tmp_path / "b.gguf", arch="qwen2"))[1]
    marker = old / CACHE_MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "version": 0}))
    dead = current.parent / (current.name + ".tmpxyz")
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"\0" * 1000)
    two_hours_ago = time.time() - 7200
    os.utime(dead, (two_hours_ago, two_hours_ago))
    return current, old, dead


def _tiny(path: Path, arch: str = "llama") -> Path:
    write_tiny_gguf(path, arch=arch)
    return path


def test_entries_are_read_from_the_cache_and_a_load_marks_one_used(cache_dir, tmp_path):
    current, old, dead = _cache_with_three_entries(cache_dir, tmp_path)
    entries = {e.path: e for e in scan(cache_dir)}
    assert set(entries) == {current, old, dead}
    assert (entries[current].kind, entries[current].state) == ("gguf", CURRENT)
    assert entries[current].source == str(tmp_path / "a.gguf") and entries[current].size_bytes > 1000
    assert entries[old].state == OLD_FORMAT and (entries[dead].kind, entries[dead].state) == ("?", INCOMPLETE)
    assert entries[dead].size_bytes == 1000
    long_ago = time.time() - 30 * DAY
    os.utime(current / CACHE_MARKER, (long_ago, long_ago))
    assert {e.path for e in to_remove(scan(cache_dir), time.time(), unused_days=7)} == {current, old, dead}
    resolve_checkpoint(tmp_path / "a.gguf")  # loaded again: used now
    assert {e.path for e in to_remove(scan(cache_dir), time.time(), unused_days=7)} == {old, dead}


def test_lamina_cache_lists_and_prunes_as_a_user_runs_it(cache_dir, tmp_path):
    current, old, dead = _cache_with_three_entries(cache_dir, tmp_path)
    env = {**os.environ, "LAMINA_CACHE_DIR": str(cache_dir)}

    def lamina(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lamina.cli", "cache", *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    listed = json.loads(lamina("list", "--json").stdout)
    assert {(Path(e["path"]).name, e["state"]) for e in listed["entries"]} == {
        (current.name, CURRENT), (old.name, OLD_FORMAT), (dead.name, INCOMPLETE)}
    assert listed["total_bytes"] == sum(e["size_bytes"] for e in listed["entries"])
    table = lamina()
    assert table.returncode == 0 and f"{cache_dir / 'models'}: 3 entries" in table.stdout
    dry = lamina("prune", "--dry-run")
    assert "would remove 2 of 3 entries" in dry.stdout and old.is_dir() and dead.is_dir()
    pruned = lamina("prune")
    assert pruned.returncode == 0 and "removed 2 of 3 entries" in pruned.stdout
    assert current.is_dir() and not old.exists() and not dead.exists()
    assert resolve_checkpoint(tmp_path / "a.gguf")[2]  # the current entry still serves its load
    refused = lamina("prune", "--unused-days", "-1")
    assert refused.returncode == 2 and "--unused-days must be 0 or more" in refused.stderr
    assert "removed 1 of 1 entries" in lamina("prune", "--all").stdout and not current.exists()


def test_lamina_generate_says_before_it_converts_a_model_into_the_cache(cache_dir, tmp_path, capsys):
    """The first load of a GGUF file converts it (about a minute for SmolLM2-135M): `lamina
    generate`, which logs nothing, says so first, once (lamina up and the services log
    it); a random model not yet written is named too."""
    from lamina.cli import main
    from lamina.model.checkpoints import pending_write

    gguf = _tiny(tmp_path / "a.gguf")
    assert pending_write(gguf) == f"converting {gguf} into the cache (once)"
    argv = ["generate", "--model", str(gguf), "--prompt", "a b", "--max-tokens", "1", "--json"]
    assert main(argv) == 0
    said = f"lamina generate: converting {gguf} into the cache (once); a minute or more"
    assert capsys.readouterr().err.splitlines()[0] == said
    assert pending_write(gguf) is None and main(argv) == 0 and said not in capsys.readouterr().err
    assert pending_write("random:smollm2-135m@7") == "writing the weights of random:smollm2-135m@7 (once)"
    assert pending_write("random:nonsense") is None and pending_write(tmp_path / "missing.gguf") is None
