"""The gateway process: the OpenAI-compatible HTTP front end over the scheduler."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket

from lamina.aio import install_uvloop
from lamina.gateway.app import create_app, start_server
from lamina.gateway.config import GatewayConfig
from lamina.kvstore.metadata import MetadataConfig, MetadataStore, ServiceRegistration
from lamina.model.checkpoints import checkpoint_name, load_tokenizer
from lamina.services import stack_dumps
from lamina.services.addresses import host_port
from lamina.services.cluster_status import read_status
from lamina.services.config import ConfigError, StackConfig
from lamina.services.gateway.scheduler_client import SchedulerBackend
from lamina.services.runtime import wait_for_services

log = logging.getLogger(__name__)


def model_display_name(config: StackConfig) -> str:
    return checkpoint_name(config.model)


def gateway_config(config: StackConfig) -> GatewayConfig:
    """The gateway's own configuration from the stack's; ConfigError names what is wrong
    (among it: no api_key on a host other than loopback without gateway.insecure)."""
    gw = config.gateway
    try:
        return GatewayConfig(host=config.host, port=gw.port, api_key=gw.api_key, insecure=gw.insecure,
                             max_queue=gw.max_queue, served_model_name=gw.served_model_name)
    except ValueError as exc:
        raise ConfigError(f"configuration: {exc}") from None


async def run_gateway(config: StackConfig, ready: asyncio.Event | None = None) -> None:
    gcfg = gateway_config(config)  # before anything starts: a refused configuration stops here
    store = MetadataStore(MetadataConfig(url=config.redis_url or "", namespace=config.namespace))
    (scheduler,) = await wait_for_services(store, "scheduler", 1)
    async def scheduler_address() -> str | None:
        info = await store.get_service("scheduler", "scheduler-0")
        return info.endpoint if info is not None else None

    backend = SchedulerBackend(scheduler.endpoint, config.cluster_token, resolve=scheduler_address,
                               stall_s=config.deadlines.rpc_s)
    await backend.start()
    tokenizer, model_cfg = load_tokenizer(config.model)
    if config.warm_up:
        tokenizer.warm_up()
    gw = config.gateway
    async def cluster_status() -> dict:  # what /dashboard shows: the same as `lamina status --json`
        return (await read_status(config)).to_dict()

    app = create_app(gcfg, backend, tokenizer, model_display_name(config), model_cfg.max_position_embeddings,
                     vocab_size=model_cfg.vocab_size, cluster_status=cluster_status)
    # Handler cancellation: a client that disconnects while its request is queued or
    # prefilling is noticed at once, not at the next token.
    runner, port = await start_server(app, config.host, gw.port)
    endpoint = f"http://{host_port(config.advertised_host, port)}"
    registration = ServiceRegistration(store, "gateway", "gateway-0", endpoint,
                                       {"port": port, "pid": os.getpid(), "host": socket.gethostname()})
    await registration.start()
    log.info("gateway serving the OpenAI API at %s/v1", endpoint)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    stack_dumps.install(loop)
    if ready is not None:
        ready.set()
    await stopping.wait()
    try:
        await asyncio.wait_for(registration.stop(), timeout=5.0)
    except TimeoutError:
        log.warning("gateway: could not deregister (Redis unreachable); its entry expires by TTL")
    await runner.cleanup()  # drains in-flight requests up to shutdown_timeout
    await backend.close()
    await store.close()


def serve(config: StackConfig) -> None:
    install_uvloop()
    asyncio.run(run_gateway(config))
