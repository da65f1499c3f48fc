"""How a stack started on this host (`lamina up`, a test) is found by its gateway port.

A healthy `lamina.services.launch.launcher.Stack` writes one small JSON file per gateway port in a
per-user runtime directory ($XDG_RUNTIME_DIR/lamina, else <tmp>/lamina-UID, mode 0700):
its pid and the path of its configuration file, which holds the Redis URL, namespace
and cluster token the services were started with. `stop()` removes it. A launcher
killed outright cannot remove it, so a reader ignores a file whose pid is gone.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "lamina" if base else Path(tempfile.gettempdir()) / f"lamina-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def state_path(port: int) -> Path:
    return runtime_dir() / f"up-{port}.json"


def publish(port: int, config_path: Path) -> None:
    """Make this process's stack findable by `port` (replacing a file left by a dead launcher)."""
    path = state_path(port)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "config": str(config_path)}))
    tmp.replace(path)  # atomic: a reader sees the old file or the whole new one


def withdraw(port: int) -> None:
    """Remove the file of `port` if this process wrote it."""
    path = state_path(port)
    try:
        if json.loads(path.read_text())["pid"] == os.getpid():
            path.unlink()
    except (OSError, ValueError, KeyError):
        pass


def find(port: int) -> Path | None:
    """The configuration file of the live stack whose gateway is on `port`, if any."""
    try:
        state = json.loads(state_path(port).read_text())
        os.kill(int(state["pid"]), 0)  # is the launcher alive? (signal 0 only checks)
    except PermissionError:
        pass  # alive, another user's process: cannot happen in a 0700 directory, but is not stale
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Path(state["config"])
