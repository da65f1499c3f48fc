"""`lamina attention`: an attention worker (KV slabs and attention math)."""

from __future__ import annotations

import argparse

from lamina.commands._service_args import add_indexed, add_kv_quant, run_indexed_service


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_indexed(p, "attention workers")
    add_kv_quant(p)


def run(args: argparse.Namespace) -> int:
    return run_indexed_service(args, "lamina.services.attention.attention_service", "attention",
                               **{"attention.kv_quant": args.kv_quant})
