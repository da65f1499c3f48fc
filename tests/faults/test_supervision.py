"""Supervision and `lamina status` on a real stack: a service process killed with SIGKILL
is restarted by its launcher (same argv, log appended, restart counted in Redis), shows
up in `lamina status --json` with a new pid, and the stack still answers a chat request."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest
from e2e_helpers import free_port, start_stack

from lamina.kvstore.metadata import MetadataConfig, MetadataStore
from lamina.services.launch.launcher import Stack
from lamina.services.launch.supervision import RestartPolicy

pytestmark = pytest.mark.timeout(600)

KINDS = {"attention", "model", "prefill", "scheduler", "gateway"}


@pytest.fixture(scope="module")
def stack():
    s = start_stack(workers=1, micro_batches=1, supervise=True)
    try:
        yield s
    finally:
        s.stop()


def lamina_status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lamina.cli", "status", *args], capture_output=True, text=True,
                          timeout=120)


def status_json(stack: Stack) -> dict:
    result = lamina_status("--json", "--port", str(stack.config.gateway.port))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def service(status: dict, name: str) -> dict:
    (entry,) = [s for s in status["services"] if s["name"] == name]
    return entry


def pid_of(stack: Stack, name: str) -> int:
    (sp,) = [sp for sp in stack.processes if sp.name == name]
    return sp.proc.pid


def test_status_json_shape(stack):
    status = status_json(stack)
    assert set(status) == {"services", "attention", "prefix_cache", "requests", "decode"}
    assert {s["kind"] for s in status["services"]} == KINDS
    assert [s["name"] for s in status["services"]] == ["attention-0", "model-0", "prefill-0", "scheduler-0",
                                                       "gateway-0"]
    for s in status["services"]:
        assert set(s) == {"kind", "name", "index", "pid", "host", "endpoint", "grpc", "healthy", "restarts", "device"}
        # Where each compute service computes, as it opened its device; the others compute nothing.
        assert s["device"] == ("cpu" if s["kind"] in ("attention", "model", "prefill") else None), s
        assert s["healthy"] is True and s["restarts"] == 0 and s["index"] == 0
        assert isinstance(s["host"], str) and s["endpoint"]
        # Every gRPC service's control-plane address beside its data-plane endpoint.
        assert s["kind"] == "gateway" or s["grpc"].startswith(f"{stack.config.host}:"), s
    assert service(status, "attention-0")["pid"] == pid_of(stack, "attention-0")
    assert service(status, "gateway-0")["pid"] == pid_of(stack, "gateway")
    (occupancy,) = status["attention"]
    assert occupancy["name"] == "attention-0" and occupancy["error"] is None
    assert occupancy["num_sequences"] == 0 and occupancy["capacity_tokens"] > 0
    assert (occupancy["sequences"], occupancy["used_tokens"]) == (0, 0)
    (cache,) = status["prefix_cache"]
    assert cache["name"] == "prefill-0" and set(cache["tiers"]) == {"device", "host", "disk"}
    assert status["requests"] == {"running": 0, "waiting": 0}
    assert set(status["decode"]) == {"steps", "mean_batch_size"} and status["decode"]["steps"] >= 0
    # The table names the same services.
    table = lamina_status("--port", str(stack.config.gateway.port))
    assert table.returncode == 0, table.stderr
    assert "prefill-0" in table.stdout and "requests: 0 running, 0 waiting" in table.stdout
    assert table.stdout.splitlines()[0].split()[:6] == ["KIND", "NAME", "INDEX", "HOST", "PID", "DEVICE"]


def test_a_reader_without_the_cluster_token_is_told_how_to_give_it(stack):
    """`--redis-url` alone finds the services but not the cluster token: the table shows what
    the metadata store holds, the calls the services refused are named by their code, and
    lamina status says how to give the token and exits 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAMINA_") and k != "REDIS_URL"}
    env["LAMINA_NAMESPACE"] = stack.config.namespace
    result = subprocess.run([sys.executable, "-m", "lamina.cli", "status", "--redis-url", stack.config.redis_url],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1, result.stderr
    assert "attention-0  unavailable: UNAUTHENTICATED" in result.stdout, result.stdout
    assert "requests: unknown (the scheduler did not answer: UNAUTHENTICATED)" in result.stdout
    assert result.stderr.startswith("lamina status: the cluster refused this cluster token (UNAUTHENTICATED)")
    assert "--config" in result.stderr and "LAMINA_CLUSTER_TOKEN" in result.stderr


def test_no_cluster_is_an_error():
    result = lamina_status("--json", "--port", str(free_port()))
    assert result.returncode == 1
    assert "no cluster found" in result.stderr and not result.stdout


async def _kill_and_await_registration(stack: Stack, name: str, service_id: str) -> None:
    """SIGKILL `name` and return once its new process has registered (metadata events)."""
    async with MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace)) as store:
        async with store.subscribe() as events:
            os.kill(pid_of(stack, name), signal.SIGKILL)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 240
            while loop.time() < deadline:
                event = await events.next_event(timeout_s=deadline - loop.time())
                if event and event["type"] == "service_registered" and event["id"] == service_id:
                    return
    raise AssertionError(f"{service_id} was not registered again")


def test_killed_service_is_restarted(stack):
    old_pid = pid_of(stack, "prefill-0")
    asyncio.run(_kill_and_await_registration(stack, "prefill-0", "prefill-0"))
    assert pid_of(stack, "prefill-0") != old_pid and stack.given_up is None
    # Registration comes just before the health service says SERVING: ask again if needed.
    for _ in range(20):
        status = status_json(stack)
        if service(status, "prefill-0")["healthy"]:
            break
    entry = service(status, "prefill-0")
    assert entry["healthy"] and entry["pid"] == pid_of(stack, "prefill-0") != old_pid
    assert entry["restarts"] == 1
    assert all(s["restarts"] == 0 for s in status["services"] if s["name"] != "prefill-0")
    log_text = (stack.log_dir / "prefill-0.log").read_text(errors="replace")
    first, _, after = log_text.partition("--- lamina: restart 1 of prefill-0 ---")
    assert first and after  # the restarted process appended to the log of the first

    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=240)
    try:
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "What is the capital of France?"}])
    finally:
        client.close()
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0


def test_gives_up_on_a_service_that_keeps_exiting(stack):
    # With max_exits=1 the first exit within the window is already one too many.
    stack.restart_policy = RestartPolicy(max_exits=1, window_s=600.0)
    proc = next(sp.proc for sp in stack.processes if sp.name == "model-0")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while stack.given_up is None and time.monotonic() < deadline:
        time.sleep(0.1)  # the supervisor looks twice a second; there is no event to wait on
    assert stack.given_up is not None and stack.given_up.process.name == "model-0"
    assert stack.given_up.reason == "signal SIGKILL; 1 exits within 600 s"
    # Nothing is restarted any more: the process stays dead.
    assert next(sp.proc for sp in stack.processes if sp.name == "model-0") is proc
