"""Worker failures survived with identical output (docs/reliability.md).

Eight greedy requests stream through a real stack while a worker process is killed
with SIGKILL; every stream must go on without an error and end with exactly the text
of transformers' greedy continuation: no token repeated, none missing."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import grpc
import openai
import pytest
from e2e_helpers import metric_total, start_stack, until
from fault_helpers import MAX_TOKENS, PROMPTS
from fault_helpers import pid as _pid
from fault_helpers import stream_all as _stream_all
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lamina.kvstore.metadata import MetadataConfig, MetadataStore
from lamina.services.config import DeadlinesSection

pytestmark = pytest.mark.timeout(600)
PROBE_S = 2.5  # a prefill worker's health answer, even during a long forward

# (process killed, when: content chunks every stream has first, None: during prefill, stack options,
#  the proof the fault hit the requests: the scheduler's rebuilds at least this many, or a
#  line the named service logged)
CASES = [
    ("attention-0", 3, {"workers": 2, "partition": "request"}, ("rebuilds", 1)),
    ("attention-1", None, {"workers": 2, "partition": "request"}, ("rebuilds", 1)),
    ("model-0", 3, {"model_workers": 2}, ("rebuilds", 1)),
    # Rotational: the peer running slices for the coordinator (model-0) dies; the
    # coordinator runs them itself from then on (nothing to rebuild: the KV is intact).
    ("model-1", 3, {"model_workers": 2, "pipeline_mode": "rotational"},
     ("model-0", "dropping peer model worker 1")),
    # Two prefill workers, one killed as the prompts arrive: its prefills fail, and they
    # and every later prompt go to the other one (it is never restarted here).
    ("prefill-0", None, {"prefill_workers": 2}, ("rebuilds", 1)),
]


def _case_id(victim: str, after_chunks: int | None, options: dict, proof: tuple) -> str:
    mode = f"-{options['pipeline_mode']}" if "pipeline_mode" in options else ""
    return f"{victim}-{'prefill' if after_chunks is None else 'decode'}{mode}"


@pytest.mark.parametrize(("victim", "after_chunks", "options", "proof"), CASES, ids=[_case_id(*c) for c in CASES])
def test_streams_survive_a_killed_worker(victim, after_chunks, options, proof, references):
    stack = start_stack(**options)
    try:
        pid = _pid(stack, victim)
        texts = asyncio.run(_stream_all(stack.base_url, lambda: os.kill(pid, signal.SIGKILL), after_chunks))
        assert texts == references
        if proof[0] == "rebuilds":
            assert metric_total(stack, "scheduler", "scheduler-0", "lamina_scheduler_rebuilds_total") >= proof[1]
        else:
            service, line = proof
            assert line in (stack.log_dir / f"{service}.log").read_text()
        # The stack still serves, and nothing is left behind on the attention workers
        # (the killed one, if it was one, is gone: its KV with it).
        assert stack.processes and [sp.name for sp in stack.processes if sp.proc.poll() is not None] == [victim]
    finally:
        stack.stop()


def test_a_killed_colocated_model_worker_is_rebuilt_on_the_other(references):
    """Colocated: each model worker holds its own sequences' KV. One killed mid-decode
    takes that KV with it; its requests are rebuilt (counted) on the other model worker,
    and every stream ends as transformers' greedy continuation."""
    from e2e_helpers import attention_stats

    stack = start_stack(model_workers=2, layout="colocated")
    try:
        assert not [sp for sp in stack.processes if sp.name.startswith("attention")]
        pid = _pid(stack, "model-1")

        async def kill_while_it_holds_sequences() -> int:
            # Its decode outruns the streams' chunks on two cores: judged by the KV it holds.
            while True:
                held = (await attention_stats(stack))[1].num_sequences
                if held:
                    os.kill(pid, signal.SIGKILL)
                    return held
                await asyncio.sleep(0.05)

        async def run() -> tuple[list, int]:
            streams = asyncio.create_task(_stream_all(stack.base_url, lambda: None, None))
            held = await kill_while_it_holds_sequences()
            return await streams, held

        texts, held = asyncio.run(run())
        assert texts == references
        assert held >= 1
        assert [sp.name for sp in stack.processes if sp.proc.poll() is not None] == ["model-1"]
        # Whatever stage each was at (its prompt's KV arriving, or decoding), those it held were rebuilt.
        assert metric_total(stack, "scheduler", "scheduler-0", "lamina_scheduler_rebuilds_total") >= 1
    finally:
        stack.stop()


