"""Fuzzing the attention workers' data plane in a real stack: thousands of hostile
frames (valid checksums, broken rules) and corrupted ones (flipped bits, cut short,
lengths they do not hold), while a real request decodes beside them.

Every hostile frame gets an ERROR reply on a connection that stays up; a corrupted
one may cost its own connection, nothing more. The workers stay alive, their own
sequences keep exactly their KV, and the request's tokens equal a run before the
fuzzing. The seed (LAMINA_FUZZ_SEED) is printed on failure.

The stack is the one the fault tests that kill nothing share (fault_helpers.ONE_WORKER):
one attention worker, so the real request's KV is on the worker being fuzzed."""

from __future__ import annotations

import asyncio
import os
import random
import urllib.request
from urllib.parse import urlsplit

import openai
import pytest
import torch
from fault_helpers import ONE_WORKER
from frame_fuzz import HKV, HQ, HostileFrames, L, corrupt, frame_bytes

from lamina import transports
from lamina.kvstore.metadata import MetadataConfig, MetadataStore
from lamina.model.attention import batched_attention
from lamina.services.channels import open_channel
from lamina.services.protos import lamina_pb2, lamina_pb2_grpc
from lamina.services.wire import Attend, Kind, StoreKV
from lamina.transports.handshake import client_handshake

pytestmark = [pytest.mark.timeout(300), pytest.mark.stack(ONE_WORKER)]

SEED = int(os.environ.get("LAMINA_FUZZ_SEED", "1123"))
NUM_HOSTILE = 1500  # on one connection per worker
NUM_CORRUPTED = 600  # one connection each
PROMPT = "The history of the printing press began"
MAX_TOKENS = 24
HELD = 5  # tokens of each worker's own fuzzing sequence


async def _workers(stack) -> list:
    store = MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace))
    try:
        return sorted(await store.list_services("attention"), key=lambda s: s.service_id)
    finally:
        await store.close()


async def _stats(stack, worker) -> lamina_pb2.AttentionStats:
    async with open_channel(worker.meta["grpc"], stack.config.cluster_token) as ch:
        return await lamina_pb2_grpc.AttentionControlStub(ch).Stats(lamina_pb2.Empty())


def _error_counts(worker) -> dict[str, float]:
    """The worker's refused frames by code, from its Prometheus metrics."""
    url = f"http://127.0.0.1:{worker.meta['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    prefix = 'lamina_attention_errors_total{code="'
    return {line[len(prefix):].split('"')[0]: float(line.split()[-1])
            for line in text.splitlines() if line.startswith(prefix)}


async def _complete(client: openai.AsyncOpenAI, model: str) -> list[int]:
    r = await client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
    return r.choices[0].model_extra["token_ids"]


async def _hostile(conn: transports.Connection, frames: HostileFrames, count: int) -> None:
    for i in range(count):
        batch, tag = frames.next()
        for f in batch:
            await conn.send(f)
        reply = await asyncio.wait_for(conn.recv(), 30)
        assert reply.kind == Kind.ERROR, f"hostile frame {i} ({batch[-1].kind}, {batch[-1].header!r:.200}) " \
                                         f"got kind {reply.kind}"
        assert reply.header.get("tag") == tag and reply.header["code"], reply.header


async def _corrupted(endpoint: str, tcfg: transports.TransportConfig, rng: random.Random, count: int) -> dict:
    """Each damaged frame on its own raw connection: send it, end the stream, read
    until the worker closes its side. Returns how often each damage was done."""
    host, port = urlsplit(endpoint).hostname, urlsplit(endpoint).port
    base = [Attend(Kind.ATTEND, (8, 0, 0), 0, [("ghost", 1)], torch.randn(1, HQ, 64), torch.randn(1, HKV, 64),
                   torch.randn(1, HKV, 64)).to_frame(),
            StoreKV("ghost", 3, L, torch.randn(2, HKV, 64), torch.randn(2, HKV, 64)).to_frame()]
    seen: dict[str, int] = {}
    for _ in range(count):
        what, data = corrupt(rng, frame_bytes(rng.choice(base), tcfg.checksum_payloads), tcfg.max_frame_bytes)
        seen[what] = seen.get(what, 0) + 1
        reader, writer = await asyncio.open_connection(host, port)
        try:
            async def send(b: bytes, writer: asyncio.StreamWriter = writer) -> None:
                writer.write(b)
                await writer.drain()

            await client_handshake(send, reader.readexactly, tcfg.auth_token)
            writer.write(data)
            await writer.drain()
            writer.write_eof()
            await asyncio.wait_for(reader.read(), 30)  # to EOF: whatever replies, then the close
        except ConnectionResetError:
            pass  # the worker dropped the connection with our bytes unread
        finally:
            writer.close()
    return seen


