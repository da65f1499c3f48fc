"""Stopping what will not stop: a service that does not exit in time has its stacks
copied into the launcher's log before it is killed (services/stack_dumps.py,
Stack.stop), and tasks that lose a cancellation are cancelled again or end anyway."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import textwrap
import time

from lamina.aio import cancel_and_wait
from lamina.kvstore.batches import write_batches
from lamina.kvstore.metadata import MetadataConfig, MetadataStore
from lamina.services.config import StackConfig
from lamina.services.launch.launcher import ServiceProcess, Stack
from lamina.services.runtime import refresh_every_half_ttl

# A process with the services' dump handlers whose event loop ignores SIGTERM and waits
# in a named task forever.
HUNG = textwrap.dedent("""
    import asyncio, signal
    from lamina.services import stack_dumps

    async def waits_forever():
        await inner_wait()

    async def inner_wait():
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
        with caplog.at_level(logging.WARNING, logger="lamina.services.launch.launcher"):
            stack.stop(timeout_s=1.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (record,) = [r for r in caplog.records if "did not stop" in r.getMessage()]
    message = record.getMessage()
    # The asyncio task's stack, down through what it awaits.
    assert "stuck-on-an-event" in message and "in waits_forever" in message and "in inner_wait" in message
    assert "Current thread" in message or "Thread 0x" in message  # faulthandler's thread stacks
    assert proc.returncode is not None


async def test_a_task_that_loses_its_cancellation_is_cancelled_again(caplog):
    """A task whose code catches one CancelledError and goes on (as library code under
    it can) ends at the second cancellation, with its stack logged; a plain one ends at
    the first."""
    caught = asyncio.Event()

    async def swallows_once():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            caught.set()
        await asyncio.sleep(3600)

    stubborn = asyncio.create_task(swallows_once(), name="swallows-once")
    plain = asyncio.create_task(asyncio.sleep(3600), name="plain")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="lamina.aio"):
        left = await cancel_and_wait([stubborn, plain], grace_s=0.2)
    assert left == [] and stubborn.cancelled() and plain.cancelled() and caught.is_set()
    (record,) = [r for r in caplog.records if "still runs" in r.getMessage()]
    assert "swallows-once" in record.getMessage() and "in swallows_once" in record.getMessage()


async def test_a_task_that_never_ends_is_given_up_on():
    stubborn = True

    async def ignores_cancellation():
        while stubborn:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    task = asyncio.create_task(ignores_cancellation())
    await asyncio.sleep(0)
    assert await cancel_and_wait([task], grace_s=0.05, rounds=2) == [task]
    stubborn = False  # now it ends, so that the test leaves nothing running
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.done()


async def test_a_refresh_that_swallows_the_cancellation_still_ends_its_loop():
    """refresh_every_half_ttl ends when cancelled during a round even if the round
    catches the CancelledError and returns (nothing connects: the store is only read
    for its TTL)."""
    in_round = asyncio.Event()
    rounds = 0

    async def refresh() -> None:
        nonlocal rounds
        rounds += 1
        in_round.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)

    store = MetadataStore(MetadataConfig(url="redis://127.0.0.1:1", service_ttl_s=1.0))
    try:
        task = asyncio.create_task(refresh_every_half_ttl(store, refresh, "test"))
        await asyncio.wait_for(in_round.wait(), 5)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2)
        assert done == {task} and task.cancelled() and rounds == 1
    finally:
        await store.close()


async def test_a_batch_writer_whose_flush_swallows_the_cancellation_still_ends():
    in_flush = asyncio.Event()
    wake = asyncio.Event()

    async def flush() -> bool:
        in_flush.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)
        return True

    task = asyncio.create_task(write_batches(wake, flush, 0.0, 0.0))
    wake.set()
    await asyncio.wait_for(in_flush.wait(), 5)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2)
    assert done == {task} and task.cancelled()