def test_a_stopped_worker_is_failed_over_within_the_reply_deadline(references):
    """SIGSTOP: the worker is alive but answers nothing. Its requests move to the other
    worker once `deadlines.reply_s` passes, and still end with the right text."""
    stack = start_stack(workers=2, partition="request", deadlines=DeadlinesSection(reply_s=3.0, health_s=1.0))
    pid = _pid(stack, "attention-0")
    try:
        start = time.monotonic()
        texts = asyncio.run(_stream_all(stack.base_url, lambda: os.kill(pid, signal.SIGSTOP), 3))
        assert texts == references
        assert time.monotonic() - start < 120
        assert metric_total(stack, "scheduler", "scheduler-0", 'lamina_scheduler_rebuilds_total{stage="decode"}') >= 1
    finally:
        os.kill(pid, signal.SIGCONT)
        stack.stop()


def test_a_hung_model_worker_is_replaced_by_another(references):
    """SIGSTOP a model worker mid-decode: after `deadlines.step_s` without a step result
    its requests are rebuilt and join the other model worker. When it resumes, frames
    of its interrupted step address the old KV ids and change nothing."""
    stack = start_stack(model_workers=2, deadlines=DeadlinesSection(step_s=4.0, health_s=1.0))
    pid = _pid(stack, "model-0")
    try:
        texts = asyncio.run(_stream_all(stack.base_url, lambda: os.kill(pid, signal.SIGSTOP), 3))
        assert texts == references
        assert metric_total(stack, "scheduler", "scheduler-0", "lamina_scheduler_rebuilds_total") >= 1
        os.kill(pid, signal.SIGCONT)
        assert asyncio.run(_stream_all(stack.base_url, lambda: None, None)) == references
    finally:
        os.kill(pid, signal.SIGCONT)
        stack.stop()


def test_a_hung_scheduler_ends_its_requests_within_the_deadline(references):
    """SIGSTOP the scheduler: the gateway's Stats poll goes unanswered, and after
    `deadlines.rpc_s` the requests waiting on it end with an error instead of hanging.
    Once it resumes, the stack serves again."""
    stack = start_stack(deadlines=DeadlinesSection(rpc_s=5.0))
    pid = _pid(stack, "scheduler")
    try:
        start = time.monotonic()
        outcomes = asyncio.run(_stream_all(stack.base_url, lambda: os.kill(pid, signal.SIGSTOP), 3, errors=True))
        assert time.monotonic() - start < 60
        assert all(isinstance(o, openai.APIError) or o == ref for o, ref in zip(outcomes, references)), outcomes
        assert any("has not answered" in str(o) for o in outcomes), outcomes
        os.kill(pid, signal.SIGCONT)
        assert asyncio.run(_stream_all(stack.base_url, lambda: None, None)) == references
    finally:
        os.kill(pid, signal.SIGCONT)
        stack.stop()


def test_requests_end_with_a_clear_error_when_no_placement_is_left(references):
    """Head-level partitioning needs every worker: with one stopped, the requests end
    with an error naming the cause once the recovery deadline passes (no hang)."""
    d = DeadlinesSection(reply_s=2.0, health_s=1.0, recovery_s=4.0)
    stack = start_stack(workers=2, partition="head", deadlines=d)
    pid = _pid(stack, "attention-1")
    try:
        start = time.monotonic()
        outcomes = asyncio.run(_stream_all(stack.base_url, lambda: os.kill(pid, signal.SIGSTOP), 2, errors=True))
        elapsed = time.monotonic() - start
        # A short answer ("The capital of France is Paris.") can end before the slowest
        # stream has its two chunks and the worker is stopped: such a stream ends with its
        # whole, right text; every other one with the error.
        errors = [o for o in outcomes if isinstance(o, openai.APIError)]
        assert all(isinstance(o, openai.APIError) or o == ref for o, ref in zip(outcomes, references)), outcomes
        assert len(errors) >= len(outcomes) // 2, outcomes
        assert all("attention worker" in str(o) for o in errors), outcomes
        assert elapsed < 60
    finally:
        os.kill(pid, signal.SIGCONT)
        stack.stop()


