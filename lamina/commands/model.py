"""`lamina model`: the model-slice worker (weights, slices, sampling)."""

from __future__ import annotations

import argparse

from lamina.commands._service_args import add_common, stack_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    p.add_argument("--threads", type=int, default=None, help="torch threads")


def run(args: argparse.Namespace) -> int:
    config = stack_config(args)
    if config is None:
        return 2
    from services.model_service import serve

    serve(config, args.threads)
    return 0
