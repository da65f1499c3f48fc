"""What runs inside the Ray actors of `lamina up --ray`, on whichever node Ray chose.

`ServiceHost` runs one service the way `lamina up` runs it on one host: the same
`python -m lamina.cli KIND [--index I] --config FILE` process, its output in a log
file; here the configuration file and the log are in a private directory of the
actor's node (mode 0700: the file holds the cluster token). It answers the launcher's
polls, signals and waits for that process, and restarts it in place when asked.
`RedisHost` runs the stack's embedded Redis the same way.

The processes end with their actor: they are started with `child_env`, so the kernel
sends them SIGTERM when the actor's worker process dies (`ray.kill`, its node's raylet
gone; lamina/lifetime.py). PR_SET_PDEATHSIG follows the thread that forked; a Ray actor
without `max_concurrency` runs every method on its worker's main thread, which lives as
long as the worker.

These classes are plain; `lamina.services.launch.ray_stack` makes them actors (`ray.remote(cls)`).
They import no torch or model code: an actor process stays small.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lamina.kvstore.redis_server import EmbeddedRedis
from lamina.lifetime import child_env, spawn_logged
from lamina.services.addresses import WILDCARD_HOSTS


@dataclass(frozen=True)
class Placement:
    """Where Ray put an actor and what it runs there."""

    node_id: str  # Ray's node id
    node_ip: str  # the node's address in the Ray cluster
    hostname: str
    resources: dict[str, float]  # what Ray assigned the actor (its custom resource, if any)
    pid: int  # the process the actor runs (a service, redis-server)
    log_path: str  # that process's log, on the node


def _placement(pid: int, log_path: Path) -> Placement:
    import ray

    ctx = ray.get_runtime_context()
    return Placement(node_id=ctx.get_node_id(), node_ip=ray.util.get_node_ip_address(),
                     hostname=socket.gethostname(), resources=dict(ctx.get_assigned_resources()), pid=pid,
                     log_path=str(log_path))


class ServiceHost:
    """One service process on this actor's node (`name`: attention-0, gateway, ...)."""

    def __init__(self, name: str, command: list[str], config_yaml: str, host: str) -> None:
        import ray

        self._dir = Path(tempfile.mkdtemp(prefix=f"lamina-{name}-"))  # 0700
        config_path = self._dir / "stack.yaml"
        config_path.write_text(config_yaml)
        self._log_path = self._dir / f"{name}.log"
        self._argv = [sys.executable, "-m", "lamina.cli", *command, "--config", str(config_path)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # A service bound on a wildcard registers the address its hostname resolves to
        # (services/addresses.py), which need not be the one its peers reach it at: the
        # node's address in the Ray cluster is, unless the node's environment names one
        # (the configuration's advertise_host reaches the service through its file).
        if host in WILDCARD_HOSTS and not env.get("LAMINA_ADVERTISE_HOST"):
            env["LAMINA_ADVERTISE_HOST"] = ray.util.get_node_ip_address()
        self._env = child_env(env)
        self._proc: subprocess.Popen | None = None

    def start(self, note: str | None = None) -> Placement:
        """Start the process (again, after `note` in its log, when it has exited)."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"{self._argv[3]} is running (pid {self._proc.pid})")
        self._proc = spawn_logged(self._argv, self._log_path, self._env, note)
        return _placement(self._proc.pid, self._log_path)

    def placement(self) -> Placement | None:
        """Where this actor runs and its current process (None before the first start):
        what `ray.get_actor(NAME, namespace=...)` lets a tool or a test ask."""
        return None if self._proc is None else _placement(self._proc.pid, self._log_path)

    def poll(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def send_signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)

    def wait(self, timeout_s: float | None) -> int | None:
        """The exit code, or None if the process still runs after `timeout_s`."""
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int) -> str:
        if not self._log_path.is_file():
            return "(no log)"
        return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        """Kill the process if it still runs and remove the directory (the token's file
        with it; the log goes too)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


class RedisHost:
    """The stack's embedded Redis on this actor's node.

    Bound on `host`, the stack's; on a wildcard it is reached at the node's address. It
    asks clients for `password` (the cluster token): unlike `lamina up`'s, this one may
    listen beyond loopback."""

    def __init__(self, host: str, password: str) -> None:
        self._redis = EmbeddedRedis(bind=host, password=password)

    def start(self) -> tuple[str, Placement]:
        """Start the server; (its URL for the stack's services, where it runs)."""
        import ray

        self._redis.start()
        host = ray.util.get_node_ip_address() if self._redis.bind in WILDCARD_HOSTS else self._redis.bind
        return self._redis.url_for(host), self.placement()

    def placement(self) -> Placement:
        return _placement(self._redis.pid, self._redis.log_path)

    def close(self) -> None:
        self._redis.close()
