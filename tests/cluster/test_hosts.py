"""Every service on a host of its own, and the network between them failing.

One cluster for the module (netns.Hosts + hosts_stack.HostsStack): Redis, the gateway,
the scheduler, a prefill worker, two model workers and two attention workers, each in
its own network namespace at its own address, with the cluster token, an API key and a
password on Redis. The official client runs on the gateway's host. Each test heals what
it cut before it ends, and the next one starts from a cluster whose attention workers
hold no KV."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import openai
import pytest
from fault_helpers import MAX_TOKENS, PROMPTS
from fault_helpers import stream_all as _stream_all
from hosts_stack import API_KEY, DEADLINES, HostsStack, host_names, hosts_config, until
from netns import Hosts

pytestmark = pytest.mark.timeout(900)

# The half of the cluster the partition test cuts off: a model and an attention worker.
APART = ("model-1", "attention-1")
REBUILDS = "lamina_scheduler_rebuilds_total"
RECLAIMED = "lamina_scheduler_kv_reclaimed_total"


def _status(cluster) -> subprocess.CompletedProcess:
    """`lamina status --json` from the gateway's host, finding the cluster by its Redis URL
    (the token from the environment, as a reader without the cluster's file gives it)."""
    env = {**os.environ, "LAMINA_CLUSTER_TOKEN": cluster.config.cluster_token}
    return cluster.inside(lambda: subprocess.run(
        [sys.executable, "-m", "lamina.cli", "status", "--json", "--redis-url", cluster.config.redis_url],
        capture_output=True, text=True, timeout=60, env=env))


@pytest.fixture(scope="module")
def cluster(request):
    config = hosts_config(attention_workers=2, model_workers=2, deadlines=DEADLINES)
    failed = request.session.testsfailed
    with Hosts(host_names(config), apart=APART) as hosts:
        stack = HostsStack(config, hosts)
        stack.start(timeout_s=300)
        try:
            yield stack
        finally:
            # The services' logs are kept when a test failed (the path is printed).
            stack.keep_logs = request.session.testsfailed > failed
            if stack.keep_logs:
                print(f"hosts cluster logs: {stack.log_dir}")
            stack.stop()


def stream_all(stack: HostsStack, act=lambda: None, after_chunks: int | None = None, errors: bool = False) -> list:
    """fault_helpers.stream_all on the gateway's host, `act()` once every stream has
    `after_chunks` content chunks."""
    return stack.inside(lambda: asyncio.run(_stream_all(stack.base_url, act, after_chunks, errors, API_KEY)))


@pytest.fixture(autouse=True)
def settled(cluster):
    """Each test starts with every attention worker registered and holding no KV, and
    every service process alive."""
    until(lambda: cluster.kv_held() == {"attention-0": 0, "attention-1": 0}, 90)
    cluster.alive()


def test_every_service_serves_from_its_own_host(cluster, references):
    """Greedy outputs equal transformers' with every hop between two addresses; each
    service is registered at its own host's address; the API wants its key."""
    assert stream_all(cluster) == references
    status = _status(cluster)
    assert status.returncode == 0, status.stderr
    services = json.loads(status.stdout)["services"]
    assert sorted(s["name"] for s in services) == sorted(
        n if "-" in n else f"{n}-0" for n in cluster.hosts.names if n != "redis")
    for s in services:
        address = cluster.hosts.address(s["name"] if s["kind"] in ("attention", "model", "prefill") else s["kind"])
        assert s["healthy"], s
        assert f"{address}:" in s["endpoint"], s  # its data plane (the gateway: HTTP)
        if s["kind"] != "gateway":
            assert s["grpc"].startswith(f"{address}:"), s

    async def without_key() -> None:
        client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="wrong", max_retries=0)
        try:
            await client.models.list()
        finally:
            await client.close()

    with pytest.raises(openai.AuthenticationError):
        cluster.inside(lambda: asyncio.run(without_key()))


def cut_when_flowing(cluster: HostsStack, name: str, references: list[str]) -> float:
    """Stream every prompt, cut `name`'s link once tokens flow, and check every stream
    still ends as transformers' continuation; seconds from the cut to the last token.
    The link is healed before this returns."""
    cut_at: list[float] = []

    def cut() -> None:
        cluster.hosts.cut(name)
        cut_at.append(time.monotonic())

    try:
        texts = stream_all(cluster, cut, after_chunks=3)
        took = time.monotonic() - cut_at[0]
    finally:
        cluster.hosts.heal(name)
    assert texts == references
    return took


