"""A burst's first prefilled requests wait for the rest before an idle model worker
decodes them (lamina.services.scheduler.join_hold), and a prefill batch waits for the
rest of a burst (lamina.services.prefill.prefill_service.rest_of_burst)."""

from __future__ import annotations

import asyncio
import time

from lamina.services.config import load_config
from lamina.services.prefill.prefill_service import rest_of_burst
from lamina.services.protos import lamina_pb2
from lamina.services.scheduler.join_hold import holds_join
from lamina.services.scheduler.scheduler_service import SchedulerService
from lamina.services.scheduler.scheduler_state import Status


def test_only_an_idle_worker_sharing_its_host_with_prefills_in_flight_waits():
    assert holds_join(0, 3, True, 5.0)
    assert not holds_join(1, 3, True, 5.0)  # it decodes already: its steps run anyway
    assert not holds_join(0, 0, True, 5.0)  # no other prompt is coming
    assert not holds_join(0, 3, False, 5.0)  # the prefills compute on other cores
    assert not holds_join(0, 3, True, 0.0)  # switched off


class _Stream:
    """A model worker's decode stream as DecodeStreams sees it: the updates it was sent."""

    def __init__(self, num_sequences: int = 0) -> None:
        self.alive = True
        self.num_sequences = num_sequences
        self.updates: list[list[str]] = []

    def join(self, seqs: list[lamina_pb2.StepSequence]) -> None:
        self.num_sequences += len(seqs)
        self.updates.append([s.seq_id for s in seqs])

    async def close(self) -> None:
        self.alive = False


def _scheduler(hold_ms: float, streams: list[_Stream], shares_host: bool = True) -> SchedulerService:
    config = load_config(env={}, overrides={"redis_url": "redis://127.0.0.1:1", "scheduler.join_hold_ms": hold_ms,
                                            "model_worker.workers": len(streams)})
    svc = SchedulerService(config)  # no Redis call is made here
    svc.decode.streams = streams  # type: ignore[assignment]
    svc.decode.shares_host = [shares_host] * len(streams)
    svc.attention.capacity_tokens = [10_000] * len(streams)
    return svc


def _prefilled(svc: SchedulerService, rid: str):
    """A request as its prefill leaves it: placed, its first token sampled."""
    req = svc.submit(lamina_pb2.GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                                                params=lamina_pb2.SamplingParams(max_tokens=8)))
    svc.admission.waiting.remove(req)
    req.workers = [0]
    req.output_ids.append(7)
    return req


async def test_the_last_prefilled_request_takes_the_held_ones_along_in_one_update():
    stream = _Stream()
    svc = _scheduler(60_000, [stream])
    reqs = [_prefilled(svc, f"r{i}") for i in range(4)]
    for i, req in enumerate(reqs[:3]):
        svc.admission.num_prefilling = 3 - i  # the others' prefills still in flight
        svc.decode.join(req)
    assert stream.updates == [] and [r.status for r in reqs[:3]] == [Status.RUNNING] * 3
    reqs[1].status = Status.FINISHED  # aborted while it waited: finish freed its KV, nothing joins
    svc.admission.num_prefilling = 0
    svc.decode.join(reqs[3])
    assert stream.updates == [[reqs[0].kv_id, reqs[2].kv_id, reqs[3].kv_id]]
    assert set(svc.decode.decoding) == {reqs[0].kv_id, reqs[2].kv_id, reqs[3].kv_id}
    assert all(svc.decode.decoding[r.kv_id].model_worker == 0 for r in (reqs[0], reqs[2], reqs[3]))
    assert svc.runtime.registry.get_sample_value("lamina_scheduler_held_joins_total") == 3 and svc.decode.held == []
    await svc.decode.close()


