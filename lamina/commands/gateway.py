"""`lamina gateway`: the OpenAI-compatible HTTP/SSE front end."""

from __future__ import annotations

import argparse

from lamina.commands._service_args import (
    add_common,
    add_gateway_exposure,
    exit_served,
    gateway_refused,
    model_readable,
    stack_config,
    store_reachable,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: gateway.port, 8000)")
    add_gateway_exposure(p)


def run(args: argparse.Namespace) -> int:
    config = stack_config(args, **{"gateway.port": args.port, "gateway.api_key": args.api_key,
                                   "gateway.insecure": args.insecure})
    if config is None or gateway_refused(config):
        return 2
    if not model_readable(config.model, "gateway"):  # its tokenizer and context length
        return 2
    if not store_reachable(config):
        return 1
    from lamina.services.gateway.gateway_service import serve

    serve(config)
    exit_served()
