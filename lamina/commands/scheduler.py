"""`lamina scheduler`: continuous batching, KV placement, prefill and decode driving."""

from __future__ import annotations

import argparse

from lamina.commands._service_args import add_common, stack_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)


def run(args: argparse.Namespace) -> int:
    config = stack_config(args)
    if config is None:
        return 2
    from services.scheduler_service import serve

    serve(config)
    return 0
