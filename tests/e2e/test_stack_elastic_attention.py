"""An elastic attention pool (attention.max_workers above attention.workers): a worker
started after the stack joins it and gets requests, one that stops leaves it and gets
none, one that comes back joins again; greedy outputs equal transformers' throughout."""

from __future__ import annotations

import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2e_helpers import MAX_TOKENS, complete, service_metric, start_stack

pytestmark = pytest.mark.timeout(300)

POOL = "lamina_scheduler_attention_workers"


def _pool_size(stack) -> float:
    return service_metric(stack, "scheduler", "scheduler-0", POOL)


def _until_pool(stack, size: int, timeout_s: float = 40.0) -> None:
    # The scheduler re-lists registrations every half service TTL (5 s by default).
    deadline = time.monotonic() + timeout_s
    while _pool_size(stack) != size:
        assert time.monotonic() < deadline, f"the attention pool did not reach {size} in {timeout_s:.0f} s"
        time.sleep(0.5)  # polling another process's metrics: nothing to wait on


def _metric_sum(stack, kind: str, service_id: str, prefix: str) -> float:
    """The sum of a service's samples whose line starts with `prefix` (its /metrics); 0
    when it has none (a labelled counter shows no sample before its first count)."""
    import asyncio

    from lamina.kvstore.metadata import MetadataConfig, MetadataStore

    async def port() -> int:
        async with MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace)) as s:
            info = await s.get_service(kind, service_id)
        assert info is not None, f"{service_id} is not registered"
        return int(info.meta["metrics_port"])

    with urllib.request.urlopen(f"http://{stack.config.host}:{asyncio.run(port())}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(prefix))


def _frames_handled(stack, service_id: str) -> float:
    """Data-plane frames an attention worker handled, every kind summed."""
    return _metric_sum(stack, "attention", service_id, "lamina_attention_frames_total{")


def _all_exact(stack, reference_outputs, copies: int = 2) -> None:
    """Every reference prompt `copies` times at once (so that placements overlap and
    spread over the pool); each greedy output equals transformers'."""
    cases = [r for r in reference_outputs.values()] * copies
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda r: complete(stack, r["prompt_ids"], MAX_TOKENS), cases))
    for r, result in zip(cases, results):
        assert result["choices"][0]["text"] == r["text"]


def test_attention_workers_join_and_leave_a_running_stack(reference_outputs):
    stack = start_stack(workers=1, micro_batches=1, attention_max_workers=2)
    try:
        assert _pool_size(stack) == 1
        _all_exact(stack, reference_outputs)

        stack.add("attention-1", ["attention", "--index", "1"], service_id="attention-1")
        _until_pool(stack, 2)
        before = _frames_handled(stack, "attention-1")
        _all_exact(stack, reference_outputs)
        assert _frames_handled(stack, "attention-1") > before, "the joined worker got no request"

        (joined,) = [sp for sp in stack.processes if sp.name == "attention-1"]
        joined.proc.send_signal(signal.SIGTERM)  # scaled down: it deregisters and exits
        assert joined.proc.wait(30) == 0
        _until_pool(stack, 1)
        _all_exact(stack, reference_outputs)
        # Nothing was placed on the worker that left: no request needed its KV rebuilt.
        assert _metric_sum(stack, "scheduler", "scheduler-0", "lamina_scheduler_rebuilds_total") == 0

        stack.restart("attention-1")  # back, at a new address
        _until_pool(stack, 2)
        before = _frames_handled(stack, "attention-1")
        _all_exact(stack, reference_outputs)
        assert _frames_handled(stack, "attention-1") > before
    finally:
        stack.stop()

