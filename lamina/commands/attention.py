"""`lamina attention`: an attention worker (KV slabs and attention math)."""

from __future__ import annotations

import argparse

from lamina.commands._service_args import add_common, stack_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    p.add_argument("--index", type=int, default=0, help="this worker's index among the attention workers")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: attention.threads)")


def run(args: argparse.Namespace) -> int:
    config = stack_config(args)
    if config is None:
        return 2
    if not 0 <= args.index < config.attention.workers:
        print(f"lamina attention: --index must be below attention.workers ({config.attention.workers})")
        return 2
    from services.attention_service import serve

    serve(config, args.index, args.threads)
    return 0