async def test_the_wait_ends_after_join_hold_ms_or_when_the_last_prefill_fails():
    stream = _Stream()
    svc = _scheduler(50, [stream])
    first = _prefilled(svc, "a")
    svc.admission.num_prefilling = 5  # prompts that take longer than the hold
    svc.decode.join(first)
    assert stream.updates == []
    await asyncio.sleep(0.5)  # the hold's timer (50 ms) lets it go
    assert stream.updates == [[first.kv_id]]
    # A worker that decodes takes a join at once, prefills in flight or not.
    second = _prefilled(svc, "b")
    svc.decode.join(second)
    assert stream.updates[-1] == [second.kv_id]

    # The prefills it waited for all failed: no join brings the held one along; the
    # admission's prefill task lets it go when the last one ends.
    stream2 = _Stream()
    svc2 = _scheduler(60_000, [stream2])
    held = _prefilled(svc2, "c")
    svc2.admission.num_prefilling = 1
    svc2.decode.join(held)
    failing = _prefilled(svc2, "d")

    async def fails(req, token_ids):
        raise RuntimeError("the prefill worker failed")

    async def finish(req, reason, notify=True):
        req.status = Status.FINISHED

    svc2.admission.prefill_call, svc2.finish = fails, finish
    svc2.admission.num_prefilling = 0
    svc2.admission.start_prefill(failing)
    await asyncio.gather(*svc2.admission.tasks)
    assert stream2.updates == [[held.kv_id]] and failing.status is Status.FINISHED
    await svc.decode.close()
    await svc2.decode.close()


async def test_no_wait_where_the_prefills_run_on_other_hosts_or_the_hold_is_off():
    for svc, stream in [(_scheduler(60_000, [s := _Stream()], shares_host=False), s),
                        (_scheduler(0, [t := _Stream()]), t)]:
        req = _prefilled(svc, "x")
        svc.admission.num_prefilling = 4
        svc.decode.join(req)
        assert stream.updates == [[req.kv_id]]
        assert svc.runtime.registry.get_sample_value("lamina_scheduler_held_joins_total") == 0
        await svc.decode.close()


async def test_held_requests_spread_over_idle_workers_when_they_join():
    streams = [_Stream(), _Stream()]
    svc = _scheduler(60_000, streams)
    reqs = [_prefilled(svc, f"r{i}") for i in range(4)]
    svc.admission.num_prefilling = 1
    for req in reqs[:3]:
        svc.decode.join(req)
    svc.admission.num_prefilling = 0
    svc.decode.join(reqs[3])
    assert sorted(len(u) for s in streams for u in s.updates) == [2, 2]  # one update each, two sequences each
    await svc.decode.close()


async def test_a_batch_waits_while_a_burst_keeps_coming_and_no_longer():
    arrivals = {"n": 1}

    async def burst(every_s: float, count: int) -> None:
        for _ in range(count):
            await asyncio.sleep(every_s)
            arrivals["n"] += 1

    # Prompts 2 ms apart, a 5 ms window: it waits until they stop.
    coming = asyncio.create_task(burst(0.002, 20))
    await asyncio.sleep(0.005)
    assert await rest_of_burst(lambda: arrivals["n"], lambda: 0, 1, 0.005, 1.0, 2048)
    await coming
    assert arrivals["n"] == 21
    # Nothing more came in the window: no wait.
    start = time.monotonic()
    assert not await rest_of_burst(lambda: arrivals["n"], lambda: 0, arrivals["n"], 0.005, 1.0, 2048)
    assert time.monotonic() - start < 0.005
    # A burst that goes on stops the wait at max_wait_s, a full forward at once.
    coming = asyncio.create_task(burst(0.001, 400))
    await asyncio.sleep(0.005)
    start = time.monotonic()
    assert await rest_of_burst(lambda: arrivals["n"], lambda: 0, 21, 0.005, 0.05, 2048)
    assert 0.05 <= time.monotonic() - start < 0.3
    assert not await rest_of_burst(lambda: arrivals["n"], lambda: 4096, 21, 0.005, 1.0, 2048)
    coming.cancel()
