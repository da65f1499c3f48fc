"""What the model cache holds, and which of it to remove (`lamina cache`).

The cache (`<cache root>/models`, lamina.model.checkpoints.cache_root) holds a directory
per converted GGUF file (lamina.model.checkpoints: 609 MB for SmolLM2-135M's float32
weights, plus its repacked blocks) and per random model (lamina.model.random_models:
an 8B one is 16 GB), each with a marker file written last that names its source and the
cache format it was written in. Nothing removed them: a GGUF file of other content, or
a cache format changed by an upgrade, made a new directory beside the old one. Each load
of an entry now sets its marker's modification time (`mark_used`), so an entry's last use
is known.

`scan` reads the entries (no torch import); `to_remove` is the pure policy:

- an entry of another cache format than this version writes is never read again by it;
- a directory without a marker is a conversion that died half-way (or one in progress:
  those younger than `PARTIAL_GRACE_S` are left alone, a conversion takes about a minute);
- with `unused_days`, entries not loaded for that long;
- with `everything`, every entry (the next load converts or writes it again).

Removing an entry a running service has loaded is safe on Linux: its open and mapped
files live until they are closed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lamina.model import random_models
from lamina.model.checkpoints import CACHE_MARKER, CACHE_VERSION

PARTIAL_GRACE_S = 3600.0  # a directory without a marker this young may be a conversion in progress

CURRENT, OLD_FORMAT, INCOMPLETE = "current", "old format", "incomplete"


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    kind: str  # "gguf" (a converted GGUF file), "random" (a random model), "?" (no marker)
    source: str  # the GGUF file it was converted from, the random model's spec, or ""
    state: str  # CURRENT, OLD_FORMAT or INCOMPLETE
    size_bytes: int
    last_used: float  # the marker's modification time (set at each load); the directory's without one

    def to_dict(self) -> dict:
        return {"path": str(self.path), "kind": self.kind, "source": self.source, "state": self.state,
                "size_bytes": self.size_bytes, "last_used": self.last_used}


def models_dir(root: Path) -> Path:
    return root / "models"


def scan(root: Path) -> list[CacheEntry]:
    """Every entry under `root`/models, by name."""
    base = models_dir(root)
    if not base.is_dir():
        return []
    return [_entry(d) for d in sorted(base.iterdir()) if d.is_dir() and not d.is_symlink()]


def _entry(d: Path) -> CacheEntry:
    size = _size(d)
    for marker, kind, version, source_key in ((CACHE_MARKER, "gguf", CACHE_VERSION, "source"),
                                               (random_models.MARKER, "random", random_models.VERSION, "spec")):
        path = d / marker
        if path.is_file():
            try:
                meta = json.loads(path.read_text())
                used = path.stat().st_mtime
            except (OSError, ValueError):
                break  # unreadable: as good as absent
            state = CURRENT if meta.get("version") == version else OLD_FORMAT
            return CacheEntry(d, kind, str(meta.get(source_key, "")), state, size, used)
    return CacheEntry(d, "?", "", INCOMPLETE, size, d.stat().st_mtime)


def _size(d: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(d):
        for name in files:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def to_remove(entries: Iterable[CacheEntry], now: float, unused_days: float | None = None,
              everything: bool = False) -> list[CacheEntry]:
    """The entries a prune removes (module docstring), in the order given."""
    def goes(e: CacheEntry) -> bool:
        if e.state == INCOMPLETE:
            return now - e.last_used >= PARTIAL_GRACE_S
        if everything or e.state == OLD_FORMAT:
            return True
        return unused_days is not None and now - e.last_used >= unused_days * 86400

    return [e for e in entries if goes(e)]


def remove(entry: CacheEntry) -> None:
    shutil.rmtree(entry.path, ignore_errors=True)
