"""Failures that need the failed process back: under supervision (`lamina up`'s), a
killed worker is restarted and the requests that needed it finish with the same text;
a killed scheduler or gateway ends its requests with an error at once, and the stack
serves new requests once the supervisor has restarted it."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from e2e_helpers import attention_stats, start_stack
from fault_helpers import pid, stream_all

pytestmark = pytest.mark.timeout(900)


def _supervised(**options):
    s = start_stack(supervise=True, **options)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def head_stack():
    """Head-level partitioning and one model worker: every request needs every worker."""
    yield from _supervised(workers=2, partition="head")


@pytest.mark.parametrize(("victim", "after_chunks"), [("attention-1", 3), ("model-0", 3), ("prefill-0", None)],
                         ids=["attention-decode", "model-decode", "prefill-before"])
def test_requests_wait_for_the_restarted_worker(head_stack, victim, after_chunks, references):
    old = pid(head_stack, victim)
    kill = lambda: os.kill(old, signal.SIGKILL)  # noqa: E731
    if after_chunks is None:
        kill()  # the requests' prefills meet a dead prefill worker and wait for the new one
        texts = asyncio.run(stream_all(head_stack.base_url, lambda: None, None))
    else:
        texts = asyncio.run(stream_all(head_stack.base_url, kill, after_chunks))
    assert texts == references
    assert pid(head_stack, victim) != old  # it was restarted, not spared


@pytest.fixture(scope="module")
def stack():
    yield from _supervised(workers=2, partition="request")


def _kv_in_use(stack) -> int:
    return sum(s.num_tokens for s in asyncio.run(attention_stats(stack)))


@pytest.mark.parametrize("victim", ["scheduler", "gateway"])
def test_a_lost_front_end_process_ends_its_requests_and_the_stack_serves_again(stack, victim, references):
    old = pid(stack, victim)
    start = time.monotonic()
    outcomes = asyncio.run(stream_all(stack.base_url, lambda: os.kill(old, signal.SIGKILL), 3, errors=True))
    # Each stream either had finished before the kill (a short answer) or ended with an
    # error: none hung, none was cut short without one.
    assert all(isinstance(o, Exception) or o == ref for o, ref in zip(outcomes, references)), outcomes
    assert sum(isinstance(o, Exception) for o in outcomes) >= len(outcomes) // 2
    assert time.monotonic() - start < 120
    deadline = time.monotonic() + 60
    while pid(stack, victim) == old and time.monotonic() < deadline:
        time.sleep(0.2)  # the supervisor restarts it after its backoff
    assert pid(stack, victim) != old
    stack.wait_healthy(120)
    # New requests are served in full (the gateway found the new scheduler), and the
    # KV of the requests that ended with the lost process is freed.
    deadline = time.monotonic() + 60
    while True:
        try:
            texts = asyncio.run(stream_all(stack.base_url, lambda: None, None))
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    assert texts == references
    deadline = time.monotonic() + 30
    while _kv_in_use(stack) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _kv_in_use(stack) == 0
