"""`lamina gateway`: the OpenAI-compatible HTTP/SSE front end."""

from __future__ import annotations

import argparse

from lamina.commands._service_args import add_common, run_service


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: gateway.port, 8000)")
    p.add_argument("--api-key", default=None, help="require this bearer token on /v1/ requests")


def run(args: argparse.Namespace) -> int:
    return run_service(args, "services.gateway_service", **{"gateway.port": args.port, "gateway.api_key": args.api_key})