def test_seeded_samples_are_the_same_with_and_without_a_failure():
    stack = start_stack(workers=2, partition="request")
    try:
        async def sample_all() -> list[str]:
            client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
            model = (await client.models.list()).data[0].id
            try:
                outs = await asyncio.gather(*(client.completions.create(
                    model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=100 + i,
                    extra_body={"ignore_eos": True, "return_token_ids": True}) for i, p in enumerate(PROMPTS[:4])))
            finally:
                await client.close()
            return [o.choices[0].model_extra["token_ids"] for o in outs]

        clean = asyncio.run(sample_all())
        pid = _pid(stack, "attention-0")

        def steps() -> float:
            return metric_total(stack, "model", "model-0", "lamina_model_steps_total")

        async def with_kill() -> list[str]:
            before = await asyncio.to_thread(steps)
            task = asyncio.create_task(sample_all())
            # Killed once the samples are decoding (each is 40 tokens): a few steps run.
            while True:
                if await asyncio.to_thread(steps) >= before + 3:
                    os.kill(pid, signal.SIGKILL)
                    return await task
                await asyncio.sleep(0.05)  # polls another process's counter: nothing to wait on

        assert asyncio.run(with_kill()) == clean
        assert metric_total(stack, "scheduler", "scheduler-0", "lamina_scheduler_rebuilds_total") >= 1
    finally:
        stack.stop()


def test_redis_restarted_mid_run(references):
    """The metadata store restarts empty: requests in flight go on, every service
    registers again, running requests' placements and journal are written again, and
    once they end nothing is left behind."""
    stack = start_stack(workers=2, partition="request")
    try:
        texts = asyncio.run(_stream_all(stack.base_url, stack.redis.restart, 3))
        assert texts == references

        async def settled() -> tuple[dict, set, list]:
            store = MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace))
            try:
                deadline = time.monotonic() + 30
                while True:  # heartbeats re-register; frees and journal batches land
                    kinds = {k: len(await store.list_services(k))
                             for k in ("attention", "model", "prefill", "scheduler", "gateway")}
                    placed, journal = await store.placed_requests(), await store.read_journal()
                    if (sum(kinds.values()) == 6 and not placed and not journal) or time.monotonic() > deadline:
                        return kinds, placed, journal
                    await asyncio.sleep(0.5)
            finally:
                await store.close()

        kinds, placed, journal = asyncio.run(settled())
        assert kinds == {"attention": 2, "model": 1, "prefill": 1, "scheduler": 1, "gateway": 1}
        assert placed == set() and journal == []
        again = asyncio.run(_stream_all(stack.base_url, lambda: None, None))
        assert again == references
    finally:
        stack.stop()


def test_n_choices_survive_a_killed_attention_worker():
    """Three seeded choices forked from one prompt: their attention worker is killed
    mid-decode, each choice is rebuilt on the other one from its own tokens, and every
    choice ends as it does without the failure; nothing is left placed or journaled."""
    from e2e_helpers import attention_stats, service_metric

    stack = start_stack(workers=2, partition="request")
    try:
        async def sample(kill=None) -> list[list[int]]:
            client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
            model = (await client.models.list()).data[0].id
            ids: list[list[int]] = [[], [], []]
            try:
                stream = await client.completions.create(
                    model=model, prompt=PROMPTS[2], n=3, max_tokens=MAX_TOKENS, temperature=0.8, seed=7,
                    stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
                async for chunk in stream:
                    for c in chunk.choices:
                        ids[c.index] += c.model_extra["token_ids"]
                    if kill is not None and min(map(len, ids)) >= 3:
                        await kill()
                        kill = None
            finally:
                await client.close()
            return ids

        clean = asyncio.run(sample())
        assert len({tuple(i) for i in clean}) == 3 and all(len(i) == MAX_TOKENS for i in clean)

        async def kill_holder() -> None:
            (holder,) = [w for w, s in enumerate(await attention_stats(stack)) if s.num_sequences]
            os.kill(_pid(stack, f"attention-{holder}"), signal.SIGKILL)

        assert asyncio.run(sample(kill_holder)) == clean
        assert service_metric(stack, "scheduler", "scheduler-0", 'lamina_scheduler_rebuilds_total{stage="decode"}') == 3

        async def left() -> tuple[set, list]:
            store = MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace))
            try:
                for _ in range(60):  # journal batches and placement deletions land
                    placed, journal = await store.placed_requests(), await store.read_journal()
                    if not placed and not journal:
                        break
                    await asyncio.sleep(0.5)
                return placed, journal
            finally:
                await store.close()

        assert asyncio.run(left()) == (set(), [])
    finally:
        stack.stop()


