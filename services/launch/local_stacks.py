"""How a stack started on this host (`lamina up`, a test) is found by its gateway port.

A healthy `lamina.services.launch.launcher.Stack` writes one small JSON file per gateway port in a
per-user runtime directory ($XDG_RUNTIME_DIR/lamina, else <tmp>/lamina-UID, mode 0700):
its pid and the path of its configuration file, which holds the Redis URL, namespace
and cluster token the services were started with. `stop()` removes it. A launcher
killed outright cannot remove it, so a reader ignores a file whose pid is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from pathlib import Path


class UnsafeDirectory(RuntimeError):
    """The runtime directory is not this user's own private directory."""


def runtime_dir() -> Path:
    """The directory, made 0700 if absent. One found there already must be a directory
    (not a link: in a shared <tmp>, another user could point it anywhere), owned by this
    user, and open to nobody else: anyone who can write in it could point `lamina status`
    at a configuration of theirs (UnsafeDirectory, naming what is wrong)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "lamina" if base else Path(tempfile.gettempdir()) / f"lamina-{os.getuid()}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):  # what is there already is checked below
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    fix = "remove it, or set XDG_RUNTIME_DIR to a directory of your own"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"the runtime directory {path} is not a directory but a link or file: {fix}")
    if st.st_uid != os.getuid():
        raise UnsafeDirectory(f"the runtime directory {path} belongs to uid {st.st_uid}, not to you "
                              f"(uid {os.getuid()}): {fix}")
    if st.st_mode & 0o077:
        raise UnsafeDirectory(f"the runtime directory {path} has mode {stat.S_IMODE(st.st_mode):04o}, open to "
                              f"others: chmod 700 {path}")
    return path


def state_path(port: int) -> Path:
    return runtime_dir() / f"up-{port}.json"


def publish(port: int, config_path: Path) -> None:
    """Make this process's stack findable by `port` (replacing a file left by a dead launcher)."""
    path = state_path(port)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "config": str(config_path)}))
    tmp.replace(path)  # atomic: a reader sees the old file or the whole new one


def withdraw(port: int, config_path: Path) -> None:
    """Remove the file of `port` if this process wrote it for the stack of `config_path`
    (one process may run several stacks, one after another on the same port)."""
    path = state_path(port)
    try:
        state = json.loads(path.read_text())
        if state["pid"] == os.getpid() and state["config"] == str(config_path):
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
