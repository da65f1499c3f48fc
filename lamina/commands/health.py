"""`lamina health`: probe one service's health, for container health checks.

Exit status 0 when the service answers SERVING (gRPC health-checking protocol) or HTTP
200 on /health (the gateway), 1 otherwise. Without --grpc or --http it probes this
container's own service: gRPC on 127.0.0.1:$LAMINA_GRPC_PORT when that is set and not
0, else the gateway's http://127.0.0.1:${LAMINA_PORT:-8000}/health. That lets one image
carry one HEALTHCHECK whatever service its command starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_mutually_exclusive_group()  # one probe: its exit status is that target's health
    target.add_argument("--grpc", default=None, metavar="HOST:PORT", help="probe this gRPC health service")
    p.add_argument("--service", default="", help="gRPC health service name (default '': the whole server)")
    target.add_argument("--http", default=None, metavar="URL", help="probe this URL (200: healthy)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds before the probe fails (default 3)")


def probe_target(grpc_address: str | None, http_url: str | None, env: Mapping[str, str]) -> tuple[str, str]:
    """("grpc", HOST:PORT) or ("http", URL): what to probe, from the flags or the environment."""
    if grpc_address:
        return "grpc", grpc_address
    if http_url:
        return "http", http_url
    grpc_port = env.get("LAMINA_GRPC_PORT", "")
    if grpc_port not in ("", "0"):
        return "grpc", f"127.0.0.1:{grpc_port}"
    return "http", f"http://127.0.0.1:{env.get('LAMINA_PORT') or 8000}/health"


def grpc_serving(address: str, service: str, timeout_s: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    # The health service is the one gRPC service that needs no cluster token (services/auth.py).
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def http_ok(url: str, timeout_s: float) -> tuple[bool, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status == 200, f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except OSError as exc:
        return False, str(exc)


def run(args: argparse.Namespace) -> int:
    kind, target = probe_target(args.grpc, args.http, os.environ)
    if kind == "grpc":
        ok, detail = grpc_serving(target, args.service, args.timeout)
    else:
        ok, detail = http_ok(target, args.timeout)
    print(f"{target}: {detail}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
