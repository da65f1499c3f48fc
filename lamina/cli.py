"""The `lamina` command: one entry point, one module per subcommand.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`.
Modules are imported only when their subcommand runs, so `lamina --help` stays
fast and a service does not import what it never uses (torch, grpc, ucxx).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("lamina.commands.generate", "generate text with the local engine"),
    "up": ("lamina.commands.up", "start the whole stack: Redis, every service, the OpenAI API"),
    "status": ("lamina.commands.status", "every service of a running cluster, KV occupancy, requests"),
    "gateway": ("lamina.commands.gateway", "the OpenAI-compatible HTTP/SSE gateway"),
    "scheduler": ("lamina.commands.scheduler", "the scheduler (continuous batching, KV placement)"),
    "prefill": ("lamina.commands.prefill", "a prefill worker"),
    "model": ("lamina.commands.model", "a model-slice worker"),
    "attention": ("lamina.commands.attention", "an attention worker"),
    "plan": ("lamina.commands.plan", "rank deployments, quantization and threads for a workload (planner)"),
    "profile": ("lamina.commands.profile", "measure this machine for the planner (writes the this-machine profile)"),
    "health": ("lamina.commands.health", "probe one service's health (gRPC health protocol or /health)"),
    "cache": ("lamina.commands.cache", "list the model cache's entries; `prune` removes those no longer read"),
}


def _entry(name: str):
    def entry() -> int:
        return main([name, *sys.argv[1:]])

    return entry


gateway_main = _entry("gateway")
scheduler_main = _entry("scheduler")
prefill_main = _entry("prefill")
model_main = _entry("model")
attention_main = _entry("attention")
up_main = _entry("up")


def build_parser() -> argparse.ArgumentParser:
    from lamina import __version__

    parser = argparse.ArgumentParser(prog="lamina", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"lamina {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = build_parser()
        if not argv:
            parser.print_help()
            return 2
        parser.parse_args(argv)  # prints the usage error and exits
        return 2
    name = argv[0]
    if name not in ("generate", "status", "plan", "profile", "health", "cache"):  # the commands that are not services
        from lamina.lifetime import die_with_parent

        die_with_parent()  # a service started by a launcher ends with it
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"lamina {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