@pytest.mark.parametrize("worker", ["attention-0", "model-0"])
def test_a_worker_cut_off_mid_decode_is_rebuilt_elsewhere_and_serves_after_the_heal(cluster, references, worker):
    """Its requests are rebuilt on the other worker within deadlines.recovery_s, exactly;
    healed, it frees what it held (the KV ids the rebuilds left dead) and serves again."""
    rebuilds = cluster.metric("scheduler", REBUILDS)
    before = cluster.alive()
    took = cut_when_flowing(cluster, worker, references)
    assert took < DEADLINES.recovery_s
    assert cluster.metric("scheduler", REBUILDS) > rebuilds  # the cut hit its requests
    # Healed: the attention workers end up holding nothing (attention-0's dead KV freed
    # once the scheduler reaches it again), and the worker gets new requests.
    until(lambda: cluster.kv_held() == {"attention-0": 0, "attention-1": 0}, 90)
    until(lambda: worker in cluster.registered(), 60)  # its lease lapsed while it was cut off
    served = "lamina_attention_frames_total" if worker.startswith("attention") else "lamina_model_steps_total"

    def serves_again() -> bool:
        # The scheduler takes it back once it answers again (reopening with a backoff):
        # until then new requests go to the other worker, still exactly.
        handled = cluster.metric(worker, served)
        assert stream_all(cluster) == references
        return cluster.metric(worker, served) > handled

    until(serves_again, 60, every_s=1.0)
    assert cluster.alive() == before  # nothing restarted for it


def test_a_slow_link_slows_requests_and_fails_none(cluster, references):
    """A 100 Mbit/s token bucket on an attention worker's link: every request exact."""
    cluster.hosts.limit("attention-1", 100)
    try:
        assert stream_all(cluster) == references
        shaped = subprocess.run(cluster.hosts.argv("attention-1", ["tc", "-s", "qdisc", "show", "dev", "eth0"]),
                                capture_output=True, text=True, check=True).stdout
    finally:
        cluster.hosts.unlimit("attention-1")
    assert "tbf" in shaped and "rate 100Mbit" in shaped, shaped
    sent = int(shaped.split("Sent ")[1].split()[0])
    assert sent > 100_000, shaped  # the replies went through the bucket


def test_redis_cut_off_for_ten_seconds(cluster, references):
    """Running requests go on; one sent meanwhile waits and succeeds or ends with a clear
    error; after the heal every service is registered again and none restarted."""
    before = cluster.alive()
    during: list = []

    async def run() -> list:
        async def send() -> None:
            client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0,
                                        timeout=120)
            try:
                during.append(await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                    max_tokens=MAX_TOKENS, temperature=0))
            except openai.APIError as exc:
                during.append(exc)
            finally:
                await client.close()

        async def cut_and_send() -> None:
            cluster.hosts.cut("redis")
            try:
                sent = asyncio.create_task(send())
                await asyncio.sleep(10.0)
            finally:
                cluster.hosts.heal("redis")
            await sent

        async with openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY) as c:
            model = (await c.models.list()).data[0].id
        cutting: list[asyncio.Task] = []  # started once the streams are decoding
        texts = await _stream_all(cluster.base_url, lambda: cutting.append(asyncio.ensure_future(cut_and_send())),
                                  3, False, API_KEY)
        await cutting[0]
        return texts

    texts = cluster.inside(lambda: asyncio.run(run()))
    assert texts == references
    (outcome,) = during
    if isinstance(outcome, openai.APIError):
        assert "redis" in str(outcome).lower() or "metadata" in str(outcome).lower(), outcome
    else:
        assert outcome.choices[0].message.content == references[0]
    assert cluster.alive() == before

    def registered() -> bool:
        status = _status(cluster)
        services = json.loads(status.stdout)["services"] if status.returncode == 0 else []
        return len(services) == len(cluster.processes) and all(s["healthy"] for s in services)

    until(registered, 60)
    assert stream_all(cluster) == references


