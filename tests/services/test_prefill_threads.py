"""A prefill forward's compute threads (lamina.services.prefill.free_cores): the host's
cores that other processes' runnable threads leave, at least one, at most the limit."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lamina.services.config import ConfigError, load_config
from lamina.services.prefill.free_cores import forward_threads, others_runnable, runnable_threads


def test_a_forward_takes_the_cores_others_leave():
    assert forward_threads(2, 2, 0.0) == 2  # an idle host: every core
    assert forward_threads(2, 2, 2.0) == 1  # a model worker decoding on two threads: one, never none
    assert forward_threads(4, 8, 3.0) == 4 and forward_threads(8, 8, 3.0) == 5
    assert forward_threads(2, 2, 0.4) == 2 and forward_threads(2, 2, 0.6) == 1  # to the nearest thread
    assert forward_threads(3, 2, None) == 3  # not known: the limit


def test_the_fewest_runnable_through_the_window_count_without_the_reader(tmp_path: Path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.52 0.58 0.59 3/467 12345\n")
    assert runnable_threads(loadavg) == 3
    assert runnable_threads(tmp_path / "absent") is None
    readings = iter([1, 4, 3, 3, 2])
    start = time.perf_counter()
    assert asyncio.run(others_runnable(0.02, read=lambda: next(readings))) == 0  # the fewest of 0, 3, 2, 2, 1
    readings = iter([3, 4, 2, 3, 2])
    assert asyncio.run(others_runnable(0.0, samples=1, read=lambda: next(readings))) == 2
    assert asyncio.run(others_runnable(0.01, read=lambda: next(readings, 3))) == 1  # of 3, 1, 2, 1, 2
    assert time.perf_counter() - start >= 0.02  # the window is waited out
    assert asyncio.run(others_runnable(0.0, read=lambda: 5)) == 4  # no window: one reading
    assert asyncio.run(others_runnable(0.01, read=lambda: None)) is None


@pytest.mark.skipif(runnable_threads() is None, reason="needs /proc/loadavg (Linux)")
def test_busy_processes_on_the_host_are_seen():
    """Two processes that spin (a model worker decoding on two threads keeps 1-3 others
    runnable all the time) leave a 2-thread forward one thread."""
    spin = "import time\nend = time.time() + 20\nwhile time.time() < end: pass\n"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    try:
        time.sleep(0.3)
        others = asyncio.run(others_runnable(0.05))
        assert others is not None and others >= 1.5
        assert forward_threads(2, 2, others) == 1
    finally:
        for p in busy:
            p.kill()
            p.wait()


def test_prefill_threads_are_at_most_the_model_workers_unless_set():
    config = load_config(env={})
    assert config.prefill.threads == 0 and config.model_worker.threads == 1
    assert load_config(env={}, overrides={"prefill.threads": 3}).prefill.threads == 3
    with pytest.raises(ConfigError, match=r"prefill\.threads must be a non-negative integer"):
        load_config(env={}, overrides={"prefill.threads": -1})
