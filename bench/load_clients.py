"""What bench/load_generator.py's external load generators (guidellm, aiperf) share: the
workload, the figures each run is read into, finding the tool's executable, and running
it in a session of its own that is stopped, every process of it, on the way out."""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import signal
import subprocess
from pathlib import Path

from cpu_anchor import signals_held

from lamina.lifetime import child_argv

CLIENT_TIMEOUT_S = 3600.0


@dataclasses.dataclass(frozen=True)
class Workload:
    requests: int  # N
    prompt_tokens: int  # P
    output_tokens: int  # T, forced
    concurrency: int  # C


@dataclasses.dataclass(frozen=True)
class Figures:
    """One client's measurement of one run; latencies in seconds."""

    output_tok_s: float
    requests_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    itl_mean: float  # all gaps after first tokens / their number (guidellm's and aiperf's own definitions agree)
    requests: int  # completed
    output_tokens: int
    seconds: float  # the measured window
    errored: int = 0
    client_cpu_s: float = 0.0  # CPU time the client itself used (its processes), beside the stack's


def find_executable(name: str, explicit: str | None, env_var: str) -> Path | None:
    """`explicit` (the command line's), else $`env_var`, else `name` on PATH; None when
    none is there (a path given that is no executable file is not looked past)."""
    for candidate in (explicit, os.environ.get(env_var)):
        if candidate:
            path = Path(candidate)
            return path if path.is_file() and os.access(path, os.X_OK) else None
    found = shutil.which(name)
    return Path(found) if found else None


def stop_group(proc: subprocess.Popen | None, timeout_s: float = 30.0) -> None:
    """Stop a process started in its own session, and every process of that group
    (the tool's workers), by its id."""
    if proc is None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout_s)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def _children_cpu_s() -> float:
    """CPU seconds of this process's children that have ended and been waited for
    (the tool, and its workers once the tool has reaped them)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_client(name: str, argv: list[str], env: dict[str, str], workdir: Path) -> float:
    """Run a load generator to its end in `workdir` (its output in NAME.log there); its
    CPU seconds, its workers' included. Its whole process group is stopped on the way
    out, also on an error, Ctrl-C or SIGTERM."""
    log = workdir / f"{name}.log"
    cpu = _children_cpu_s()
    proc = None
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen(child_argv(argv), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=workdir, start_new_session=True)
        try:
            code = proc.wait(CLIENT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{name} still running after {CLIENT_TIMEOUT_S:.0f} s; log {log}") from None
        if code != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"{name} exited with {code}:\n{tail}")
        return _children_cpu_s() - cpu
    finally:
        with signals_held():
            stop_group(proc)
