"""deploy/compose/ run for real under podman: the images built by build-offline.sh, the
stack brought up by podman-compose, its containers inspected, killed and removed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from lamina.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
PROJECT = "laminatest"  # fixed, so that the model-cache volume (the converted checkpoint) is reused
TOOLS = ("podman", "podman-compose", "debootstrap")


def missing_requirements() -> str | None:
    """Why the stack cannot run here (None: it can)."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"{', '.join(missing)} not installed (.ci/run installs Debian's podman, podman-compose, debootstrap "
                f"and runc as root)")
    if os.geteuid() != 0:
        return "building the base image (debootstrap) and running podman here need root"
    return None


def _interpolate(value: str, env: dict[str, str]) -> str:
    """A compose value with ${VAR:-default} replaced as compose does."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m[1]) or m[2], str(value))


def run(*args: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None,
        cwd: Path = COMPOSE_DIR) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-3000:]}")
    return result


def build_images() -> dict[str, str]:
    """Runs build-offline.sh; the variables it prints (LAMINA_IMAGE, REDIS_IMAGE, ...)."""
    result = run(str(COMPOSE_DIR / "build-offline.sh"), timeout=1500)
    return dict(line.split("=", 1) for line in result.stdout.splitlines() if re.fullmatch(r"[A-Z_]+=\S+", line))


@dataclass
class ComposeStack:
    env: dict[str, str]  # the environment podman-compose runs with (images, ports)
    services: list[str]  # the services started
    left_out: dict[str, str]  # service -> why it was not started
    api_key: str

    @property
    def url(self) -> str:
        """The gateway, through the port it is published on."""
        return f"http://127.0.0.1:{self.env['LAMINA_PORT']}"

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.env['PROMETHEUS_PORT']}"

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return run("podman-compose", "-p", PROJECT, "-f", "compose.yaml", *args, timeout=timeout, env=self.env)

    def containers(self, service: str) -> list[str]:
        """The names of `service`'s containers (one per replica), in replica order."""
        out = run("podman", "ps", "-a", "--filter", f"label=io.podman.compose.project={PROJECT}", "--filter",
                  f"label=com.docker.compose.service={service}", "--format", "{{.Names}}").stdout
        return sorted(out.split())

    def inspect(self, container: str) -> dict:
        return json.loads(run("podman", "inspect", container).stdout)[0]

    def kill(self, container: str) -> int:
        """SIGKILLs the container's main process from the host, as a crash would end it
        (`podman kill` would count as stopping it by hand). Returns the pid killed."""
        pid = self.inspect(container)["State"]["Pid"]
        os.kill(pid, signal.SIGKILL)
        return pid

    def healthy(self, container: str) -> bool:
        """Runs the container's health check now (podman schedules it with systemd timers,
        which this machine has not got)."""
        return run("podman", "healthcheck", "run", container, check=False, timeout=60).returncode == 0

    def redis(self, *args: str) -> str:
        (container,) = self.containers("redis")
        return run("podman", "exec", container, "redis-cli", *args).stdout

    def claims(self, section: str) -> dict[int, str]:
        """index -> holder (host name:pid) of `--index auto` claims (services/attention/index_claims.py)."""
        keys = self.redis("--scan", "--pattern", f"lamina:index:{section}:*").split()
        return {int(key.rsplit(":", 1)[1]): self.redis("get", key).strip() for key in keys}


def remove_project() -> None:
    """Every container, pod and network of the project, whatever state a run left them
    in (a restart policy may restart a container while `down` stops the others)."""
    ids = run("podman", "ps", "-aq", "--filter", f"label=io.podman.compose.project={PROJECT}", check=False).stdout
    if ids.split():
        run("podman", "rm", "-f", "-t", "0", *ids.split(), check=False, timeout=180)
    run("podman", "network", "rm", "-f", f"{PROJECT}_default", check=False)


def start(images: dict[str, str]) -> ComposeStack:
    """podman-compose up -d of every service whose image is here (the others are named in
    `left_out`), on free ports, with the secrets make-secrets.sh makes."""
    remove_project()  # what an interrupted run may have left
    run(str(COMPOSE_DIR / "make-secrets.sh"))
    env = {**os.environ, **images, "LAMINA_PORT": str(free_port()), "PROMETHEUS_PORT": str(free_port())}
    compose = yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())
    services, left_out = [], {}
    for name, service in compose["services"].items():
        image = _interpolate(service["image"], env)
        if run("podman", "image", "exists", image, check=False).returncode == 0:
            services.append(name)
        else:
            left_out[name] = f"its image {image} is not on this machine and no registry is reachable"
    stack = ComposeStack(env, services, left_out, (COMPOSE_DIR / "secrets" / "api_key").read_text().strip())
    stack.compose("up", "-d", "--no-build", *services)
    return stack


def stop(stack: ComposeStack | None) -> None:
    """podman-compose down (containers and network; the model-cache volume is kept), then
    whatever it left."""
    try:
        if stack is not None:
            stack.compose("down", "-t", "5", timeout=300)
    finally:
        remove_project()


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(interval_s)  # containers' state changes announce themselves to no one here
