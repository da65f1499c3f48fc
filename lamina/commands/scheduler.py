"""`lamina scheduler`: continuous batching, KV placement, prefill and decode driving."""

from __future__ import annotations

import argparse

from lamina.commands._service_args import add_common, run_service


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)


def run(args: argparse.Namespace) -> int:
    return run_service(args, "lamina.services.scheduler.scheduler_service")
