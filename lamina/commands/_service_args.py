"""Flags every service command shares, and how they become a StackConfig."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from lamina.services.config import KV_QUANT_CHOICES, ConfigError, StackConfig, load_config


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="stack configuration file (YAML or TOML)")
    p.add_argument("--model", default=None,
                   help="checkpoint directory, .gguf file or random:SHAPE (seeded random weights, docs/model.md)")
    p.add_argument("--redis-url", default=None, help="metadata store (default: REDIS_URL)")
    p.add_argument("--transport", default=None, choices=("tcp", "ucx", "shm", "cuda_ipc"),
                   help="data-plane transport (default: the configuration's, tcp; lamina up takes cuda_ipc where "
                        "prefill, model and attention workers all compute on GPUs)")
    p.add_argument("--partition", default=None, choices=("request", "head"), help="KV partitioning")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--insecure", action="store_true", default=None,
                   help="on a host other than loopback, serve without a cluster token (insecure) and the gateway's "
                        "API without --api-key (gateway.insecure)")


def stack_config(args: argparse.Namespace, **extra: object) -> StackConfig | None:
    """The validated configuration, or None after printing why it is invalid."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    overrides = {"model": args.model, "redis_url": args.redis_url, "transport": args.transport,
                 "partition": args.partition, "insecure": args.insecure, **extra}
    try:
        return load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"lamina: {exc}", file=sys.stderr)
        return None


def devices_here(config: StackConfig, kinds: tuple[str, ...]) -> bool:
    """Whether the devices those service kinds are configured for are on this host;
    prints which is not."""
    from lamina.services.devices import DEVICE_SETTINGS, check_devices

    try:
        check_devices(config, tuple(k for k in kinds if k in DEVICE_SETTINGS))
    except ConfigError as exc:
        print(f"lamina: {exc}", file=sys.stderr)
        return False
    return True


def add_kv_quant(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-quant", default=None, choices=KV_QUANT_CHOICES,
                   help="how attention workers store KV: none (in attention.dtype, the default) or q4 (4-bit "
                        "group-wise; docs/model.md) (attention.kv_quant)")


def add_gateway_exposure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=None, help="require this bearer token on /v1/ requests")


def gateway_refused(config: StackConfig) -> bool:
    """Whether the gateway would refuse `config` (no API key on a host other than loopback,
    without gateway.insecure); prints why. Checked before anything starts."""
    from lamina.services.gateway.gateway_service import gateway_config

    try:
        gateway_config(config)
    except ConfigError as exc:
        print(f"lamina: {exc}", file=sys.stderr)
        return True
    return False


def open_refused(config: StackConfig, service: str) -> bool:
    """Whether `service` must not start without a cluster token on this host; prints why."""
    from lamina.services.auth import open_service_refusal

    why = open_service_refusal(config, service)
    if why is not None:
        print(f"lamina: {why}", file=sys.stderr)
    return why is not None


def store_reachable(config: StackConfig) -> bool:
    """Whether the configured Redis answers within deadlines.startup_s; says what it waits
    for, in one line each. Every service keeps its state there: none starts without one,
    and a wait stopped by Ctrl-C ends in one line too."""
    from lamina.services.startup import wait_for_store

    def say(line: str) -> None:
        print(f"lamina: {line}", file=sys.stderr, flush=True)

    if not config.redis_url:
        say("no Redis configured: set redis_url in the configuration file, REDIS_URL or --redis-url "
            "(lamina up starts one of its own)")
        return False
    try:
        return wait_for_store(config.redis_url, config.deadlines.startup_s, say)
    except KeyboardInterrupt:
        say("interrupted while waiting for Redis")
        return False


def model_readable(model: str | None, command: str) -> bool:
    """The checkpoint found and readable (a GGUF file converted, a random model's weights
    written: once, into the cache; lamina.model.checkpoints logs it as it starts); else
    one line naming the file and the problem."""
    from lamina.model.checkpoints import resolve_checkpoint
    from lamina.model.errors import CheckpointError

    try:
        resolve_checkpoint(model)
    except CheckpointError as exc:
        print(f"lamina {command}: cannot load model: {exc}", file=sys.stderr)
        return False
    return True


