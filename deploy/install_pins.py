"""What `make install` asks pip for beside the torch it installed first.

constraints.txt pins the versions CI resolves, where torch is the CPU build. A CUDA build
of torch (PyPI's for Linux, whatever the Python) pins its own triton, cuda-bindings and
NVIDIA libraries, and pip refuses a constraint that contradicts them: such lines are
dropped (each named on stderr), every other pin kept. UCX's wheels are built per CUDA
major version: the `ucx` extra (ucxx-cu12) beside a CPU or CUDA 12 torch, `ucx-cu13`
(ucxx-cu13) beside a CUDA 13 one.

    python deploy/install_pins.py constraints constraints.txt > .venv/constraints.txt
    python deploy/install_pins.py extras dev,ucx,ray        # the extras for this torch

Run with the virtual environment's Python, after torch (and `packaging`) are installed.
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def torch_closure() -> dict[str, list[Requirement]]:
    """torch and every distribution it requires, installed here, by canonical name: the
    requirements each states for the extras asked of it (torch asks cuda-toolkit for its
    libraries by extras)."""
    found: dict[str, list[Requirement]] = {}
    todo: list[tuple[str, frozenset[str]]] = [("torch", frozenset())]
    while todo:
        raw, asked = todo.pop()
        name = canonicalize_name(raw)
        try:
            stated = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # a requirement whose marker excludes this platform
        reqs = [r for r in map(Requirement, stated)
                if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in ("", *asked))]
        new = [r for r in reqs if r not in found.get(name, [])]
        if not new and name in found:
            continue
        found.setdefault(name, []).extend(new)
        todo.extend((r.name, frozenset(r.extras)) for r in new)
    return found


def contradicted(constraints: list[str]) -> set[int]:
    """Indices of the constraint lines (`name==version`) that a requirement of torch or of
    one of its dependencies excludes."""
    needs: dict[str, list[Requirement]] = {}
    for reqs in torch_closure().values():
        for r in reqs:
            needs.setdefault(canonicalize_name(r.name), []).append(r)
    dropped = set()
    for i, line in enumerate(constraints):
        name, sep, version = line.strip().partition("==")
        if not sep:
            continue
        for r in needs.get(canonicalize_name(name), []):
            if not r.specifier.contains(version, prereleases=True):
                print(f"install_pins: {line.strip()} dropped: torch's dependencies need {r}", file=sys.stderr)
                dropped.add(i)
                break
    return dropped


def extras(asked: str) -> str:
    """The asked extras, `ucx` as the one for this torch's CUDA major version (its NVIDIA
    libraries' names end in -cu13 for CUDA 13)."""
    ucx = "ucx-cu13" if any(name.endswith("-cu13") for name in torch_closure()) else "ucx"
    return ",".join(ucx if e == "ucx" else e for e in asked.split(","))


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("constraints", "extras"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "extras":
        print(extras(argv[1]))
        return 0
    with open(argv[1]) as f:
        lines = f.readlines()
    drop = contradicted(lines)
    sys.stdout.writelines(line for i, line in enumerate(lines) if i not in drop)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
