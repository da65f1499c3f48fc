"""The stack with every service, Redis included, on a host of its own (netns.Hosts).

`HostsStack` is the launcher's Stack with each process started on the host named after
it (attention-0, model-0, prefill-0, scheduler, gateway, redis), with `host` set to that
host's address (so it binds and advertises it), the cluster token, an API key and a
password on Redis. Everything this process does over the network (starting it, health
probes, clients, metrics) runs on the gateway's host through `Hosts.inside`: this
machine's own network never carries the cluster's addresses."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Callable
from typing import TypeVar

from netns import Hosts

from lamina.kvstore.metadata import MetadataConfig, MetadataStore
from lamina.kvstore.redis_server import EmbeddedRedis
from lamina.lifetime import spawn_logged
from lamina.services.config import (
    AttentionSection,
    DeadlinesSection,
    GatewaySection,
    ModelWorkerSection,
    PipelineSection,
    StackConfig,
)
from lamina.services.launch.launcher import ServiceProcess, Stack, service_commands

T = TypeVar("T")


def until(check: Callable[[], T], timeout_s: float, every_s: float = 0.5) -> T:
    """Poll `check()` until it returns something true (another process's state: nothing
    here to wait on); its result."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"not so after {timeout_s:g} s"
        time.sleep(every_s)
    return result

# Short deadlines, so that a cut link is noticed and rebuilt around within seconds.
DEADLINES = DeadlinesSection(reply_s=4.0, step_s=8.0, health_s=1.0, rpc_s=8.0, kv_reclaim_s=5.0)
API_KEY = "hosts-test-key"
GATEWAY_PORT = 8000
REDIS_PORT = 6379


def host_names(config: StackConfig) -> list[str]:
    """One host per service process of `config`, and Redis's."""
    return ["redis", *(name for name, _, _ in service_commands(config))]


def hosts_config(attention_workers: int = 2, model_workers: int = 1, micro_batches: int = 1,
                 deadlines: DeadlinesSection | None = None) -> StackConfig:
    return StackConfig(
        host="127.0.0.1",  # each process gets its host's address (HostsStack._spawn)
        deadlines=deadlines or DeadlinesSection(),
        gateway=GatewaySection(port=GATEWAY_PORT, api_key=API_KEY),
        attention=AttentionSection(workers=attention_workers, kv_capacity_bytes=256 << 20),
        model_worker=ModelWorkerSection(workers=model_workers),
        pipeline=PipelineSection(micro_batches=micro_batches, min_micro_batch=1))


class HostsStack(Stack):
    forks_services = False  # each service starts in its own network namespace (`ip netns exec`)

    def __init__(self, config: StackConfig, hosts: Hosts) -> None:
        super().__init__(dataclasses.replace(config, host=hosts.address("gateway")))
        self.hosts = hosts

    def inside(self, fn: Callable[[], T]) -> T:
        """`fn()` on the gateway's host."""
        return self.hosts.inside("gateway", fn)

    def start(self, timeout_s: float = 300.0) -> None:
        self.inside(lambda: Stack.start(self, timeout_s))

    def stop(self, timeout_s: float = 20.0) -> None:
        self.inside(lambda: Stack.stop(self, timeout_s))

    def _start_redis(self) -> None:
        self.redis = EmbeddedRedis(port=REDIS_PORT, bind=self.hosts.address("redis"),
                                   password=secrets.token_urlsafe(16),
                                   launcher=self.hosts.argv("redis", [])).start()
        self.config = dataclasses.replace(self.config, redis_url=self.redis.url)

    def _spawn(self, sp: ServiceProcess, restart: bool = False) -> None:
        note = f"restart {len(sp.runs)} of {sp.name}" if restart else None
        env = {**self._env, "LAMINA_HOST": self.hosts.address(sp.name)}
        sp.proc = spawn_logged(self.hosts.argv(sp.name, sp.argv), self.log_dir / f"{sp.name}.log", env, note)
        sp.started_at = time.monotonic()

    # -- what the tests read, from the gateway's host ------------------------------------------
    def metric(self, name: str, metric: str) -> float:
        """The sum of every sample of `metric` (with labels: that one) service `name`
        (attention-0, scheduler, ...) exports, read at its host's address."""
        from e2e_helpers import metric_total

        service_id = name if "-" in name else f"{name}-0"
        return self.inside(lambda: metric_total(self, name.split("-")[0], service_id, metric,
                                                self.hosts.address(name)))

    def registered(self) -> set[str]:
        """The ids of the services registered in the metadata store now."""
        async def ids() -> set[str]:
            store = MetadataStore(MetadataConfig(url=self.config.redis_url, namespace=self.config.namespace))
            try:
                return {info.service_id for kind in ("attention", "model", "prefill", "scheduler", "gateway")
                        for info in await store.list_services(kind)}
            finally:
                await store.close()

        return self.inside(lambda: asyncio.run(ids()))

    def kv_held(self) -> dict[str, int]:
        """Sequences each registered attention worker holds (asked over gRPC)."""
        from lamina.services.channels import open_channel
        from lamina.services.protos import lamina_pb2, lamina_pb2_grpc

        async def held() -> dict[str, int]:
            store = MetadataStore(MetadataConfig(url=self.config.redis_url, namespace=self.config.namespace))
            try:
                services = await store.list_services("attention")
            finally:
                await store.close()
            out = {}
            for info in services:
                async with open_channel(info.meta["grpc"], self.config.cluster_token) as ch:
                    stats = await lamina_pb2_grpc.AttentionControlStub(ch).Stats(lamina_pb2.Empty(), timeout=10)
                out[info.service_id] = stats.num_sequences
            return out

        return self.inside(lambda: asyncio.run(held()))

    def alive(self) -> dict[str, int]:
        """Each service process's pid, asserting none has exited (none was restarted either:
        the stack is not supervised)."""
        dead = self.dead_process()
        assert dead is None, f"{dead.name} exited"
        return {sp.name: sp.proc.pid for sp in self.processes if sp.proc is not None}
