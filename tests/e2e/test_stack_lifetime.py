"""A launcher killed outright leaves no service running: every child ends with it, and the
stack's configuration file keeps no cluster token (the forker takes it out)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")]

LAUNCHER = """
import json, sys, time
sys.path.insert(0, {tests!r})
from e2e_helpers import start_stack
stack = start_stack(workers=1)
pids = [sp.proc.pid for sp in stack.processes] + [stack.redis._proc.pid]
print(json.dumps({{"pids": pids, "forker": stack.forker_pid, "work_dir": str(stack.work_dir)}}), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has exited; only its entry is left


def test_killing_the_launcher_stops_every_service_and_redis():
    tests = str(Path(__file__).resolve().parent)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(tests=tests)], stdout=subprocess.PIPE,
                                text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        line = launcher.stdout.readline()
        assert line, "the launcher did not start the stack"
        started = json.loads(line)
        pids, work_dir = started["pids"], Path(started["work_dir"])
        assert len(pids) == 6 and all(_alive(p) for p in pids)  # redis, 1 attention, model, prefill, scheduler, gateway
        assert started["forker"] is not None and _alive(started["forker"])
        pids.append(started["forker"])
        assert "cluster_token: null" not in (work_dir / "stack.yaml").read_text()
        # Redis works in the stack's directory: removing that one leaves nothing of the stack.
        assert (work_dir / "redis" / "redis.log").is_file()
        launcher.send_signal(signal.SIGKILL)  # no chance to clean up
        launcher.wait()
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)  # polling other processes' exit: there is no event to wait on
        assert not [p for p in pids if _alive(p)], "services outlived their launcher"
        # The forker stopped the services, then took the token out of the file they were started with.
        config = (work_dir / "stack.yaml").read_text()
        assert "cluster_token: null" in config and "when its launcher ended without stopping it" in config
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for p in locals().get("pids", []):
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if "work_dir" in locals():  # a launcher killed outright leaves its directory: the test removes it
            shutil.rmtree(work_dir, ignore_errors=True)