async def _fuzz(stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = (await client.models.list()).data[0].id
    before = await _complete(client, model)
    workers = await _workers(stack)
    tcfg = stack.config.transport_config()
    conns = [await transports.connect(w.endpoint, tcfg) for w in workers]
    rng = random.Random(SEED)
    try:
        # Each worker holds a sequence of the fuzzer's own, which hostile frames name.
        own = []
        for w, conn in enumerate(conns):
            kv = [(torch.randn(HELD, HKV, 64), torch.randn(HELD, HKV, 64)) for _ in range(L)]
            for layer, (k, v) in enumerate(kv):
                await conn.send(StoreKV(f"fuzz-{w}", layer, L, k, v).to_frame())
            assert (await conn.recv()).kind == Kind.ACK
            own.append(kv)
        stop = asyncio.Event()

        async def decode_beside() -> list[list[int]]:
            runs = [await _complete(client, model)]
            while not stop.is_set():
                runs.append(await _complete(client, model))
            return runs

        beside = asyncio.create_task(decode_beside())
        try:
            await asyncio.gather(*(_hostile(conn, HostileFrames(random.Random(rng.random()), f"fuzz-{w}", HELD),
                                            NUM_HOSTILE // len(conns)) for w, conn in enumerate(conns)))
            seen = await _corrupted(workers[0].endpoint, tcfg, random.Random(rng.random()), NUM_CORRUPTED)
            assert len(seen) == 7, seen  # every kind of damage was done
        finally:
            stop.set()
            runs = await beside
        assert stack.dead_process() is None
        assert all(r == before for r in runs), (before, runs)
        for worker in workers:  # every refusal was one the checks made, none a failure inside the worker
            errors = _error_counts(worker)
            assert "internal" not in errors and sum(errors.values()) >= NUM_HOSTILE // len(workers), errors
        # The hostile frames' connections are still up, and each worker's own sequence
        # holds exactly its prompt KV: a decode step over it equals local attention.
        for w, conn in enumerate(conns):
            q, k, v = torch.randn(1, HQ, 64), torch.randn(1, HKV, 64), torch.randn(1, HKV, 64)
            await conn.send(Attend(Kind.ATTEND, (9, w, 0), 0, [(f"fuzz-{w}", 1)], q, k, v).to_frame())
            reply = await conn.recv()
            assert reply.kind == Kind.RESULT, reply.header
            ref, _ = batched_attention(q, [1], [torch.cat([own[w][0][0], k])], [torch.cat([own[w][0][1], v])])
            torch.testing.assert_close(reply.tensors[0], ref, atol=1e-5, rtol=1e-4)
        for w, worker in enumerate(workers):
            async with open_channel(worker.meta["grpc"], stack.config.cluster_token) as ch:
                await lamina_pb2_grpc.AttentionControlStub(ch).Free(lamina_pb2.FreeRequest(seq_ids=[f"fuzz-{w}"]))
        for _ in range(100):  # the request's KV is freed when its stream ends: poll the workers
            stats = [await _stats(stack, worker) for worker in workers]
            if all(s.num_sequences == 0 for s in stats):
                break
            await asyncio.sleep(0.1)
        assert [(s.num_sequences, s.num_tokens) for s in stats] == [(0, 0)] * len(workers)
    finally:
        await asyncio.gather(*(c.close() for c in conns))


def test_hostile_and_corrupted_frames_leave_the_workers_serving(stack):
    print(f"fuzz seed: {SEED} (set LAMINA_FUZZ_SEED to replay)")
    asyncio.run(_fuzz(stack))
