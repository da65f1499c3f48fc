"""Service processes forked from one that imported their modules once.

A fresh interpreter for each service spends seconds of CPU importing torch and the
service's own modules before it does anything (about 2 s each for the model, prefill and
attention workers on an idle 2-core host, more on a busy one): a stack of six services
paid it six times at every start and again at every restart. The launcher instead starts
one forker: a process that imports those modules (`PRELOAD`) and then forks each service
from itself on request, so a service starts with them already imported, as `python -m
lamina.cli SERVICE ...` would after its imports.

Forking after these imports is safe because nothing has run yet that a fork breaks: the
forker computes nothing, starts no thread of its own (the one it may hold is OpenBLAS's
pool, which shuts down across a fork), touches no CUDA device and opens no connection.
Each child then starts as a service does: its own session, its output in its log file,
the stack's environment, a command line that names it (`lamina model --index 0 ...`, as
ps shows it), SIGTERM when its parent (the forker) dies. The forker gets SIGTERM when
the launcher dies (lamina/lifetime.py), and then, as when the launcher's end of their
socket closes without a word, stops its services, waits for them and takes the cluster
token out of the stack's configuration file: the cleaning up a launcher killed outright
could not do.

The launcher talks to the forker over a socket pair, one JSON object a line: `Spawn`
requests and a last `Close` one way; the pid of each process forked and each exit with its
code the other (the forker reaps its children, so only it can read their codes).
`ForkedProcess` gives the launcher what it uses of a `subprocess.Popen`; its signals go
through a pidfd, so a signal never reaches a later process that got the same pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
import json
import logging
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from lamina.lifetime import PARENT_ENV, die_with_parent, open_log

log = logging.getLogger(__name__)

# What each service imports before it serves: torch for the workers, the services' own
# modules (gRPC, aiohttp, Redis, the model), and the tokenizer's backend. "module:attr"
# imports the module and reads the attribute (transformers loads that class lazily).
PRELOAD = (
    "torch",
    "lamina.services.attention.attention_service",
    "lamina.services.model.model_service",
    "lamina.services.prefill.prefill_service",
    "lamina.services.scheduler.scheduler_service",
    "lamina.services.gateway.gateway_service",
    "transformers:TokenizersBackend",
    "setproctitle",
    *(f"lamina.commands.{name}" for name in ("attention", "model", "prefill", "scheduler", "gateway")),
)
_PR_SET_NAME = 15
READY_TIMEOUT_S = 120.0  # the preload on a busy host: seconds, far less than a stack's start timeout
REQUEST_TIMEOUT_S = 30.0  # a spawn's answer: a fork takes milliseconds
END_GRACE_S = 20.0  # its children's drain when the launcher is gone, as Stack.stop's


# ---- the messages, one JSON object a line: {"kind": CLASS NAME, FIELD: VALUE, ...} ----


@dataclasses.dataclass(frozen=True)
class Spawn:
    """Launcher -> forker. Fork a service: `args` are its `lamina` arguments (`["model",
    "--index", "0", ...]`), its output goes to the end of `log_path` (which the launcher has
    made), it works in `cwd`."""

    request: int
    name: str  # the process's name (its comm, what ps -o comm and top show): attention-0, gateway, ...
    args: list[str]
    log_path: str
    cwd: str


@dataclasses.dataclass(frozen=True)
class Close:
    """Launcher -> forker, last: the launcher has stopped the services itself; exit."""


@dataclasses.dataclass(frozen=True)
class Ready:
    """Forker -> launcher, first: its imports are done (`failed`: those that raised)."""

    failed: list[str]
    threads: int  # its threads as it forks (1, or 2 with OpenBLAS's idle pool)


@dataclasses.dataclass(frozen=True)
class Spawned:
    """Forker -> launcher: the answer to `Spawn` `request`, the child's pid or why none."""

    request: int
    pid: int | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Exited:
    """Forker -> launcher: a child has exited (a Popen-style code: -N for signal N)."""

    pid: int
    code: int


Message = Spawn | Close | Ready | Spawned | Exited
_KINDS: dict[str, type[Message]] = {cls.__name__: cls for cls in (Spawn, Close, Ready, Spawned, Exited)}


