"""`lamina prefill`: the prefill worker (prompt forward, KV hand-off to attention workers)."""

from __future__ import annotations

import argparse

from lamina.commands._service_args import add_common, run_service


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    p.add_argument("--threads", type=int, default=None, help="torch threads")


def run(args: argparse.Namespace) -> int:
    return run_service(args, "services.prefill_service")
