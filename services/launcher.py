"""Starting and stopping the whole stack as separate processes (`lamina up`).

The launcher owns the embedded Redis (when no Redis URL is configured) and
every service process. Start order: Redis, attention workers, model and
prefill workers, scheduler, gateway; each service finds the ones it needs
through the metadata store. Stop order is the reverse, gateway first, so no
request arrives at a service that is already gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from kvstore.redis_server import EmbeddedRedis
from lamina.lifetime import child_env
from model.loader import resolve_checkpoint
from services.config import StackConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ServiceProcess:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None


class Stack:
    def __init__(self, config: StackConfig, log_dir: Path | None = None) -> None:
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.processes: list[ServiceProcess] = []
        self._dir = Path(tempfile.mkdtemp(prefix="lamina-stack-"))
        self.log_dir = log_dir or self._dir

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.config.gateway.port}"

    def start(self, timeout_s: float = 300.0) -> None:
        """Start everything and wait until the gateway answers /health."""
        # Convert the checkpoint once here, so the services do not race to do it.
        resolve_checkpoint(self.config.model)
        if not self.config.redis_url:
            self.redis = EmbeddedRedis().start()
            self.config = dataclasses.replace(self.config, redis_url=self.redis.url)
        if self.config.cluster_token is None:  # every service authenticates its peers with it (docs/security.md)
            self.config = dataclasses.replace(self.config, cluster_token=secrets.token_urlsafe(32))
        cfg_path = self._dir / "stack.yaml"  # in a 0700 directory: it holds the token
        cfg_path.write_text(yaml.safe_dump(self.config.to_dict()))
        base = [sys.executable, "-m", "lamina.cli"]
        common = ["--config", str(cfg_path)]
        names = [(f"attention-{i}", ["attention", "--index", str(i)]) for i in range(self.config.attention.workers)]
        names += [(f"model-{i}", ["model", "--index", str(i)]) for i in range(self.config.model_worker.workers)]
        names += [("prefill", ["prefill"]), ("scheduler", ["scheduler"]), ("gateway", ["gateway"])]
        env = child_env({**os.environ, "PYTHONUNBUFFERED": "1"})  # the services end with this process
        try:
            for name, argv in names:
                sp = ServiceProcess(name, base + argv + common)
                logf = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (owned by the child)
                sp.proc = subprocess.Popen(sp.argv, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True)
                logf.close()
                self.processes.append(sp)
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = self.dead_process()
            if dead is not None:
                raise RuntimeError(f"service {dead.name} exited with code {dead.proc.returncode} during start;"
                                   f" its log:\n{self.log_tail(dead.name)}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)  # polling another process's HTTP port: there is no event to wait on
        raise TimeoutError(f"the stack did not become healthy in {timeout_s:.0f} s; logs in {self.log_dir}")

    def dead_process(self) -> ServiceProcess | None:
        for sp in self.processes:
            if sp.proc is not None and sp.proc.poll() is not None:
                return sp
        return None

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.log_dir / f"{name}.log"
        if not path.is_file():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM each service, gateway first; SIGKILL what has not exited in time."""
        for sp in reversed(self.processes):
            if sp.proc is not None and sp.proc.poll() is None:
                sp.proc.send_signal(signal.SIGTERM)
                try:
                    sp.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s; killing it", sp.name, timeout_s)
                    sp.proc.kill()
                    sp.proc.wait()
        self.processes.clear()
        if self.redis is not None:
            self.redis.close()  # stops it and removes its directory
            self.redis = None

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
