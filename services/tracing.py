"""A torch.profiler trace of a running service, taken on a signal: what its host and, on
a GPU, its device did over a window, operator by operator (CUDA runtime calls and
kernels included), to find where a decode step's time goes in a stack that is serving.

TRACE_START (SIGRTMIN+1) starts recording; TRACE_STOP (SIGRTMIN+2) stops and writes, into
$LAMINA_TRACE_DIR (default: the temporary directory's `lamina-traces`), two files named
`<service id>-pid<pid>-<n>`: `.json.gz`, a Chrome trace (Perfetto or chrome://tracing opens
it), and `.txt`, the operators by self CPU time and, on a GPU, by self device time.

    kill -s RTMIN+1 PID; sleep 2; kill -s RTMIN+2 PID    # PIDs: lamina status --json

bench/gpu_decode.py --trace DIR sends both to the model and attention workers over each
stack run's timed window. Recording costs the process microseconds an operator while it
runs, and writing blocks its event loop for as long as the window's events take to save
(seconds for a busy second on a GPU): a diagnostic, not for a stack under real load.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TRACE_START = signal.SIGRTMIN + 1
TRACE_STOP = signal.SIGRTMIN + 2
TRACE_DIR_ENV = "LAMINA_TRACE_DIR"


def trace_dir() -> Path:
    return Path(os.environ.get(TRACE_DIR_ENV) or Path(tempfile.gettempdir()) / "lamina-traces")


class Tracer:
    """One process's trace, started and stopped by `start`/`stop` (or the signals),
    written into `out_dir` (default: `trace_dir()` when it stops)."""

    def __init__(self, name: str, out_dir: Path | None = None) -> None:
        self.name = name
        self.out_dir = out_dir
        self._profile: Any = None  # torch.profiler.profile while recording
        self._written = 0

    def start(self) -> None:
        if self._profile is not None:
            log.warning("%s: a trace is already recording", self.name)
            return
        import torch  # the processes that are never traced (the gateway) need not import it
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        # with_stack: the trace's Python functions too, which say what the host did
        # between two operators (the time a GPU waits on its host).
        self._profile = profile(activities=activities, with_stack=True)
        self._profile.start()
        log.info("%s: trace started (%s)", self.name, ", ".join(a.name for a in activities))

    def stop(self) -> list[Path]:
        """Stops recording and writes the trace; the files written (none if none recorded)."""
        prof, self._profile = self._profile, None
        if prof is None:
            log.warning("%s: asked to stop a trace, but none is recording", self.name)
            return []
        prof.stop()
        out = self.out_dir or trace_dir()
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"{self.name}-pid{os.getpid()}-{self._written}"
        self._written += 1
        chrome, table = stem.with_name(stem.name + ".json.gz"), stem.with_name(stem.name + ".txt")
        prof.export_chrome_trace(str(chrome))
        averages = prof.key_averages()
        parts = [f"{self.name} (pid {os.getpid()}): operators by self CPU time\n",
                 averages.table(sort_by="self_cpu_time_total", row_limit=40)]
        if any(getattr(e, "self_device_time_total", 0) for e in averages):
            parts += ["\nby self device time\n", averages.table(sort_by="self_device_time_total", row_limit=40)]
        table.write_text("".join(parts))
        log.info("%s: trace written to %s and %s", self.name, chrome, table)
        return [chrome, table]


def install(loop: asyncio.AbstractEventLoop, name: str) -> Tracer:
    """TRACE_START and TRACE_STOP drive a Tracer of this process, named `name` (its
    service id). A failure to trace is logged; the service goes on."""
    tracer = Tracer(name)

    def guarded(action: Any) -> None:
        try:
            action()
        except Exception:  # a diagnostic must never take the service down
            log.exception("%s: tracing failed", name)

    loop.add_signal_handler(TRACE_START, guarded, tracer.start)
    loop.add_signal_handler(TRACE_STOP, guarded, tracer.stop)
    return tracer
