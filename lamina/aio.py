"""asyncio helpers for stopping tasks, below the KV store and the services that use them.

`raise_if_cancelled`: a cancellation that a Redis call lost, raised again. redis-py's
asyncio client (8.1 measured here) can end a command normally although the task running
it was cancelled meanwhile: in a probe cancelling a loop of GETs at 0-3 ms, 1 to 16 of 20
cancellations were lost. A loop around Redis calls that runs until cancelled would then
go on forever, and whoever awaits it at shutdown with it. `Task.cancelling()` still
counts the request, so the metadata store's client (lamina.kvstore.metadata) checks it
as each command and each pipeline ends, once for every caller, and the loops around
Redis calls need no check of their own.

`cancel_and_wait`: a shutdown's cancellation of its tasks that notices one that goes on
(its stack logged, cancelled again). `task_stack`: a suspended task's stack as text, for
that warning and for services/stack_dumps.py's report of every task.

`install_uvloop`: every service's event loop is uvloop's where it is installed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)


def raise_if_cancelled() -> None:
    """Raise CancelledError if the current task was cancelled and code under it did not raise it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def task_stack(task: asyncio.Task[Any]) -> str:
    """The stack `task` is suspended at, outermost frame first, one line per frame."""
    return "".join(f'  File "{f.f_code.co_filename}", line {f.f_lineno}, in {f.f_code.co_name}\n'
                   for f in _awaited_frames(task.get_coro()))


def _awaited_frames(awaitable: object, limit: int = 24) -> list[FrameType]:
    """The frames of a suspended coroutine and of what it awaits, outermost first.
    By hand: Task.get_stack gives a suspended task only its outermost frame, and
    Task.print_stack fails on a frame whose line number is None."""
    frames: list[FrameType] = []
    while awaitable is not None and len(frames) < limit:
        frame = next((f for a in ("cr_frame", "gi_frame", "ag_frame") if (f := getattr(awaitable, a, None))), None)
        if frame is not None:
            frames.append(frame)
        awaitable = next((w for a in ("cr_await", "gi_yieldfrom", "ag_await") if (w := getattr(awaitable, a, None))),
                         None)
    return frames


async def cancel_and_wait(tasks: Sequence[asyncio.Task[Any]], grace_s: float = 2.0,
                          rounds: int = 3) -> list[asyncio.Task[Any]]:
    """Cancel `tasks` and wait for them to end. One still running `grace_s` after its
    cancellation has lost it (code under it caught the CancelledError and went on):
    its stack is logged and it is cancelled again, up to `rounds` times. Returns the
    tasks still running after that (a shutdown goes on without them)."""
    pending = [t for t in tasks if not t.done()]
    for round_ in range(rounds):
        if not pending:
            break
        for t in pending:
            t.cancel()
        _, still = await asyncio.wait(pending, timeout=grace_s)
        pending = list(still)
        then = "cancelling it again" if round_ + 1 < rounds else "leaving it"
        for t in pending:
            log.warning("task %s still runs %.0f s after its cancellation; %s. Its stack:\n%s",
                        t.get_name(), grace_s, then, task_stack(t))
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # marked retrieved, as gather(return_exceptions=True) does: a shutdown ignores them
    return pending


def install_uvloop() -> bool:
    """Use uvloop's event loop policy when uvloop is installed; returns whether it is."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True
