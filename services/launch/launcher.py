"""Starting and stopping the whole stack as separate processes (`lamina up`).

The launcher owns the embedded Redis (when no Redis URL is configured) and
every service process. Start order: Redis, attention workers, model and
prefill workers, scheduler, gateway; each service finds the ones it needs
through the metadata store. Stop order is the reverse, gateway first, so no
request arrives at a service that is already gone.

Supervision (`supervise=True`, what `lamina up` uses): once the stack is healthy, a
thread owned by the Stack restarts a service process that exits, with the same argv,
after the delay `lamina.services.launch.supervision.decide` returns; it gives up on a service that
keeps crashing and sets `given_up`, and then restarts nothing more. `stop()` ends
supervision before it stops any process, so a stop never races with a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import http.client
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar, Protocol

import yaml

from lamina.kvstore.metadata import REDIS_ERRORS, MetadataConfig, MetadataStore
from lamina.kvstore.redis_server import EmbeddedRedis
from lamina.lifetime import child_env, spawn_logged
from lamina.model.checkpoints import resolve_checkpoint
from lamina.ports import bind_error
from lamina.services import stack_dumps
from lamina.services.config import StackConfig
from lamina.services.kv_budget import with_kv_budget
from lamina.services.launch import local_stacks
from lamina.services.launch.forker import Forker, ForkerGone
from lamina.services.launch.supervision import GiveUp, RestartPolicy, Run, decide, describe_exit

log = logging.getLogger(__name__)


# How often the supervisor looks for exited processes. Popen offers no wait on "any of
# these children"; polling a handful of processes twice a second costs nothing.
SUPERVISE_POLL_S = 0.5
# A restart that fails to start anything (e.g. Ray still holds a dead actor's name, or
# its node is not placed yet) is tried again this much later, not given up on.
RESTART_RETRY_S = 2.0


def health_ok(base_url: str, timeout_s: float = 2.0) -> bool:
    """Whether the HTTP server at `base_url` answers GET /health with 200 now."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=timeout_s) as r:
            return r.status == 200
    # Refused, reset, timed out, an HTTP error status (URLError, HTTPError: OSErrors), or a
    # reply that is not HTTP (HTTPException: something else holds the port).
    except (OSError, http.client.HTTPException):
        return False


