"""`lamina model`: a model-slice worker (weights, slices, sampling)."""

from __future__ import annotations

import argparse

from lamina.commands._service_args import add_indexed, run_indexed_service


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_indexed(p, "model workers")


def run(args: argparse.Namespace) -> int:
    return run_indexed_service(args, "lamina.services.model.model_service", "model_worker")