def encode(message: Message) -> bytes:
    return json.dumps({"kind": type(message).__name__, **dataclasses.asdict(message)}).encode() + b"\n"


def decode(line: bytes) -> Message:
    fields = json.loads(line)
    return _KINDS[fields.pop("kind")](**fields)


def _send(sock: socket.socket, message: Message) -> None:
    sock.sendall(encode(message))


@dataclasses.dataclass
class _Pending:
    """A `Spawn` waiting for its `Spawned`: the process, or why there is none."""

    args: list[str]
    answered: threading.Event = dataclasses.field(default_factory=threading.Event)
    process: ForkedProcess | None = None
    error: str | None = None


class ForkerGone(RuntimeError):
    """The forker has exited (or never became ready): start another one."""


class ForkedProcess:
    """A service forked by the forker: pid, returncode, poll, wait, send_signal, terminate
    and kill, as a `subprocess.Popen` has them (lamina.services.launch.launcher.ProcessHandle)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._exited = threading.Event()
        self._pidfd_lock = threading.Lock()  # signals (any thread) against its close (the reader's)
        self._pidfd: int | None = None
        with contextlib.suppress(OSError):  # gone already: its exit report is on its way
            self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._pidfd_lock, contextlib.suppress(ProcessLookupError):
            if self.returncode is not None:
                return  # as Popen: no signal to a process already reaped
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def exited(self, code: int) -> None:
        with self._pidfd_lock:
            self.returncode = code
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        self._exited.set()

    def wait_gone(self, timeout_s: float) -> bool:
        """Whether the process has ended within timeout_s (read from its pidfd: for a
        process whose forker is gone and can no longer report it)."""
        if self._pidfd is None:
            return True
        ready, _, _ = select.select([self._pidfd], [], [], timeout_s)
        return bool(ready)


class Forker:
    """The launcher's end: starts the forker process, sends it `Spawn`s, and keeps each
    forked process's `ForkedProcess` up to date from a reader thread of its own.
    Thread-safe: a stack spawns from its start, its supervisor and its callers."""

    def __init__(self, env: Mapping[str, str], log_path: Path, preload: tuple[str, ...] = PRELOAD,
                 config_path: Path | None = None) -> None:
        """`config_path`: the stack's configuration file, whose cluster token the forker
        takes out if the launcher dies without stopping the stack."""
        ours, theirs = socket.socketpair()
        self._sock = ours
        self._lock = threading.Lock()  # one request at a time
        self._pending: dict[int, _Pending] = {}  # by request
        self._processes: dict[int, ForkedProcess] = {}
        self._requests = 0
        self._closing = False
        self._was_ready = False
        self._ready = threading.Event()
        self._gone = threading.Event()
        with open(log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lamina.services.launch.forker", str(theirs.fileno()),
                 *(["--config", str(config_path)] if config_path is not None else []),
                 *(preload if preload != PRELOAD else ())],  # the default left out: a short command line
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                env=dict(env), start_new_session=True)
        theirs.close()
        self.log_path = log_path
        self._reader = threading.Thread(target=self._read, name="lamina-forker-reader", daemon=True)
        self._reader.start()

    @property
    def ever_ready(self) -> bool:
        """Whether it finished its imports and answered (a forker that exits before that
        will not do better the next time)."""
        return self._was_ready

    @property
    def alive(self) -> bool:
        return not self._gone.is_set()

    def spawn(self, name: str, args: list[str], log_path: Path, note: str | None = None) -> ForkedProcess:
        """Fork service `name` (waiting for the forker's imports first, the first time)."""
        if not self._ready.wait(READY_TIMEOUT_S) or self._gone.is_set():
            raise ForkerGone(f"the forker is not running (exit code {self.proc.poll()}; its log: {self.log_path})")
        open_log(log_path, note).close()  # made here, as spawn_logged makes it: it exists when spawn returns
        with self._lock:
            self._requests += 1
            request = Spawn(self._requests, name, list(args), str(log_path), os.getcwd())
            pending = self._pending[request.request] = _Pending(request.args)
            try:
                _send(self._sock, request)
            except OSError as exc:
                raise ForkerGone(f"the forker cannot be reached: {exc}") from exc
            if not pending.answered.wait(REQUEST_TIMEOUT_S) or pending.process is None:
                raise ForkerGone(f"the forker did not fork {name}: {pending.error or 'no answer'}")
            return pending.process  # (perhaps exited already: its exit may be read before this thread wakes)

    def _read(self) -> None:
        """Answers and exit reports, until the forker's end of the socket closes."""
        buf = b""
        try:
            while True:
                data = self._sock.recv(65536)
                if not data:
                    break
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self._handle(decode(line))
        except OSError:
            pass  # closed by close()
        finally:
            self._gone.set()
            self._ready.set()
            for pending in list(self._pending.values()):
                pending.answered.set()
            self._orphaned()

    def _handle(self, message: Message) -> None:
        if isinstance(message, Ready):
            log.debug("forker ready: %s", message)
            self._was_ready = True
            self._ready.set()
        elif isinstance(message, Spawned):
            pending = self._pending.pop(message.request)
            if message.pid is not None:
                pending.process = self._processes[message.pid] = ForkedProcess(message.pid, pending.args)
            else:
                pending.error = message.error
            pending.answered.set()
        elif isinstance(message, Exited):
            # Never before its Spawned: the forker's one thread sends that right after the
            # fork, before it can reap the child.
            self._processes.pop(message.pid).exited(message.code)

    def _orphaned(self) -> None:
        """The forker has gone: its children got SIGTERM with it (their PR_SET_PDEATHSIG)
        and nobody can read their codes now; each counts as ended by SIGTERM once it has."""
        for pid, proc in list(self._processes.items()):
            if proc.returncode is None:
                if not self._closing:
                    log.warning("the forker exited; its service process %d ends with it (SIGTERM)", pid)
                proc.wait_gone(30.0)
                proc.exited(-signal.SIGTERM)
        self._processes.clear()

    def close(self, timeout_s: float = 10.0) -> None:
        """End the forker, after the stack has stopped its services (any still running get
        SIGTERM as it exits)."""
        self._closing = True
        with self._lock, contextlib.suppress(OSError):  # gone already: nothing to tell
            _send(self._sock, Close())
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout_s)
        self._sock.close()