def run_service(args: argparse.Namespace, module: str, **extra: object) -> int:
    """Validate the configuration, then run `module.serve(config[, threads])` until stopped."""
    import importlib

    config = stack_config(args, **extra)
    if config is None:
        return 2
    service = module.rsplit(".", 1)[-1].removesuffix("_service")
    if service != "gateway" and open_refused(config, service):
        return 2
    if not model_readable(config.model, service):  # the gateway's tokenizer, the scheduler's shape
        return 2
    if not store_reachable(config):
        return 1
    serve = importlib.import_module(module).serve
    threads = getattr(args, "threads", None)
    if threads is not None:
        serve(config, threads)
    else:
        serve(config)
    exit_served()


def exit_served() -> NoReturn:
    """End a service that has served and drained (its connections closed, its registration
    withdrawn) without the interpreter's teardown: unloading torch's and gRPC's modules takes
    about half a second and releases nothing the exit does not, and a stack stops each of its
    services this way."""
    logging.shutdown()  # flushes the log
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def index_arg(value: str) -> int | str:
    """--index: a number, or `auto` (claimed in the metadata store: services/attention/index_claims.py)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or auto (got {value!r})") from None


def add_indexed(p: argparse.ArgumentParser, what: str) -> None:
    """Flags of a service that runs as one of several (attention, model and prefill workers)."""
    add_common(p)
    p.add_argument("--index", type=index_arg, default=0,
                   help=f"this worker's index among the {what}, or auto: the lowest one no running worker "
                        "holds (for replicas of one container definition)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the section's threads)")


def run_indexed_service(args: argparse.Namespace, module: str, section: str, **extra: object) -> int:
    """Like run_service, for `module.serve(config, threads, index)` with index < `section`.workers
    (for attention workers, attention.max_workers when that is larger: services/attention_members.py)."""
    import importlib

    config = stack_config(args, **extra)
    if config is None:
        return 2
    if open_refused(config, {"model_worker": "model worker", "prefill": "prefill worker",
                             "attention": "attention worker"}[section]):
        return 2
    colocated = section == "model_worker" and config.colocated  # its attention runs in its process
    if not devices_here(config, (section, "attention") if colocated else (section,)):
        return 2
    if not model_readable(config.model, {"model_worker": "model", "prefill": "prefill",
                                         "attention": "attention"}[section]):
        return 2
    if not store_reachable(config):
        return 1
    count, limit_name = index_limit(config, section)
    serve = importlib.import_module(module).serve
    if args.index == "auto":
        if _serve_with_claimed_index(config, section, count, limit_name,
                                     lambda index: serve(config, args.threads, index)):
            return 2
        exit_served()
    if not 0 <= args.index < count:
        print(f"lamina: --index must be below {limit_name} ({count})", file=sys.stderr)
        return 2
    serve(config, args.threads, args.index)
    exit_served()


def index_limit(config: StackConfig, section: str) -> tuple[int, str]:
    """(the indexes a worker of `section` may take, 0 .. n - 1; the setting that sets n):
    attention.max_workers for an elastic attention pool, else `section`.workers."""
    workers = getattr(config, section).workers
    if section == "attention" and config.attention.pool_limit > workers:
        return config.attention.pool_limit, "attention.max_workers"
    return workers, f"{section}.workers"


def _serve_with_claimed_index(config: StackConfig, section: str, count: int, limit_name: str,
                              serve: Callable[[int], None]) -> int:
    from lamina.services.attention.index_claims import IndexClaim

    if not config.redis_url:
        print("lamina: --index auto claims its index in Redis: set redis_url or REDIS_URL", file=sys.stderr)
        return 2
    claim = IndexClaim(config.redis_url, config.namespace, section, count, limit_setting=limit_name)
    try:
        index = claim.acquire()
    except TimeoutError as exc:
        print(f"lamina: {exc}", file=sys.stderr)
        return 2
    try:
        serve(index)
    finally:
        claim.release()
    return 0
