"""Which Ray nodes each kind of service may run on (`lamina up --ray`): a pure policy.

Every service of a Ray-placed stack is one Ray actor, and each kind of actor asks one
unit of a custom resource, so that it lands only on nodes that declare that resource
(`ray start --resources '{"attention_worker": 2}'`: a node for two attention workers).
The defaults put model and prefill workers on compute nodes and attention workers on
memory nodes; Redis, the scheduler and the gateway ask none, so Ray may put them
anywhere. Actors ask no CPUs of Ray: the services size their own threads
(`*.threads`), and only the custom resources decide placement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# The kinds of actor, as `lamina` names the services (and `redis` for the embedded one).
KINDS = ("redis", "scheduler", "gateway", "prefill", "model", "attention")


@dataclass(frozen=True)
class RayPlacement:
    """The custom resource each kind's actors ask one unit of; None: none (any node)."""

    redis: str | None = None
    scheduler: str | None = None
    gateway: str | None = None
    prefill: str | None = "prefill_worker"
    model: str | None = "model_worker"
    attention: str | None = "attention_worker"

    def resources(self, kind: str) -> dict[str, float]:
        """The `resources=` an actor of `kind` is created with."""
        name = getattr(self, kind)
        return {name: 1.0} if name else {}


def parse_placement(flags: Iterable[str]) -> RayPlacement:
    """The placement of `--ray-resource KIND=NAME` flags (an empty NAME: no resource) over
    the defaults; ValueError naming the flag when one is malformed."""
    changes: dict[str, str | None] = {}
    for flag in flags:
        kind, sep, name = flag.partition("=")
        kind, name = kind.strip(), name.strip()
        if not sep or kind not in KINDS:
            raise ValueError(f"--ray-resource {flag!r}: expected KIND=NAME with KIND one of {', '.join(KINDS)}")
        if name in ("CPU", "GPU", "memory", "object_store_memory") or name.startswith("node:"):
            raise ValueError(f"--ray-resource {flag!r}: {name} is one of Ray's own resources; name a custom one")
        changes[kind] = name or None
    return dataclasses.replace(RayPlacement(), **changes)


def demand(placement: RayPlacement, kinds: Iterable[str]) -> dict[str, float]:
    """Units of each custom resource that actors of `kinds` (one entry per actor) ask."""
    need: dict[str, float] = {}
    for kind in kinds:
        for name, amount in placement.resources(kind).items():
            need[name] = need.get(name, 0.0) + amount
    return need


def shortfalls(need: Mapping[str, float], totals: Mapping[str, float]) -> list[str]:
    """Why the cluster, whose nodes declare `totals` in all (`ray.cluster_resources()`),
    cannot hold actors asking `need`, one line per resource; empty when it can. Counting
    totals, not per node, is enough here: each actor asks one unit of one resource."""
    return [f"{name}: the actors ask {amount:g}, the cluster's nodes declare {totals.get(name, 0):g}"
            for name, amount in sorted(need.items()) if totals.get(name, 0) < amount]
