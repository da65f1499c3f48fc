"""`lamina cache`: what the model cache holds, and `lamina cache prune` to remove what is
no longer read (lamina.model.cache_entries says which)."""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    listing = sub.add_parser("list", help="every entry: kind, state, size, last use, source (the default)")
    listing.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    prune = sub.add_parser("prune", help="remove entries of another cache format, conversions that died "
                                         "half-way, and with the options more")
    prune.add_argument("--unused-days", type=float, default=None, metavar="D",
                       help="also remove entries not loaded for D days")
    prune.add_argument("--all", action="store_true", dest="everything",
                       help="remove every entry (the next load converts or writes it again)")
    prune.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    p.set_defaults(action="list", json=False)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    raise AssertionError("unreachable")


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def run(args: argparse.Namespace) -> int:
    from lamina.model.cache_entries import models_dir, remove, scan, to_remove
    from lamina.model.checkpoints import cache_root

    root = cache_root()
    entries = scan(root)
    if args.action == "list":
        if args.json:
            print(json.dumps({"models_dir": str(models_dir(root)), "entries": [e.to_dict() for e in entries],
                              "total_bytes": sum(e.size_bytes for e in entries)}))
            return 0
        print(f"{models_dir(root)}: {len(entries)} entries, {_size(sum(e.size_bytes for e in entries))}")
        for e in entries:
            origin = {"gguf": f", converted from {e.source}", "random": f", {e.source}"}.get(e.kind, "")
            print(f"  {e.path.name}\n    {e.kind}, {e.state}, {_size(e.size_bytes)}, last used {_when(e.last_used)}"
                  + (origin if e.source else ""))
        return 0
    if args.unused_days is not None and args.unused_days < 0:
        print("lamina cache prune: --unused-days must be 0 or more", file=sys.stderr)
        return 2
    going = to_remove(entries, time.time(), args.unused_days, args.everything)
    verb = "would remove" if args.dry_run else "removed"
    for e in going:
        if not args.dry_run:
            remove(e)
        print(f"{verb} {e.path.name} ({e.kind}, {e.state}, {_size(e.size_bytes)}, last used {_when(e.last_used)})")
    print(f"{verb} {len(going)} of {len(entries)} entries, {_size(sum(e.size_bytes for e in going))}")
    return 0
