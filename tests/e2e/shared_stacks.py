"""Stacks that several end-to-end tests share, one start for all of them.

A test that only sends requests and reads state asks for its stack by a `StackSpec`:
`@pytest.mark.stack(spec)` and the `stack` fixture (wired up by tests/e2e/conftest.py and
tests/faults/conftest.py). Tests that ask for equal specs run one after another
(`grouped`) on one stack, which the pool stops right after the last of them, so at most
one shared stack runs at a time and none outlives the session: the session's teardown
stops what is left, also after a failure or an interrupt (Ctrl-C), and every service
process ends with the test process anyway (lamina/lifetime.py). A test that needs the
stack as it started (empty prefix caches, counters from zero) says so with
`@pytest.mark.stack(spec, first=True)`: it runs before the others, and fails if the
stack served another test before it. A test that kills, stops, adds or restarts a
process, or changes the configuration, starts its own stack with `start_stack`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from e2e_helpers import start_stack

from lamina import transports
from lamina.services.launch.launcher import Stack

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class StackSpec:
    """The `start_stack` options of a shared stack; equal specs share one stack."""

    transport: str = "tcp"
    partition: str = "request"
    workers: int = 2  # attention workers
    micro_batches: int = 2
    q_early: bool = False
    model_workers: int = 1
    weights: str = "as_file"
    pipeline_mode: str = "fixed"
    prefill_workers: int = 1
    api_key: str | None = None  # the gateway's; None: /v1/ needs none
    layout: str = "disaggregated"
    prefill_threads: int = 0  # prefill.threads (0: the model workers')
    fork_services: bool = True  # False: every service in a fresh interpreter (no forker)

    @property
    def id(self) -> str:
        """A short name for test ids: tcp-2w-request-mb3-qearly, with what differs from
        the defaults appended (-2mw-float32-rotational-2pw-colocated-fresh, -key)."""
        name = f"{self.transport}-{self.workers}w-{self.partition}-mb{self.micro_batches}"
        name += "-qearly" if self.q_early else ""
        name += f"-{self.model_workers}mw" if self.model_workers != 1 else ""
        name += f"-{self.weights}" if self.weights != "as_file" else ""
        name += f"-{self.pipeline_mode}" if self.pipeline_mode != "fixed" else ""
        name += f"-{self.prefill_workers}pw" if self.prefill_workers != 1 else ""
        name += f"-{self.layout}" if self.layout != "disaggregated" else ""
        name += f"-{self.prefill_threads}pt" if self.prefill_threads else ""
        name += "" if self.fork_services else "-fresh"
        return name + ("-key" if self.api_key else "")

    def start(self) -> Stack:
        options = dataclasses.asdict(self)
        api_key = options.pop("api_key")
        return start_stack(**options, **({"api_key": api_key} if api_key else {}))


# The default stack, with an API key: the OpenAI API tests (test_stack_api.py), the web
# pages, which must take the key from their key field (test_stack_observability.py), and
# a row of the transport matrix (test_stack_matrix.py).
API = StackSpec(api_key="e2e-test-key")
# Two model workers stepping three micro-batches each, Q-early, with the linears as float32
# (test_stack_pipeline.py, and a row of the matrix).
PIPELINE_FIXED = StackSpec(micro_batches=3, q_early=True, model_workers=2, weights="float32")
# Rotational: two model workers, three micro-batches (M + 1), head partitioning, the
# GGUF's packed linears (test_stack_pipeline.py, and a row of the matrix).
PIPELINE_ROTATIONAL = StackSpec(partition="head", micro_batches=3, model_workers=2, pipeline_mode="rotational")
# Two prefill workers before one attention worker, head partitioning, one micro-batch,
# Q-early: prefix-aware routing, which needs it as started (test_stack_prefill_routing.py),
# then the matrix's row of head partitioning over one worker (test_stack_matrix.py).
PREFILL_ROUTING = StackSpec(partition="head", workers=1, micro_batches=1, q_early=True, prefill_workers=2)
# Colocated: two model workers, each attending in its own process, and a prefill worker
# whose forwards take up to two threads as the cores allow (test_stack_colocated.py).
COLOCATED = StackSpec(model_workers=2, layout="colocated", prefill_threads=2)


class StackPool:
    """The running shared stacks by spec. `last_users` maps each spec to the id of the last
    test (in run order) that asks for it: `done` stops its stack after that test."""

    def __init__(self, last_users: dict[StackSpec, str]) -> None:
        self.last_users = last_users
        self._stacks: dict[StackSpec, Stack] = {}
        self._failed: dict[StackSpec, str] = {}  # spec -> why its start failed (not retried)
        self._served: set[StackSpec] = set()  # specs whose stack a test has had

    def get(self, spec: StackSpec, fresh: bool = False) -> Stack:
        """The running stack of `spec`, started on first use; with `fresh`, one no test has
        had before. Raises if its start failed before, if it is not fresh as asked, or if
        one of its processes has exited since (a test broke it)."""
        if spec in self._failed:
            raise RuntimeError(f"the shared stack {spec.id} did not start: {self._failed[spec]}")
        if fresh and spec in self._served:
            raise RuntimeError(f"the test needs the stack {spec.id} as it started, but another test had it before")
        self._served.add(spec)
        stack = self._stacks.get(spec)
        if stack is None:
            try:
                stack = self._stacks[spec] = spec.start()
            except Exception as exc:
                self._failed[spec] = f"{type(exc).__name__}: {exc}"
                raise
        dead = stack.dead_process()
        if dead is not None:
            code = dead.proc.returncode if dead.proc is not None else None
            raise RuntimeError(f"the shared stack {spec.id} lost {dead.name} (exit code {code});"
                               f" its log:\n{stack.log_tail(dead.name)}")
        return stack

    def done(self, spec: StackSpec, test_id: str) -> None:
        """Test `test_id` is over: stop its stack if no later test asks for it."""
        if self.last_users.get(spec) == test_id:
            self.stop(spec)

    def stop(self, spec: StackSpec) -> None:
        """Stop the stack of `spec`; its work directory (its configuration, which holds the
        cluster token, and its logs) must be gone with it."""
        stack = self._stacks.pop(spec, None)
        if stack is not None:
            stack.stop()
            assert not stack.work_dir.exists(), f"the stack {spec.id} left {stack.work_dir} behind"

    def close(self) -> None:
        """Stop every stack still running (the session ends, perhaps early): each one, even
        if stopping another raised."""
        with contextlib.ExitStack() as stops:
            for spec in list(self._stacks):
                stops.callback(self.stop, spec)


def grouped(items: list[T], key: Callable[[T], Hashable | None], first: Callable[[T], bool]) -> list[T]:
    """`items` with those of equal key (not None) moved together, at the place of the first
    of them, those for which `first` holds ahead of the rest of their group; the order is
    kept otherwise."""
    groups: dict[Hashable, list[T]] = {}
    order: list[list[T]] = []
    for item in items:
        k = key(item)
        if k is None:
            order.append([item])
        elif k in groups:
            groups[k].append(item)
        else:
            groups[k] = [item]
            order.append(groups[k])
    return [item for group in order for item in sorted(group, key=lambda i: not first(i))]


# ---- the pytest side: what a conftest.py wires up (tests/e2e's, tests/faults') ----------

MARKER = ("stack(spec, first=False): the shared stack (a shared_stacks.StackSpec) the test's `stack` fixture"
          " gives; tests with equal specs run together on one stack, those with first=True before the others")


def spec_of(item: pytest.Item) -> StackSpec | None:
    """The spec of the shared stack `item` runs on, if it asks for one."""
    marker = item.get_closest_marker("stack")
    return marker.args[0] if marker is not None and "stack" in getattr(item, "fixturenames", ()) else None


def needs_fresh(item: pytest.Item) -> bool:
    """Whether `item` needs its shared stack as it started (`first=True` in its mark)."""
    marker = item.get_closest_marker("stack")
    return marker is not None and bool(marker.kwargs.get("first", False))


def order_by_stack(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with the tests of each shared stack one after another, those that need it as
    it started first."""
    return grouped(items, spec_of, needs_fresh)


