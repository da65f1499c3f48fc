"""What a service is doing when it will not stop: its stacks, written to its log on a
signal, and a cancellation of its tasks that notices one that goes on.

SIGUSR1 writes every thread's Python stack (faulthandler: it runs inside the signal
handler, so it answers even when the event loop is blocked or has already ended and
the interpreter waits on a thread). SIGUSR2 writes every asyncio task's stack from the
event loop (it answers only while the loop runs). The launcher sends both to a service
that has not exited within its stop timeout, and copies what they wrote into its own
log before it kills the service (services/launcher.py).
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import logging
import signal
import sys

log = logging.getLogger(__name__)

THREADS_SIGNAL = signal.SIGUSR1
TASKS_SIGNAL = signal.SIGUSR2


def tasks_report(loop: asyncio.AbstractEventLoop) -> str:
    """Every pending task of `loop` with the stack it is suspended at."""
    out = io.StringIO()
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    out.write(f"{len(tasks)} asyncio task(s):\n")
    for task in sorted(tasks, key=lambda t: t.get_name()):
        out.write(f"- {task.get_name()}: {task.get_coro()!r}\n")
        out.write(_format(_awaited_frames(task.get_coro())))
    return out.getvalue()


def _format(frames: list) -> str:
    return "".join(f'  File "{f.f_code.co_filename}", line {f.f_lineno}, in {f.f_code.co_name}\n' for f in frames)


def _awaited_frames(awaitable: object, limit: int = 24) -> list:
    """The frames of a suspended coroutine and of what it awaits, outermost first.
    By hand: Task.get_stack gives a suspended task only its outermost frame, and
    Task.print_stack fails on a frame whose line number is None."""
    frames = []
    while awaitable is not None and len(frames) < limit:
        frame = next((f for a in ("cr_frame", "gi_frame", "ag_frame") if (f := getattr(awaitable, a, None))), None)
        if frame is not None:
            frames.append(frame)
        awaitable = next((w for a in ("cr_await", "gi_yieldfrom", "ag_await") if (w := getattr(awaitable, a, None))),
                         None)
    return frames


def install(loop: asyncio.AbstractEventLoop) -> None:
    """Dump thread stacks on THREADS_SIGNAL and task stacks on TASKS_SIGNAL, to stderr
    (the service's log under the launcher)."""
    faulthandler.register(THREADS_SIGNAL, file=sys.stderr, all_threads=True)
    loop.add_signal_handler(TASKS_SIGNAL, lambda: log.warning("asked for its tasks; %s", tasks_report(loop)))


async def cancel_and_wait(tasks: list[asyncio.Task], grace_s: float = 2.0, rounds: int = 3) -> list[asyncio.Task]:
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
                        t.get_name(), grace_s, then, _format(_awaited_frames(t.get_coro())))
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # marked retrieved, as gather(return_exceptions=True) does: a shutdown ignores them
    return pending
