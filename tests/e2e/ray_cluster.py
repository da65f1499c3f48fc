"""A throwaway Ray cluster on this host for tests: a head and more nodes, each declaring
its own custom resources, each node a `ray start --block` process in its own session.

`ray start --block` ends its node's processes (GCS, raylet, workers) when it gets
SIGTERM, which the kernel also sends it when the test process dies (`child_argv`);
`stop()` sends that to every node, the head last, kills whatever of a node's
process group is left after a grace period, and reports every process of the cluster
seen while it ran that is still alive. No `ray stop`: that ends every Ray process of
the user on the machine, other clusters' too.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from lamina.lifetime import child_argv

RAY = str(Path(sys.executable).with_name("ray"))
READY_LINE = "block forever"  # what `ray start --block` prints once its node is up
OBJECT_STORE_BYTES = 100 << 20  # per node; the services pass nothing through Ray's object store


class RayCluster:
    def __init__(self) -> None:
        # A short directory: Ray's unix sockets live under it and their paths must stay
        # under 108 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-"))
        self.address = ""
        self._nodes: list[subprocess.Popen] = []
        self._seen: dict[int, psutil.Process] = {}  # every process of the cluster seen so far

    def add_node(self, resources: dict[str, float], timeout_s: float = 120.0, launcher: Sequence[str] = (),
                 node_ip: str | None = None) -> None:
        """Start a node declaring `resources`; the first one is the head. `launcher`: an
        argv prefix it runs under (`ip netns exec NS`: a host of its own), with `node_ip`
        the address it has there."""
        argv = [*launcher, RAY, "start", "--block", "--num-cpus", "0", "--object-store-memory",
                str(OBJECT_STORE_BYTES), "--resources", json.dumps(resources), "--disable-usage-stats"]
        argv += ["--node-ip-address", node_ip] if node_ip else []
        if self._nodes:
            argv += ["--address", self.address]
        else:
            argv += ["--head", "--port", "0", "--temp-dir", str(self.temp_dir), "--include-dashboard", "false"]
        proc = subprocess.Popen(child_argv(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        self._nodes.append(proc)
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        seen: list[str] = []
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no Ray node in {timeout_s:.0f} s:\n" + "".join(seen[-20:])) from None
            if line is None:
                raise RuntimeError(f"`ray start` exited with {proc.wait()}:\n" + "".join(seen[-20:]))
            seen.append(line)
            if READY_LINE in line:
                break
        if not self.address:
            self.address = (self.temp_dir / "ray_current_cluster").read_text().strip()
        self.snapshot()

    def snapshot(self) -> None:
        """Remember every process of the cluster now (nodes, their children, the workers'
        children: the services), so that `stop()` can tell which outlived it."""
        for node in self._nodes:
            try:
                root = psutil.Process(node.pid)
                for p in [root, *root.children(recursive=True)]:
                    self._seen.setdefault(p.pid, p)
            except psutil.NoSuchProcess:
                pass

    def stop(self, grace_s: float = 60.0) -> list[str]:
        """Stop every node, remove the cluster's directory and return the processes of the
        cluster still alive (none)."""
        self.snapshot()
        for node in reversed(self._nodes):  # the head last: the others drain through it
            if node.poll() is None:
                node.send_signal(signal.SIGTERM)
                try:
                    node.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    node.kill()
                    node.wait()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)  # what of its session is left
        _, alive = psutil.wait_procs(list(self._seen.values()), timeout=grace_s)
        left = []
        for p in alive:
            try:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:200]}")
                p.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)