def test_a_prefill_longer_than_the_rpc_deadline_is_not_a_lost_worker():
    """A prompt whose forward outlasts `deadlines.rpc_s` on these cores, and a short request
    queued behind it at the one prefill worker: the scheduler waits for the tokens queued
    there (services/scheduler/prefill_deadline.py) instead of taking the worker for lost
    at rpc_s, rebuilding the prompt onto it again and failing both (as it did). The long
    call did outlast rpc_s; nothing was rebuilt and no prefill call failed.

    Meanwhile the prefill worker answers: its forward runs off its event loop
    (services/prefill/forward_thread.py), so its health probes are answered within
    PROBE_S all through the forward and its registration never lapses (with the forward
    on the loop, a probe waited for the forward's end and the 10 s registration lapsed)."""
    rpc_s = 3.0
    stack = start_stack(workers=1, micro_batches=1, deadlines=DeadlinesSection(rpc_s=rpc_s))
    try:
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        long_prompt = [100 + (i * 7919) % 40000 for i in range(5000)]  # within an attention worker's KV

        async def in_flight() -> bool:
            async with aiohttp.ClientSession() as session, session.get(stack.base_url + "/metrics") as r:
                text = await r.text()
            return sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("lamina_gateway_requests_in_flight")) >= 1

        async def probe_prefill(until_done: asyncio.Task) -> list[tuple[float, bool, bool]]:
            """(seconds to answer, serving, registered) of the prefill worker, every 0.5 s
            until `until_done` ends; a probe unanswered within PROBE_S counts as not serving."""
            store = MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace))
            probes = []
            try:
                info = await store.get_service("prefill", "prefill-0")
                async with grpc.aio.insecure_channel(info.endpoint) as channel:
                    health = health_pb2_grpc.HealthStub(channel)
                    while not until_done.done():
                        start = time.monotonic()
                        try:
                            answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_S)
                            serving = answer.status == health_pb2.HealthCheckResponse.SERVING
                        except grpc.aio.AioRpcError:
                            serving = False
                        registered = await store.get_service("prefill", "prefill-0") is not None
                        probes.append((time.monotonic() - start, serving, registered))
                        await asyncio.sleep(0.5)
            finally:
                await store.close()
            return probes

        async def both() -> tuple[float, list, list]:
            model = (await client.models.list()).data[0].id
            start = time.monotonic()
            long = asyncio.create_task(client.completions.create(model=model, prompt=long_prompt, max_tokens=4,
                                                                 temperature=0))
            await until(in_flight, every_s=0.05)  # the short request is sent after it
            probes = asyncio.create_task(probe_prefill(long))
            short = await client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                                    temperature=0)
            done = await long
            return time.monotonic() - start, [done, short], await probes

        elapsed, (long, short), probes = asyncio.run(both())
        assert long.usage.prompt_tokens == 5000 and long.usage.completion_tokens == 4
        assert short.usage.completion_tokens == 4
        assert elapsed > rpc_s, f"the prompt took {elapsed:.1f} s: no longer than rpc_s, so this proves nothing"
        assert len(probes) >= 3, f"{len(probes)} probes during the long prompt: too short to tell"
        assert all(serving and registered for _, serving, registered in probes), probes
        assert max(s for s, _, _ in probes) < PROBE_S, probes
        assert metric_total(stack, "scheduler", "scheduler-0", "lamina_scheduler_rebuilds_total") == 0
        assert "failed (DEADLINE_EXCEEDED" not in (stack.log_dir / "scheduler.log").read_text()
    finally:
        stack.stop()
