"""`lamina prefill`: a prefill worker (prompt forward, KV hand-off to attention workers)."""

from __future__ import annotations

import argparse

from lamina.commands._service_args import add_indexed, run_indexed_service


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_indexed(p, "prefill workers")


def run(args: argparse.Namespace) -> int:
    return run_indexed_service(args, "lamina.services.prefill.prefill_service", "prefill")
