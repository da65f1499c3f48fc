"""deploy/compose/ runs, not only validates: its images are built here with podman (no
registry: a debootstrap base, wheels built on the host), podman-compose brings the stack
up, the official openai client gets transformers' greedy text through the published
gateway port, every container's health check passes, Prometheus scrapes every service,
and a SIGKILLed attention worker and model worker are what docs/reliability.md says:
the streams go on with the same text, and the restart policy brings the container back
under its own index. `make test-containers` (CI: .ci/run) runs it."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request

import openai
import podman_stack
import pytest

# The fault tests' prompts, streams and transformers references (tests/faults/fault_helpers.py).
from fault_helpers import greedy_references, stream_all
from podman_stack import wait_until

pytestmark = [pytest.mark.containers, pytest.mark.timeout(1800)]

LAMINA_SERVICES = ("scheduler", "prefill-0", "model-0", "attention", "gateway")


@pytest.fixture(scope="module")
def references(loaded_model, hf_reference) -> list[str]:
    return greedy_references(loaded_model, hf_reference)


@pytest.fixture(scope="module")
def stack(references):
    reason = podman_stack.missing_requirements()
    if reason:
        pytest.skip(reason)
    # A SIGTERM (a CI job's timeout) tears the stack down like Ctrl-C does.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = None
    try:
        t0 = time.monotonic()
        images = podman_stack.build_images()
        t1 = time.monotonic()
        started = podman_stack.start(images)
        assert set(LAMINA_SERVICES) | {"redis", "prometheus"} <= set(started.services), started.left_out
        print(f"\nimages built in {t1 - t0:.0f} s; started {', '.join(started.services)}; left out: "
              f"{started.left_out or 'none'}")
        _first_answer(started)
        print(f"stack serving {time.monotonic() - t1:.0f} s after up")
        yield started
    finally:
        podman_stack.stop(started)
        signal.signal(signal.SIGTERM, previous)


def _client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=stack.api_key, max_retries=0, timeout=300)


def _first_answer(stack, timeout_s: float = 600) -> None:
    """Waits until a chat request is answered (every service started, the model converted
    into the cache volume, the workers registered)."""
    async def ask() -> bool:
        client = _client(stack)
        try:
            model = (await client.models.list()).data[0].id
            reply = await client.chat.completions.create(model=model, max_tokens=2, temperature=0,
                                                         messages=[{"role": "user", "content": "Hi"}])
            return bool(reply.choices)
        except (openai.APIError, openai.APIConnectionError):
            return False
        finally:
            await client.close()

    wait_until(lambda: asyncio.run(ask()), timeout_s, "the gateway answering a chat request", interval_s=5)


def _stream_all(stack, kill=lambda: None, after_chunks: int | None = None) -> list[str]:
    """Every prompt streamed at once through the published port; `kill()` once each
    stream has `after_chunks` content chunks."""
    return asyncio.run(stream_all(stack.url, kill, after_chunks, api_key=stack.api_key))


def test_greedy_output_through_the_published_port_equals_transformers(stack, references):
    assert _stream_all(stack) == references


def test_every_container_is_healthy_and_the_replicas_claimed_distinct_indexes(stack):
    containers = [c for service in LAMINA_SERVICES + ("redis",) for c in stack.containers(service)]
    # lamina health: the gRPC health protocol on the gRPC services, /health on the gateway.
    unhealthy = [c for c in containers if not stack.healthy(c)]
    assert not unhealthy
    attention = stack.containers("attention")
    assert len(attention) == 2  # deploy.replicas: ${LAMINA_ATTENTION_WORKERS:-2}
    hosts = {stack.inspect(c)["Config"]["Hostname"] for c in attention}
    claims = stack.claims("attention")
    assert sorted(claims) == [0, 1] and {holder.split(":")[0] for holder in claims.values()} == hosts


def test_services_run_as_their_user_with_secrets_only_root_reads(stack):
    """The entrypoint starts as root, reads the 0600 secret files, and runs the service
    (the container's process 1) as uid 10001, which cannot read them."""
    for service in LAMINA_SERVICES:
        container = stack.containers(service)[0]
        seen = podman_stack.run("podman", "exec", "--user", "10001", container, "sh", "-c",
                                "stat -c %a /run/secrets/cluster_token; awk '/^Uid:/{print $2}' /proc/1/status; "
                                "cat /run/secrets/cluster_token >/dev/null 2>&1 && echo readable || echo refused")
        assert seen.stdout.split() == ["600", "10001", "refused"], (service, seen.stdout)


def test_prometheus_scrapes_every_service_and_each_replica(stack):
    def targets() -> list[dict] | None:
        with urllib.request.urlopen(f"{stack.prometheus_url}/api/v1/targets", timeout=10) as reply:
            active = json.load(reply)["data"]["activeTargets"]
        return active if len(active) == 6 and all(t["health"] == "up" for t in active) else None

    try:
        active = wait_until(targets, 60, "every Prometheus target up")
    except AssertionError:
        with urllib.request.urlopen(f"{stack.prometheus_url}/api/v1/targets", timeout=10) as reply:
            pytest.fail(f"targets: {json.load(reply)['data']['activeTargets']}")
    kinds = sorted(t["labels"]["kind"] for t in active)
    assert kinds == ["attention", "attention", "gateway", "model", "prefill", "scheduler"]


@pytest.mark.parametrize("service", ["attention", "model-0"])
def test_a_killed_worker_container_is_survived_and_restarted_by_its_policy(stack, references, service):
    """attention: the requests are rebuilt on the other replica and go on; model-0, the only
    model worker: they wait, KV kept, for the restarted one (docs/reliability.md)."""
    victim = stack.containers(service)[-1]
    before = stack.inspect(victim)
    claims_before = stack.claims("attention")
    killed = []
    texts = _stream_all(stack, kill=lambda: killed.append(stack.kill(victim)), after_chunks=3)
    assert texts == references
    # restart: unless-stopped brings the same container back, a new process in it.
    after = wait_until(lambda: (s := stack.inspect(victim))["State"]["Running"] and s["State"]["Pid"] not in killed
                       and s, 180, f"{victim} restarted")
    assert after["RestartCount"] > before["RestartCount"]
    wait_until(lambda: stack.healthy(victim), 180, f"{victim} healthy again", interval_s=3)
    # An attention replica claims its own index back (same host name, process 1 again).
    assert wait_until(lambda: stack.claims("attention") == claims_before, 60, "the claims as before")
    # The restarted worker serves: new requests through it give the same text.
    assert _stream_all(stack) == references