# ---- the forker process ----


def _preload(names: list[str]) -> list[str]:
    """Import each of `names`; what fails is named in the log and left to the service,
    which imports it again and fails there as it would have."""
    failed = []
    for name in names:
        module, _, attr = name.partition(":")
        try:
            loaded = importlib.import_module(module)
            if attr:
                getattr(loaded, attr)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the service meets it again and says so
            print(f"forker: could not preload {name}: {type(exc).__name__}: {exc}", flush=True)
            failed.append(name)
    return failed


def _reported(sock: socket.socket, live: set[int], pid: int, status: int, quiet: bool = False) -> None:
    """Child `pid` was reaped with `status`: no longer live, and its exit sent (`quiet`:
    where the launcher still listens; it may be gone)."""
    live.discard(pid)
    try:
        _send(sock, Exited(pid, os.waitstatus_to_exitcode(status)))
    except OSError:
        if not quiet:
            raise


def _reap(sock: socket.socket, live: set[int], quiet: bool = False) -> None:
    """Reap every child that has exited, reporting each (`quiet`: as `_reported`)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reported(sock, live, pid, status, quiet)


def _name_process(name: str, args: list[str]) -> None:
    """Show this process as the service it is: its command line (ps -f, htop) as `lamina
    ARGS`, what a fresh interpreter's would have said after its interpreter and `-m`, and
    its name (comm: ps -o comm, top; at most 15 bytes) as `name`."""
    import setproctitle

    setproctitle.setproctitle(" ".join(["lamina", *args]))
    ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15] + b"\0", 0, 0, 0)


def _become_service(request: Spawn, env: Mapping[str, str], parent: int) -> None:
    """In a forked child: the session, output, directory and environment the service
    would have had from `spawn_logged`, and the forker as the parent it ends with."""
    os.setsid()
    _name_process(request.name, request.args)
    fd = os.open(request.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # made by the launcher
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(env)
    os.environ[PARENT_ENV] = str(parent)
    random.seed()  # each service its own sequence, as a fresh interpreter seeds it
    sys.argv = [sys.argv[0], *request.args]


def _end_children(sock: socket.socket, live: set[int], grace_s: float = END_GRACE_S) -> None:
    """SIGTERM every child, reap them as they drain and exit, SIGKILL what is left after
    grace_s (the launcher's own stop waits as long); each exit is reported where the
    launcher still listens."""
    # SIGCHLD held back, so that a child exiting between a reap and the wait is not missed:
    # sigtimedwait takes it from the pending ones.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    for pid in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while live:
        _reap(sock, live, quiet=True)
        if not live or time.monotonic() >= deadline:
            break
        signal.sigtimedwait({signal.SIGCHLD}, max(0.0, deadline - time.monotonic()))
    for pid in list(live):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            _reported(sock, live, *os.waitpid(pid, 0), quiet=True)


def serve(sock: socket.socket, env: Mapping[str, str], config_path: Path | None = None) -> list[str] | None:
    """The forker's loop: each child gets `env`. Returns in a forked child with the
    service's `lamina` arguments, and None when the launcher has closed it (`Close`) or is
    gone. A launcher is gone when the forker gets SIGTERM (the launcher's death, by
    PR_SET_PDEATHSIG, or anyone's) or its end of the socket closes without `Close` (which
    of the two comes first when it dies is not ordered): then every child is stopped and
    waited for, and the cluster token taken out of `config_path`, which a launcher killed
    outright could not."""
    me = os.getpid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select through wake_w
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))  # as SIGCHLD
    live: set[int] = set()  # children not reaped yet

    def orphaned() -> None:
        _end_children(sock, live)
        if config_path is not None:
            from lamina.services.launch.launcher import forget_token

            forget_token(config_path, "its launcher ended without stopping it")

    buf = b""
    try:
        while True:
            ready, _, _ = select.select([sock.fileno(), wake_r], [], [])
            if wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                if stopping:
                    orphaned()
                    return None
                _reap(sock, live)
            if sock.fileno() not in ready:
                continue
            data = sock.recv(65536)
            if not data:
                orphaned()
                return None
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                request = decode(line)
                if isinstance(request, Close):
                    return None
                assert isinstance(request, Spawn), request
                try:
                    pid = os.fork()
                except OSError as exc:
                    _send(sock, Spawned(request.request, error=f"fork failed: {exc}"))
                    continue
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a fresh interpreter's, until it serves
                    os.close(wake_r)
                    os.close(wake_w)
                    sock.close()
                    try:
                        _become_service(request, env, me)
                    except BaseException as exc:  # noqa: BLE001 - a child must never return into the forker's loop
                        # To its log where it got that far, else the forker's; exit code 127 either way.
                        with contextlib.suppress(OSError):
                            os.write(2, f"forker: could not start {request.name}: {exc!r}\n".encode())
                        os._exit(127)
                    return request.args
                live.add(pid)
                _send(sock, Spawned(request.request, pid))
    except OSError:  # the launcher's end broke: gone as well
        orphaned()
        return None


def main(argv: list[str]) -> int:
    """`python -m lamina.services.launch.forker FD [--config PATH] [MODULE...]` (started by
    `Forker`; no MODULE: `PRELOAD`)."""
    die_with_parent()  # the launcher's death ends the forker, whose death ends its services
    sock = socket.socket(fileno=int(argv[0]))
    argv = argv[1:]
    config_path = None
    if argv[:1] == ["--config"]:
        config_path, argv = Path(argv[1]), argv[2:]
    env = dict(os.environ)  # the stack's, as the services would have had it (before any import sets some)
    start = time.process_time()
    names = argv or list(PRELOAD)
    failed = _preload(names)
    threads = len(os.listdir("/proc/self/task"))  # Linux: the launcher forks services nowhere else
    print(f"forker: preloaded {len(names) - len(failed)} modules in {time.process_time() - start:.2f} s of CPU;"
          f" {threads} thread(s)", flush=True)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a child could not use the device
        print("forker: an import initialised CUDA, which a forked process cannot use; not forking", flush=True)
        return 1
    _send(sock, Ready(failed, threads))
    args = serve(sock, env, config_path)
    if args is None:
        return 0
    from lamina.cli import main as lamina_main

    return lamina_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
