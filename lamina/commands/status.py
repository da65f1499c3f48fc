"""`lamina status`: every service of a running cluster, its health and restarts, the
attention workers' KV occupancy, each prefill worker's prefix cache (blocks and bytes
per tier, hit ratio, tokens saved) and the requests running and waiting.

The cluster is found through its metadata store: `--redis-url` / `REDIS_URL` (with
`--config` and LAMINA_NAMESPACE for the namespace, LAMINA_CLUSTER_TOKEN for the token),
or, for a stack started on this host (`lamina up`), `--port`: its gateway port, which
names the file the launcher leaves in the runtime directory (services/launch/local_stacks.py).
Without either, the default gateway port is tried.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="the cluster's configuration file (YAML or TOML)")
    p.add_argument("--redis-url", default=None, help="the cluster's metadata store (default: REDIS_URL)")
    p.add_argument("--port", type=int, default=None, help="gateway port of a `lamina up` on this host")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from lamina.services.config import ConfigError

    try:
        config, where = _find_cluster(args)
    except ConfigError as exc:
        print(f"lamina status: {exc}", file=sys.stderr)
        return 1
    from lamina.kvstore.metadata import REDIS_ERRORS
    from lamina.services.cluster_status import read_status

    try:
        status = asyncio.run(read_status(config))
    except REDIS_ERRORS as exc:
        print(f"lamina status: no cluster at {where}: {exc}", file=sys.stderr)
        return 1
    if not any(s.endpoint is not None for s in status.services):  # only restart counts, no registration
        print(f"lamina status: no service is registered at {where} (namespace {config.namespace!r})",
              file=sys.stderr)
        return 1
    print(json.dumps(status.to_dict()) if args.json else _table(status))
    if status.token_refused:
        print("lamina status: the cluster refused this cluster token (UNAUTHENTICATED), so figures are missing: "
              "give the cluster's configuration with --config (a lamina up's is stack.yaml in its log directory; "
              "--port finds it) or set LAMINA_CLUSTER_TOKEN", file=sys.stderr)
        return 1
    return 0


def _find_cluster(args: argparse.Namespace):
    """(config, where it was found, in words); ConfigError when there is none."""
    from lamina.services.config import ConfigError, load_config
    from lamina.services.launch import local_stacks

    if args.port is None:
        config = load_config(args.config, overrides={"redis_url": args.redis_url})
        if config.redis_url:
            return config, config.redis_url
        port = config.gateway.port
    else:
        port = args.port
    try:
        path = local_stacks.find(port)
    except local_stacks.UnsafeDirectory as exc:
        raise ConfigError(str(exc)) from None
    if path is None:
        hint = "" if args.port is not None else "; set REDIS_URL or --redis-url for a cluster elsewhere"
        raise ConfigError(f"no cluster found: no `lamina up` with its gateway on port {port} on this host"
                          f" ({local_stacks.state_path(port)} is missing or stale){hint}")
    # The stack's own file, as its services read it: the environment must not redirect it.
    config = load_config(path, env={})
    return config, f"{config.redis_url} (the stack on port {port})"


def _table(status) -> str:
    rows: list[tuple[str, ...]] = [("KIND", "NAME", "INDEX", "HOST", "PID", "DEVICE", "ENDPOINT", "GRPC", "HEALTHY",
                                    "RESTARTS")]
    rows += [(s.kind, s.name, _text(s.index), _text(s.host), _text(s.pid), _text(s.device), _text(s.endpoint),
              _text(s.grpc), "yes" if s.healthy else "NO", str(s.restarts)) for s in status.services]
    out = [_columns(rows), ""]
    if status.attention:
        rows = [("ATTENTION", "SEQUENCES", "TOKENS", "CAPACITY (TOKENS)", "OCCUPANCY", "FRAGMENTATION")]
        for a in status.attention:
            if a.error is not None:  # the code's name: the details (in --json) would widen the column
                rows.append((a.name, f"unavailable: {a.error_code}", "", "", "", ""))
            else:
                rows.append((a.name, str(a.num_sequences), str(a.num_tokens), str(a.capacity_tokens),
                             f"{a.occupancy:.1%}", f"{a.fragmentation:.1%}"))
        out += [_columns(rows), ""]
    if status.prefix_cache:
        rows = [("PREFIX CACHE", "DEVICE", "HOST", "DISK", "HIT RATIO", "TOKENS SAVED", "FETCHED FROM PEERS")]
        for p in status.prefix_cache:
            tiers = [f"{t['blocks']} blocks, {t['bytes'] / 2**20:.1f} MiB" for t in p.tiers.values()]
            ratio = "-" if p.hit_ratio is None else f"{p.hit_ratio:.1%}"
            rows.append((p.name, *tiers, ratio, _text(p.hit_tokens), _text(p.fetched_tokens)))
        out += [_columns(rows), ""]
    if status.running is None:
        why = f": {status.scheduler_error}" if status.scheduler_error else ""
        out.append(f"requests: unknown (the scheduler did not answer{why})")
    else:
        out.append(f"requests: {status.running} running, {status.waiting} waiting")
    return "\n".join(out)


def _text(value) -> str:
    return "-" if value is None else str(value)


def _columns(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)