def test_a_scheduler_cut_off_gets_clear_errors_then_serves_after_the_heal(cluster, references):
    start = time.monotonic()
    try:
        outcomes = stream_all(cluster, lambda: cluster.hosts.cut("scheduler"), after_chunks=3, errors=True)
        took = time.monotonic() - start
    finally:
        cluster.hosts.heal("scheduler")
    assert all(isinstance(o, openai.APIError) or o == ref for o, ref in zip(outcomes, references)), outcomes
    errors = [o for o in outcomes if isinstance(o, openai.APIError)]
    assert errors and all("scheduler" in str(e) for e in errors), outcomes
    assert took < 3 * DEADLINES.rpc_s + 30
    until(lambda: stream_all(cluster, errors=True) == references, 60, every_s=2)


def test_a_partition_splits_the_cluster_for_thirty_seconds(cluster, references):
    """The cluster split in two (APART on one side) for 30 s while a request arrives every
    second: after the heal every request has completed exactly or ended with a clear
    error, each was finished once, and no attention worker holds KV."""
    finished = cluster.metric("scheduler", "lamina_scheduler_finished_total")

    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

        async def one(i: int):
            try:
                out = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                    max_tokens=MAX_TOKENS, temperature=0)
                return out.choices[0].message.content
            except openai.APIError as exc:
                return exc

        try:
            model = (await client.models.list()).data[0].id
            tasks = []
            cluster.hosts.split()
            try:
                for i in range(30):
                    tasks.append(asyncio.create_task(one(i)))
                    await asyncio.sleep(1.0)
            finally:
                cluster.hosts.join()
            return await asyncio.gather(*tasks)
        finally:
            await client.close()

    outcomes = cluster.inside(lambda: asyncio.run(run()))
    for i, o in enumerate(outcomes):
        assert o == references[i % len(PROMPTS)] or (isinstance(o, openai.APIError) and o.message), (i, o)
    assert sum(isinstance(o, str) for o in outcomes) >= len(outcomes) // 2, outcomes
    until(lambda: cluster.kv_held() == {"attention-0": 0, "attention-1": 0}, 90)
    assert cluster.metric("scheduler", "lamina_scheduler_finished_total") - finished == len(outcomes)


def test_prompt_kv_held_back_by_a_cut_link_is_reclaimed_after_the_heal(cluster, references):
    """A prompt's KV sent to attention-1 while its link is cut arrives after the heal, for
    a sequence no request holds (as when its request's Free came first): the worker frees
    it once untouched for deadlines.kv_reclaim_s, on the scheduler's word, and says so;
    requests decoding meanwhile stay exact."""
    import torch

    from lamina import transports
    from lamina.kvstore.metadata import MetadataConfig, MetadataStore
    from lamina.services.wire import Kind, StoreKV

    reclaimed = cluster.metric("scheduler", RECLAIMED)
    layers, held = 30, 24  # the default model (SmolLM2-135M): 30 layers, 3 KV heads of 64

    async def late_store() -> Kind:
        store = MetadataStore(MetadataConfig(url=cluster.config.redis_url, namespace=cluster.config.namespace))
        try:
            info = await store.get_service("attention", "attention-1")
        finally:
            await store.close()
        conn = await transports.connect(info.endpoint, cluster.config.transport_config())
        try:
            cluster.hosts.cut("attention-1")
            try:
                async def send() -> None:
                    for layer in range(layers):
                        await conn.send(StoreKV("held-back", layer, layers, torch.randn(held, 3, 64),
                                                torch.randn(held, 3, 64)).to_frame())

                sending = asyncio.create_task(send())
                await asyncio.sleep(2.0)  # the frames wait in this host's socket, then retransmissions
            finally:
                cluster.hosts.heal("attention-1")
            await sending
            return (await asyncio.wait_for(conn.recv(), 60)).kind
        finally:
            await conn.close()

    assert cluster.inside(lambda: asyncio.run(late_store())) == Kind.ACK
    assert cluster.kv_held()["attention-1"] == 1  # held for no request
    start = time.monotonic()
    assert stream_all(cluster) == references
    until(lambda: cluster.kv_held() == {"attention-0": 0, "attention-1": 0}, DEADLINES.kv_reclaim_s + 30)
    assert time.monotonic() - start < DEADLINES.kv_reclaim_s + 30
    assert cluster.metric("scheduler", RECLAIMED) - reclaimed == 1
