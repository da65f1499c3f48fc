"""`lamina up --ray ADDRESS`: the stack with every service a Ray actor on the cluster's nodes.

`RayStack` is `lamina.services.launch.launcher.Stack` with one change: each service process (and the
embedded Redis, when no `redis_url` is configured) is run by a Ray actor
(`lamina.services.launch.ray_actors`) on a node that Ray chooses by the custom resource the service's
kind asks (`lamina.services.launch.ray_placement`). Everything else is the launcher's own: the same
`lamina` commands and configuration, the start order, waiting for the gateway's
/health, supervision (an exited service is restarted in its actor; a dead actor is
replaced by a new one, which Ray places again), `lamina status --port`, and the stop
order, gateway first. `stop()` then kills every actor, Redis's last, and disconnects.

Ray itself ends the actors when this driver dies without stopping them (they are
owned by it, not detached), and their processes end with them (lamina.services.launch.ray_actors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from lamina.gateway.config import is_loopback
from lamina.services.addresses import WILDCARD_HOSTS, host_port
from lamina.services.config import StackConfig
from lamina.services.launch.launcher import ServiceProcess, Stack, service_commands
from lamina.services.launch.ray_actors import Placement, RedisHost, ServiceHost
from lamina.services.launch.ray_placement import RayPlacement, demand, shortfalls
from lamina.services.launch.supervision import RestartPolicy

log = logging.getLogger(__name__)

# A call to a live actor answers in milliseconds; no answer in this long means its node
# is unreachable for now (the call is retried at the next poll).
CALL_TIMEOUT_S = 30.0
# How long Redis's actor may take to be placed and start (the services' actors are
# waited for by the stack's start timeout instead).
REDIS_START_TIMEOUT_S = 120.0


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Fail at once when a `host:port` address does not answer: ray.init would retry for
    minutes. Other forms (`auto`) are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise RuntimeError(f"no Ray cluster at {address}: {exc}") from None


class ActorProcess:
    """A service process run by a Ray actor, with the part of `subprocess.Popen`'s surface
    that `Stack` uses (pid, returncode, poll, send_signal, wait, kill).

    Until Ray has placed the actor and it has started the process, it reads as running.
    An actor that dies (`ray.kill`, its node lost, its start failing) reads as a process
    killed by SIGKILL; its death is logged with Ray's reason, once."""

    def __init__(self, name: str, handle, note: str | None = None) -> None:
        self.name = name
        self.handle = handle
        self.placement: Placement | None = None  # where it runs, once started
        self.returncode: int | None = None
        self.actor_died = False
        self._started = handle.start.remote(note)

    @property
    def pid(self) -> int:
        return self.placement.pid if self.placement is not None else 0

    def restart(self, note: str | None) -> None:
        """Start the process again in the same actor (its last one has exited)."""
        self.placement, self.returncode = None, None
        self._started = self.handle.start.remote(note)

    def poll(self) -> int | None:
        if self.returncode is None and self._placed():
            code = self._call("poll")
            if self.returncode is None:  # the call did not find the actor dead
                self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return
        if not self._placed():  # not placed yet: it runs nothing, and is ended whole
            import ray

            ray.kill(self.handle)
            self.returncode = -sig
            return
        self._call("send_signal", int(sig))

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            call_timeout = None if timeout is None else timeout + CALL_TIMEOUT_S
            code = self._call("wait", timeout, timeout_s=call_timeout) if self._placed() else None
            if self.returncode is None:
                if code is None:
                    raise subprocess.TimeoutExpired(self.name, 0.0 if timeout is None else timeout)
                self.returncode = code
        return self.returncode

    def log_tail(self, lines: int) -> str:
        if not self.actor_died:
            tail = self._call("log_tail", lines)
            if tail is not None:
                return tail
        if self.placement is None:
            return "(no log: the actor never started its process)"
        path = Path(self.placement.log_path)
        if path.is_file():  # the dead actor's node is this host
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return f"(its log is {path} on {self.placement.node_ip})"

    def _placed(self) -> bool:
        """Whether the actor has started its process; False while Ray still places it."""
        import ray

        if self.placement is None and not self.actor_died:
            ready, _ = ray.wait([self._started], timeout=0)
            if ready:
                try:
                    self.placement = ray.get(ready[0])
                except ray.exceptions.RayError as exc:
                    self._died(exc)
                    return False
                p = self.placement
                log.info("%s runs on node %s (%s, Ray node %s) with %s: pid %d, log %s", self.name, p.node_ip,
                         p.hostname, p.node_id[:12], p.resources or "no custom resource", p.pid, p.log_path)
        return self.placement is not None

    def _call(self, method: str, *args, timeout_s: float | None = CALL_TIMEOUT_S):
        """The actor's answer, or None when it is unreachable for now or has died."""
        import ray

        try:
            return ray.get(getattr(self.handle, method).remote(*args), timeout=timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError) as exc:
            log.warning("%s: its Ray actor did not answer %s: %s", self.name, method, exc)
            return None
        except ray.exceptions.RayError as exc:  # the actor died (or the call itself failed)
            self._died(exc)
            return None

    def _died(self, exc: Exception) -> None:
        if not self.actor_died:
            reason = " ".join(str(exc).split())
            log.error("%s: its Ray actor died: %s", self.name, reason)
        self.actor_died = True
        self.returncode = -signal.SIGKILL