class ProcessHandle(Protocol):
    """What the stack uses of a service's process: a `subprocess.Popen`, or a Ray
    actor's process (lamina.services.launch.ray_stack.ActorProcess)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


@dataclasses.dataclass
class ServiceProcess:
    name: str  # its log file's name (attention-0, prefill-0, scheduler, ...)
    argv: list[str]
    proc: ProcessHandle | None = None
    service_id: str = ""  # its id in the metadata store (attention-0, prefill-0, ...)
    started_at: float = 0.0  # time.monotonic() when the current process started
    runs: list[Run] = dataclasses.field(default_factory=list)  # its processes that exited, oldest first
    command: list[str] = dataclasses.field(default_factory=list)  # its `lamina` arguments: argv less the
    # interpreter and --config (a launcher on other hosts builds its own argv from them)


def service_commands(config: StackConfig) -> list[tuple[str, str, list[str]]]:
    """(name, id in the metadata store, `lamina` arguments) of every service, in start order."""
    # Colocated: each model worker runs its attention worker in its own process.
    names = [] if config.colocated else [(f"attention-{i}", f"attention-{i}", ["attention", "--index", str(i)])
                                         for i in range(config.attention.workers)]
    names += [(f"model-{i}", f"model-{i}", ["model", "--index", str(i)]) for i in range(config.model_worker.workers)]
    names += [(f"prefill-{i}", f"prefill-{i}", ["prefill", "--index", str(i)]) for i in range(config.prefill.workers)]
    return names + [(name, f"{name}-0", [name]) for name in ("scheduler", "gateway")]


def stop_stages(processes: list[ServiceProcess]) -> list[list[ServiceProcess]]:
    """The order a stack stops in: the gateway first (no new requests come in), then the
    scheduler (it would take the workers' exits for failures and rebuild), then every
    worker at once (each takes about a second to drain and exit; one after another, a
    stack of six took six)."""
    def stage(sp: ServiceProcess) -> int:
        return {"gateway": 0, "scheduler": 1}.get(sp.name, 2)

    return [[sp for sp in processes if stage(sp) == n] for n in range(3)]


@dataclasses.dataclass(frozen=True)
class GivenUp:
    process: ServiceProcess
    reason: str  # how it last exited and why the policy gave up


def gateway_port_taken(config: StackConfig) -> str | None:
    """Why the stack's gateway could not listen on its port, naming the `lamina up` there if
    one is (None: the port is free, or 0). Checked before anything starts: another server
    there would answer the health checks of a stack whose own gateway cannot bind, and that
    stack would say it serves while its gateway kept exiting."""
    port = config.gateway.port
    error = bind_error(config.host, port) if port else None
    if error is None:
        return None
    if error.errno != errno.EADDRINUSE:  # an address not of this host, a privileged port, a name unknown
        return f"the gateway cannot listen on {config.host} port {port}: {error.strerror or error}"
    who = ""
    with contextlib.suppress(OSError, RuntimeError):  # the runtime directory's own errors: no name
        found = local_stacks.find(port)
        if found is not None:
            who = f", by a lamina up (`lamina status --port {port}` shows it)"
    return (f"port {port} on {config.host} is taken ({error.strerror or error}){who}: "
            f"choose another with --port, gateway.port or LAMINA_PORT")


def forget_token(cfg_path: Path, why: str) -> None:
    """Rewrite a stack's configuration file (as `Stack.start` wrote it) without its
    cluster token, saying `why` in a comment; nothing where the file is gone."""
    try:
        raw = yaml.safe_load(cfg_path.read_text())
    except FileNotFoundError:
        return
    if isinstance(raw, dict) and raw.get("cluster_token") is not None:
        raw["cluster_token"] = None
        cfg_path.write_text(f"# cluster_token removed when {why}\n" + yaml.safe_dump(raw))


class Stack:
    # Whether this class's services are forked from a forker on this host where the
    # configuration asks (a subclass that starts them elsewhere, such as RayStack, says no).
    forks_services: ClassVar[bool] = True

    def __init__(self, config: StackConfig, log_dir: Path | None = None, supervise: bool = False,
                 restart_policy: RestartPolicy = RestartPolicy(),  # noqa: B008 (frozen: one shared default is safe)
                 keep_logs: bool = False, env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.extra_env = dict(env or {})  # set in the services' environment, over this process's
        self.redis: EmbeddedRedis | None = None
        self.processes: list[ServiceProcess] = []
        # Private (0700): the stack's configuration file, which holds its token, and by
        # default the services' logs. `stop` removes it unless it holds the logs and
        # keep_logs is set or the start failed (its error names the logs there). Logs
        # in a `log_dir` of the caller's stay there.
        if log_dir is not None:
            log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # first: a refusal leaves nothing made
        self.work_dir = Path(tempfile.mkdtemp(prefix="lamina-stack-"))
        self.keep_logs = keep_logs
        self.log_dir = log_dir or self.work_dir
        self.supervise = supervise
        self.restart_policy = restart_policy
        self.given_up: GivenUp | None = None  # set by the supervisor when it gives up on a service
        self._env: dict[str, str] = {}
        self._argv: tuple[list[str], list[str]] = ([], [])  # (python -m lamina.cli, --config FILE): start()
        self._supervisor: threading.Thread | None = None
        self._stop_supervising = threading.Event()
        self._supervisor_idle = threading.Event()  # set when it will start no more processes
        self._supervisor_release = threading.Event()  # set by stop() once every process is stopped
        self._forker: Forker | None = None  # with config.fork_services: started at the first spawn
        self._forker_lock = threading.Lock()

    @property
    def forker_pid(self) -> int | None:
        """The pid of the process its services are forked from (None: none runs)."""
        forker = self._forker
        return forker.proc.pid if forker is not None and forker.alive else None

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.config.gateway.port}"

    def start(self, timeout_s: float = 300.0) -> None:
        """Start everything and wait until the gateway answers /health (RuntimeError before
        anything starts where the gateway could not listen on its port: `gateway_port_taken`)."""
        try:
            local_stacks.runtime_dir()  # where it will be found: refused (UnsafeDirectory) before anything starts
            taken = self._gateway_port_taken()
            if taken is not None:
                raise RuntimeError(taken)
            # The services end with this process.
            self._env = child_env({**os.environ, "PYTHONUNBUFFERED": "1", **self.extra_env})
            self._running_forker()  # its imports run while the checkpoint and Redis are readied
            # Convert the checkpoint once here, so the services do not race to do it.
            resolve_checkpoint(self.config.model)
            # Auto KV on a GPU counted over every service this host runs, once, for all of them
            # (ConfigError, before anything starts, where the GPU leaves it no room).
            self.config, _ = with_kv_budget(self.config)
            if not self.config.redis_url:
                self._start_redis()
            if self.config.cluster_token is None:  # every service authenticates its peers with it (docs/security.md)
                self.config = dataclasses.replace(self.config, cluster_token=secrets.token_urlsafe(32))
            cfg_path = self.work_dir / "stack.yaml"  # in a 0700 directory: it holds the token
            cfg_path.write_text(yaml.safe_dump(self.config.to_dict()))
        except BaseException:
            # No service started, none logged: Redis stops and the directory goes even
            # where the caller asked to keep the logs (there are none to keep).
            if self.redis is not None:
                self.redis.close()
                self.redis = None
            self._close_forker()
            shutil.rmtree(self.work_dir, ignore_errors=True)
            raise
        self._argv = ([sys.executable, "-m", "lamina.cli"], ["--config", str(cfg_path)])
        base, common = self._argv
        try:
            for name, service_id, command in service_commands(self.config):
                sp = ServiceProcess(name, base + command + common, service_id=service_id, command=command)
                self._spawn(sp)
                self.processes.append(sp)
            self.wait_healthy(timeout_s)
            local_stacks.publish(self.config.gateway.port, cfg_path)  # `lamina status --port` finds it
            if self.supervise:
                self._supervisor = threading.Thread(target=self._supervise, name="lamina-supervisor", daemon=True)
                self._supervisor.start()
        except BaseException:
            self.keep_logs = True  # the error (or the caller) points at them
            self.stop()
            raise

    def _gateway_port_taken(self) -> str | None:
        """Why the gateway could not listen on its port here (None: it could): the gateway
        runs on this host (a launcher whose services run elsewhere checks nothing here)."""
        return gateway_port_taken(self.config)

    def _start_redis(self) -> None:
        """Start the stack's own Redis and point the configuration at it."""
        # In the stack's directory: a launcher killed outright leaves one directory, not two.
        self.redis = EmbeddedRedis(directory=self.work_dir / "redis").start()
        self.config = dataclasses.replace(self.config, redis_url=self.redis.url)

    def _spawn(self, sp: ServiceProcess, restart: bool = False) -> None:
        """Start `sp`'s process; a restart continues its log after a marker line. Forked
        from the stack's forker where config.fork_services is set (its modules imported
        once, lamina.services.launch.forker), else, or where no forker could start, a
        fresh interpreter."""
        note = f"restart {len(sp.runs)} of {sp.name}" if restart else None
        log_path = self.log_dir / f"{sp.name}.log"
        forker = self._running_forker()
        proc: ProcessHandle | None = None
        if forker is not None:
            try:
                proc = forker.spawn(sp.name, sp.argv[len(self._argv[0]):], log_path, note)
            except ForkerGone as exc:
                log.warning("%s starts in a fresh interpreter: %s", sp.name, exc)
        sp.proc = proc if proc is not None else spawn_logged(sp.argv, log_path, self._env, note)
        sp.started_at = time.monotonic()

    def _running_forker(self) -> Forker | None:
        """The stack's forker, started (again, if the last one exited) where the
        configuration asks for one; None where it does not or where it cannot start."""
        # Linux only: elsewhere (macOS) forking a process that loaded these libraries is not
        # safe, and pidfds and PR_SET_PDEATHSIG do not exist.
        if not (self.forks_services and self.config.fork_services and sys.platform.startswith("linux")):
            return None
        with self._forker_lock:
            if self._forker is not None and not self._forker.alive:
                if not self._forker.ever_ready:  # it could not import what it preloads: fresh interpreters
                    return None
                log.warning("the forker exited (code %s); starting another", self._forker.proc.poll())
                self._forker.close()
                self._forker = None
            if self._forker is None:
                try:
                    self._forker = Forker(self._env, self.log_dir / "forker.log",
                                          config_path=self.work_dir / "stack.yaml")
                except (ForkerGone, OSError) as exc:
                    log.warning("no forker (%s): services start in fresh interpreters", exc)
            return self._forker

    def _close_forker(self) -> None:
        with self._forker_lock:
            if self._forker is not None:
                self._forker.close()
                self._forker = None

    def wait_healthy(self, timeout_s: float) -> None:
        """Return once the gateway answers /health; raise if a service process has exited
        meanwhile (not restarted yet) or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = self.dead_process()
            if dead is not None:
                assert dead.proc is not None  # dead_process names a started process
                raise RuntimeError(f"service {dead.name} exited with code {dead.proc.returncode} during start;"
                                   f" its log:\n{self.log_tail(dead.name)}")
            if health_ok(self.base_url):
                return
            time.sleep(0.5)  # polling another process's HTTP port: there is no event to wait on
        raise TimeoutError(f"the stack did not become healthy in {timeout_s:.0f} s; logs in {self.log_dir}")

    def dead_process(self) -> ServiceProcess | None:
        for sp in self.processes:
            if sp.proc is not None and sp.proc.poll() is not None:
                return sp
        return None

    def _stacks_of(self, sp: ServiceProcess, wait_s: float = 1.0) -> str:
        """Ask a service that will not stop for its task and thread stacks
        (services/stack_dumps.py) and return what it wrote to its log meanwhile."""
        proc = sp.proc
        assert proc is not None, f"{sp.name} was never started"
        path = self.log_dir / f"{sp.name}.log"
        start = path.stat().st_size if path.is_file() else 0
        for sig in (stack_dumps.TASKS_SIGNAL, stack_dumps.THREADS_SIGNAL):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait_s)  # it writes them meanwhile (or exits after all)
        if not path.is_file():  # a log on another node (RayStack): its last lines
            return self.log_tail(sp.name, lines=80)
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(64 * 1024).decode(errors="replace")

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.log_dir / f"{name}.log"
        if not path.is_file():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # ---- supervision (its own thread) ----

    def _supervise(self) -> None:
        """Restart exited services until stop() or a give-up. The processes this thread
        starts get SIGTERM when it ends (PR_SET_PDEATHSIG follows the thread that forked,
        lamina/lifetime.py), so it ends only after stop() has stopped them."""
        try:
            self._count_restart(None)  # a stack starts at zero restarts (an external Redis may hold old counts)
            due: dict[str, float] = {}  # name -> when its restart is due (monotonic)
            while not self._stop_supervising.wait(SUPERVISE_POLL_S):
                now = time.monotonic()
                for sp in self.processes:
                    if sp.name in due:
                        if now >= due[sp.name]:
                            del due[sp.name]
                            try:
                                self._restart(sp)
                            except Exception:
                                log.exception("restarting %s failed; trying again in %.0f s", sp.name,
                                              RESTART_RETRY_S)
                                due[sp.name] = now + RESTART_RETRY_S
                        continue
                    code = sp.proc.poll() if sp.proc is not None else None
                    if code is None:
                        continue
                    sp.runs.append(Run(sp.started_at, now))
                    decision = decide(self.restart_policy, sp.runs, now)
                    if isinstance(decision, GiveUp):
                        log.error("%s exited with %s; giving up on it (%s)", sp.name, describe_exit(code),
                                  decision.reason)
                        self.given_up = GivenUp(sp, f"{describe_exit(code)}; {decision.reason}")
                        return
                    log.warning("%s exited with %s; restart %d in %.1f s", sp.name, describe_exit(code),
                                len(sp.runs), decision.delay_s)
                    due[sp.name] = now + decision.delay_s
        except Exception:
            log.exception("supervision failed; no service will be restarted")
        finally:
            self._supervisor_idle.set()
            self._supervisor_release.wait()

    def add(self, name: str, command: list[str], service_id: str = "") -> None:
        """Start one more service process with the stack's configuration, e.g. an attention
        worker joining an elastic pool (`["attention", "--index", "2"]` under
        attention.max_workers); it is stopped with the others."""
        if any(sp.name == name for sp in self.processes):
            raise ValueError(f"the stack already has a service named {name}")
        base, common = self._argv
        sp = ServiceProcess(name, base + command + common, service_id=service_id, command=command)
        self._spawn(sp)
        self.processes.append(sp)

    def restart(self, name: str) -> None:
        """Start service process `name` (e.g. prefill-0) again after it ended or was killed,
        as the supervisor would; the new process is stopped with the others."""
        (sp,) = [p for p in self.processes if p.name == name]
        if sp.proc is not None and sp.proc.poll() is None:
            raise RuntimeError(f"{name} is still running (pid {sp.proc.pid})")
        self._restart(sp)

    def _restart(self, sp: ServiceProcess) -> None:
        self._spawn(sp, restart=True)
        self._count_restart(sp.service_id)

    def _count_restart(self, service_id: str | None) -> None:
        """Count one restart of `service_id` in the metadata store (None: reset every count)."""
        url = self.config.redis_url
        assert url is not None, "start() points the configuration at a Redis"

        async def update() -> None:
            async with MetadataStore(MetadataConfig(url=url, namespace=self.config.namespace)) as s:
                await (s.reset_restart_counts() if service_id is None else s.count_restart(service_id))

        try:
            asyncio.run(update())
        except REDIS_ERRORS as exc:  # the restart itself matters more than its count
            log.warning("could not update the restart count of %s: %s", service_id or "every service", exc)

    def stop(self, timeout_s: float = 20.0) -> None:
        """End supervision, then SIGTERM the services in stop_stages' order, each stage's
        together; SIGKILL what has not exited in time."""
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None:
            self._stop_supervising.set()
            self._supervisor_idle.wait()  # a restart under way finishes; none starts after it
        local_stacks.withdraw(self.config.gateway.port, self.work_dir / "stack.yaml")
        for stage in stop_stages(self.processes):
            running = [sp for sp in stage if sp.proc is not None and sp.proc.poll() is None]
            for sp in running:
                assert sp.proc is not None
                sp.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for sp in running:
                assert sp.proc is not None
                try:
                    sp.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s; killing it. What it was doing:\n%s", sp.name, timeout_s,
                                self._stacks_of(sp))
                    sp.proc.kill()
                    sp.proc.wait()
        self.processes.clear()
        self._close_forker()
        if supervisor is not None:
            self._supervisor_release.set()
            supervisor.join()
        if self.redis is not None:
            self.redis.close()  # stops it and removes its directory
            self.redis = None
        if not self.keep_logs or self.log_dir != self.work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        else:
            self._forget_token()

    def _forget_token(self) -> None:
        """The kept configuration file without the cluster token: the logs outlive the
        stack, its secret does not (a stopped stack's token opens nothing, but a later
        stack given the same file would reuse it)."""
        forget_token(self.work_dir / "stack.yaml", "the stack stopped")

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
