"""Child processes that do not outlive the process that started them.

A launcher (`lamina up`, a test, a benchmark) cleans up in order when it can; when it
is killed outright (SIGKILL, an OOM kill, a crashed test runner) it cannot, and its
services would go on serving, holding ports and memory. On Linux each child asks the
kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG), which the services treat
as any stop request: they drain and deregister.

- A Python service started with `child_env()` calls `die_with_parent()` first thing.
- A foreign executable (redis-server) is started through `setpriv --pdeathsig TERM`
  (util-linux) where that exists, by `child_argv()`.
- `spawn_logged()` starts a service process the way every launcher does: its own
  session, its output in a log file.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

PARENT_ENV = "LAMINA_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that must end with this process."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """In a child started with `child_env()`: receive SIGTERM when the parent dies.

    The parent may have died before this call: then the process stops itself now."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)


def child_argv(argv: list[str]) -> list[str]:
    """argv for a foreign executable that must end with this process (Linux, setpriv)."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    return [setpriv, "--pdeathsig", "TERM", "--", *argv] if setpriv else list(argv)


def open_log(log_path: Path, note: str | None = None) -> BinaryIO:
    """A service's log, open for writing: a new one, or, with `note` (a restart), the old
    one continued after that line."""
    logf = open(log_path, "wb" if note is None else "ab")  # noqa: SIM115 - the caller closes it
    if note is not None:
        logf.write(f"--- lamina: {note} ---\n".encode())
        logf.flush()
    return logf


def spawn_logged(argv: list[str], log_path: Path, env: Mapping[str, str], note: str | None = None
                 ) -> subprocess.Popen:
    """Start `argv` with stdout and stderr in `log_path` (`open_log`). Its own session, so
    that a Ctrl-C meant for the launcher reaches the service only as the launcher's ordered
    stop. `env` comes from `child_env()` for a process that must end with this one."""
    with open_log(log_path, note) as logf:
        return subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)