def open_pool(session: pytest.Session, folder: Path) -> StackPool:
    """A pool for the tests under `folder`, knowing which of them is the last to ask for each spec."""
    last: dict[StackSpec, str] = {}
    for item in session.items:  # in run order
        spec = spec_of(item)
        if spec is not None and folder in item.path.parents:
            last[spec] = item.nodeid
    return StackPool(last)


def shared_stack(request: pytest.FixtureRequest, pool: StackPool) -> Stack:
    """The `stack` fixture's value: the stack its test's mark names, from `pool`; skips where
    the stack's transport cannot run."""
    spec = spec_of(request.node)
    assert spec is not None, "mark the test with @pytest.mark.stack(spec) to say which stack it shares"
    missing = transports.availability(spec.transport)
    if missing:
        pytest.skip(f"{spec.transport} transport unavailable on this machine: {missing}")
    request.addfinalizer(lambda: pool.done(spec, request.node.nodeid))
    return pool.get(spec, fresh=needs_fresh(request.node))


def stack_fixtures(folder: Path) -> tuple[Any, Any]:
    """The `stack_pool` (session) and `stack` (per test) fixtures of the tests under
    `folder`, for its conftest: `stack_pool, stack = stack_fixtures(HERE)`. The pool stops
    every stack it started at the session's end, after a failure or Ctrl-C too."""

    @pytest.fixture(scope="session")
    def stack_pool(request: pytest.FixtureRequest) -> Iterator[StackPool]:
        pool = open_pool(request.session, folder)
        try:
            yield pool
        finally:
            pool.close()

    @pytest.fixture
    def stack(request: pytest.FixtureRequest, stack_pool: StackPool) -> Stack:
        """The shared stack the test's `stack` mark names, for the tests that kill nothing;
        the others start their own."""
        return shared_stack(request, stack_pool)

    return stack_pool, stack
