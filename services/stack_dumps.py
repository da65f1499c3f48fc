"""What a service is doing when it will not stop: its stacks, written to its log on a
signal (a shutdown's cancellation that notices a task going on is lamina/aio.py's
`cancel_and_wait`).

SIGUSR1 writes every thread's Python stack (faulthandler: it runs inside the signal
handler, so it answers even when the event loop is blocked or has already ended and
the interpreter waits on a thread). SIGUSR2 writes every asyncio task's stack from the
event loop (it answers only while the loop runs). The launcher sends both to a service
that has not exited within its stop timeout, and copies what they wrote into its own
log before it kills the service (services/launch/launcher.py).
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import logging
import signal
import sys

from lamina.aio import task_stack

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
        out.write(task_stack(task))
    return out.getvalue()


def install(loop: asyncio.AbstractEventLoop) -> None:
    """Dump thread stacks on THREADS_SIGNAL and task stacks on TASKS_SIGNAL, to stderr
    (the service's log under the launcher)."""
    faulthandler.register(THREADS_SIGNAL, file=sys.stderr, all_threads=True)
    loop.add_signal_handler(TASKS_SIGNAL, lambda: log.warning("asked for its tasks; %s", tasks_report(loop)))