class RayStack(Stack):
    """The stack on the Ray cluster at `address` (`host:port` of its head, or `auto`),
    placed by `placement`."""

    forks_services = False  # each actor starts its service in a fresh interpreter on its node

    # The defaults are frozen dataclasses: one shared instance each is safe.
    def __init__(self, config: StackConfig, address: str,
                 placement: RayPlacement = RayPlacement(),  # noqa: B008
                 supervise: bool = False,
                 restart_policy: RestartPolicy = RestartPolicy()) -> None:  # noqa: B008
        super().__init__(config, supervise=supervise, restart_policy=restart_policy)
        self.address = address
        self.placement = placement
        self.redis_placement: Placement | None = None
        self._redis_actor: Any | None = None  # RedisHost's Ray actor, once started
        self._actors: list = []  # every service actor created, replaced ones too: stop() ends them all
        self._config_yaml = ""

    @property
    def base_url(self) -> str:
        host = self.config.host
        if host in WILDCARD_HOSTS:  # reached at the gateway's node
            gateway = self.placements().get("gateway")
            host = gateway.node_ip if gateway is not None else "127.0.0.1"
        return f"http://{host_port(host, self.config.gateway.port)}"

    def placements(self) -> dict[str, Placement]:
        """Where each actor started so far runs, Redis's included."""
        out = {"redis": self.redis_placement} if self.redis_placement is not None else {}
        for sp in self.processes:
            if isinstance(sp.proc, ActorProcess) and sp.proc.placement is not None:
                out[sp.name] = sp.proc.placement
        return out

    def start(self, timeout_s: float = 300.0) -> None:
        import ray

        # ray.init makes SIGTERM raise SystemExit wherever the main thread is; the caller's
        # handler (lamina up's: an ordered stop) is put back.
        on_sigterm = signal.getsignal(signal.SIGTERM)
        try:
            _check_reachable(self.address)
            try:
                ray.init(address=self.address, namespace=self.config.namespace, log_to_driver=False,
                         logging_level=logging.WARNING)
            except (ConnectionError, ValueError, RuntimeError) as exc:
                raise RuntimeError(f"no Ray cluster at {self.address}: {exc}") from exc
        except BaseException:
            shutil.rmtree(self.work_dir, ignore_errors=True)  # nothing started: the stack's directory goes
            raise
        finally:
            if on_sigterm is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, on_sigterm)
        try:
            self._check_cluster()
            super().start(timeout_s)
        except BaseException:
            self.stop()  # what was started (Stack.start may have stopped it already), and disconnect
            raise

    def _gateway_port_taken(self) -> str | None:
        """Nothing to check here: the gateway's actor may run on another node (under Ray
        each service binds on its own node, and one that cannot says so in its log)."""
        return None

    def _check_cluster(self) -> None:
        """Refuse a cluster that cannot hold the stack, before any actor is created."""
        import ray

        kinds = [command[0] for _, _, command in service_commands(self.config)]
        kinds += [] if self.config.redis_url else ["redis"]
        missing = shortfalls(demand(self.placement, kinds), ray.cluster_resources())
        if missing:
            raise RuntimeError(
                f"the Ray cluster at {self.address} cannot place the stack's actors:\n  " + "\n  ".join(missing)
                + "\nstart nodes with `ray start --resources '{\"NAME\": COUNT}'`, or choose other resources"
                  " with --ray-resource KIND=NAME")
        hosts = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]})
        if len(hosts) > 1 and is_loopback(self.config.host):
            raise RuntimeError(
                f"the Ray cluster's nodes are on {len(hosts)} hosts ({', '.join(hosts)}), but the services would bind"
                f" {self.config.host}, which only their own host reaches: set host: 0.0.0.0 (LAMINA_HOST) and"
                f" gateway.api_key (--api-key)")

    def _create(self, cls, name: str, kind: str, *args, replacing: int = 0):
        """A new actor of `cls` named `name`, placed by `kind`'s resource. `replacing`: the
        number of the replacement of a dead actor of that name, which may hold the name
        still (an actor lost with its node keeps it for minutes): the new one is then
        named `NAME~N`."""
        import ray

        # num_cpus=0: only the custom resource decides placement (lamina.services.launch.ray_placement);
        # max_restarts=0: the launcher's supervision restarts, not Ray.
        def create(actor_name: str):
            return ray.remote(cls).options(name=actor_name, num_cpus=0, max_restarts=0,
                                           resources=self.placement.resources(kind)).remote(*args)

        try:
            return create(name)
        except ray.exceptions.ActorAlreadyExistsError as exc:
            if replacing:
                return create(f"{name}~{replacing}")
            raise RuntimeError(f"{exc} (another stack with namespace {self.config.namespace!r} on this "
                               f"Ray cluster? Give this one another `namespace`)") from None

    def _start_redis(self) -> None:
        import ray

        if self.config.cluster_token is None:  # Redis's password; Stack.start would make it later
            self.config = dataclasses.replace(self.config, cluster_token=secrets.token_urlsafe(32))
        actor = self._redis_actor = self._create(RedisHost, "redis", "redis", self.config.host,
                                                 self.config.cluster_token)
        try:
            url, self.redis_placement = ray.get(actor.start.remote(), timeout=REDIS_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"Redis's actor was not placed in {REDIS_START_TIMEOUT_S:.0f} s (resources "
                               f"{self.placement.resources('redis') or 'none'})") from None
        except ray.exceptions.RayError as exc:
            raise RuntimeError(f"Redis's actor failed: {exc}") from exc
        p = self.redis_placement
        log.info("redis runs on node %s (Ray node %s): pid %d, log %s", p.node_ip, p.node_id[:12], p.pid, p.log_path)
        self.config = dataclasses.replace(self.config, redis_url=url)

    def _spawn(self, sp: ServiceProcess, restart: bool = False) -> None:
        note = f"restart {len(sp.runs)} of {sp.name}" if restart else None
        if isinstance(sp.proc, ActorProcess) and not sp.proc.actor_died:
            sp.proc.restart(note)  # the actor outlived its process: the new one runs there too
        else:
            if not self._config_yaml:  # the configuration is complete (Redis URL, token) by the first spawn
                self._config_yaml = yaml.safe_dump(self.config.to_dict())
            handle = self._create(ServiceHost, sp.name, sp.command[0], sp.name, sp.command, self._config_yaml,
                                  self.config.host, replacing=len(sp.runs))
            self._actors.append(handle)
            sp.proc = ActorProcess(sp.name, handle, note)
        sp.started_at = time.monotonic()

    def wait_healthy(self, timeout_s: float) -> None:
        try:
            super().wait_healthy(timeout_s)
        except TimeoutError:
            pending = [f"{sp.name} ({self.placement.resources(sp.command[0]) or 'no resource'})"
                       for sp in self.processes if isinstance(sp.proc, ActorProcess) and sp.proc.placement is None]
            waiting = f"; Ray has not placed {', '.join(pending)}" if pending else ""
            raise TimeoutError(f"the stack did not become healthy in {timeout_s:.0f} s{waiting}; each service's "
                               f"log is on its node (the lines above say where)") from None

    def log_tail(self, name: str, lines: int = 30) -> str:
        for sp in self.processes:
            if sp.name == name and isinstance(sp.proc, ActorProcess):
                return sp.proc.log_tail(lines)
        return "(no log)"

    def stop(self, timeout_s: float = 20.0) -> None:
        """The launcher's ordered stop of the services, then every actor ended (each
        removes its node's directory first), Redis's last, and the driver disconnected."""
        import ray

        try:
            super().stop(timeout_s)
        finally:
            actors, self._actors = self._actors, []
            redis, self._redis_actor = self._redis_actor, None
            for handle in actors + ([redis] if redis is not None else []):
                # Already dead, or its node unreachable: killing it is all that is left.
                with contextlib.suppress(ray.exceptions.RayError):
                    ray.get(handle.close.remote(), timeout=CALL_TIMEOUT_S)
                ray.kill(handle)
            if ray.is_initialized():
                ray.shutdown()
