"""A service that does not stop in time has its stacks copied into the launcher's log
before it is killed (services/stack_dumps.py, Stack.stop)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time

from lamina.services.config import StackConfig
from lamina.services.launcher import ServiceProcess, Stack

# A process with the services' dump handlers whose event loop ignores SIGTERM and waits
# in a named task forever.
HUNG = textwrap.dedent("""
    import asyncio, signal, sys, threading
    from lamina.services import stack_dumps

    async def waits_forever():
        await asyncio.Event().wait()

    async def main():
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: None)
        stack_dumps.install(loop)
        task = asyncio.create_task(waits_forever(), name="stuck-on-an-event")
        print("ready", flush=True)
        await task

    asyncio.run(main())
""")


def test_stop_copies_a_hung_services_stacks_into_the_log(tmp_path, caplog):
    log_path = tmp_path / "hung.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-c", HUNG], stdout=logf, stderr=subprocess.STDOUT)
    stack = Stack(StackConfig(), log_dir=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while b"ready" not in log_path.read_bytes() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until its handlers are installed: it says so in its log, nothing to wait on
        assert b"ready" in log_path.read_bytes(), log_path.read_text()
        stack.processes = [ServiceProcess("hung", [], proc=proc)]
        with caplog.at_level(logging.WARNING, logger="lamina.services.launcher"):
            stack.stop(timeout_s=1.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (record,) = [r for r in caplog.records if "did not stop" in r.getMessage()]
    message = record.getMessage()
    assert "stuck-on-an-event" in message and "waits_forever" in message  # the asyncio task's stack
    assert "Current thread" in message or "Thread 0x" in message  # faulthandler's thread stacks
    assert proc.returncode is not None
