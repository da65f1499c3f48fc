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

import pytest

from lamina.aio import cancel_and_wait
from lamina.kvstore.batches import write_batches
from lamina.kvstore.metadata import MetadataConfig, MetadataStore
from lamina.kvstore.redis_server import EmbeddedRedis
from lamina.services.config import StackConfig
from lamina.services.launch.launcher import ServiceProcess, Stack, stop_stages
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


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


async def _swallowed_then_redis(store: MetadataStore, in_round: asyncio.Event) -> None:
    """What redis-py does at times: the cancellation lands under a command and is lost
    (suppressed here, where the test can place it); then the next command."""
    in_round.set()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(3600)
    await store.list_services("model")


async def test_a_lost_cancellation_is_raised_again_by_the_store_s_next_command(redis_url):
    """The metadata store's client raises a cancellation its task lost once its next
    command (or pipeline) ends; without one lost, commands return as they do."""
    store = MetadataStore(MetadataConfig(url=redis_url, namespace="lost"))
    try:
        assert await store.list_services("model") == []
        for command in (lambda: store.list_services("model"), lambda: store.block_holders(["h1", "h2"])):
            in_round = asyncio.Event()

            async def round_(command=command, in_round=in_round) -> str:
                in_round.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(3600)
                await command()  # a plain command, then a pipeline
                return "went on"

            task = asyncio.create_task(round_())
            await asyncio.wait_for(in_round.wait(), 5)
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=5)
            assert done == {task} and task.cancelled()
    finally:
        await store.close()


async def test_the_loops_around_store_calls_end_at_a_cancellation_lost_under_a_command(redis_url):
    """refresh_every_half_ttl and the batch writer check nothing themselves: a round that
    loses the cancellation still ends the loop at its next Redis command."""
    store = MetadataStore(MetadataConfig(url=redis_url, namespace="loops", service_ttl_s=1.0))
    try:
        in_round, in_flush, wake = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def flush() -> bool:
            await _swallowed_then_redis(store, in_flush)
            return True

        refresh = asyncio.create_task(refresh_every_half_ttl(store, lambda: _swallowed_then_redis(store, in_round),
                                                             "test"))
        writer = asyncio.create_task(write_batches(wake, flush, 0.0, 0.0))
        wake.set()
        await asyncio.wait_for(asyncio.gather(in_round.wait(), in_flush.wait()), 5)
        for task in (refresh, writer):
            task.cancel()
        done, _ = await asyncio.wait([refresh, writer], timeout=5)
        assert done == {refresh, writer} and refresh.cancelled() and writer.cancelled()
    finally:
        await store.close()


# A stand-in service: on SIGTERM it notes when, takes a moment to drain, notes its exit.
DRAINS = textwrap.dedent("""
    import signal, sys, time
    path = sys.argv[1]
    def stop(*_):
        with open(path, "a") as f:
            f.write(f"term {time.monotonic()}\\n")
        time.sleep(0.3)
        with open(path, "a") as f:
            f.write(f"exit {time.monotonic()}\\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    open(path, "a").write("ready\\n")
    while True:
        time.sleep(1)
""")


def test_stop_stages_gateway_then_scheduler_then_every_worker():
    names = ["attention-0", "attention-1", "model-0", "prefill-0", "scheduler", "gateway"]
    stages = stop_stages([ServiceProcess(n, []) for n in names])
    assert [[sp.name for sp in stage] for stage in stages] == [
        ["gateway"], ["scheduler"], ["attention-0", "attention-1", "model-0", "prefill-0"]]


def test_stop_signals_the_workers_together_after_the_gateway_and_the_scheduler(tmp_path):
    names = ["attention-0", "model-0", "prefill-0", "scheduler", "gateway"]
    procs = {n: subprocess.Popen([sys.executable, "-c", DRAINS, str(tmp_path / n)]) for n in names}
    stack = Stack(StackConfig(), log_dir=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / n).is_file() for n in names) and time.monotonic() < deadline:
            time.sleep(0.05)  # until each has its handler: it says so in its file, nothing to wait on
        stack.processes = [ServiceProcess(n, [], proc=p) for n, p in procs.items()]
        stack.stop(timeout_s=10.0)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    at = {n: dict(line.split() for line in (tmp_path / n).read_text().split("\n")[1:] if line) for n in names}
    term = {n: float(t["term"]) for n, t in at.items()}
    exit_ = {n: float(t["exit"]) for n, t in at.items()}
    assert exit_["gateway"] < term["scheduler"]
    workers = ["attention-0", "model-0", "prefill-0"]
    assert exit_["scheduler"] < min(term[w] for w in workers)
    assert max(term[w] for w in workers) < min(exit_[w] for w in workers)  # signalled together
    assert all(p.returncode == 0 for p in procs.values())
