"""A real stack's services refuse whoever lacks its cluster token (docs/security.md).

The stack is started without a token, so the launcher makes one. A caller on a raw
gRPC channel cannot make the scheduler generate nor an attention worker free a
sequence's KV (UNAUTHENTICATED), while the same calls through open_channel with the
token work; the data plane refuses a connection without the token; health probes
need none."""

from __future__ import annotations

import grpc
import pytest
from e2e_helpers import attention_stats
from fault_helpers import ONE_WORKER
from grpc_health.v1 import health_pb2, health_pb2_grpc
from shared_stacks import StackPool, StackSpec, shared_stack

from lamina import transports
from lamina.kvstore.metadata import MetadataConfig, MetadataStore
from lamina.services.channels import open_channel
from lamina.services.launch.launcher import Stack
from lamina.services.protos import lamina_pb2, lamina_pb2_grpc

pytestmark = pytest.mark.timeout(600)

PROMPT_IDS = [1, 504, 3458, 282, 4649, 30]
MAX_TOKENS = 48
VICTIM_TOKENS = 160  # long enough to be still decoding while the test calls Free


@pytest.fixture(params=[pytest.param(spec, marks=pytest.mark.stack(spec), id=spec.transport)
                        for spec in (ONE_WORKER, StackSpec("shm", workers=1))])
def stack(request: pytest.FixtureRequest, stack_pool: StackPool) -> Stack:
    """A stack per data-plane transport: shm's socket has its own check (same user) before
    the token handshake. The tcp one is the fault tests' shared stack."""
    return shared_stack(request, stack_pool)


async def _registered(stack, kind: str) -> list:
    store = MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace))
    try:
        return sorted(await store.list_services(kind), key=lambda s: s.service_id)
    finally:
        await store.close()


def _generate_request(request_id: str, max_tokens: int = MAX_TOKENS) -> lamina_pb2.GenerateRequest:
    params = lamina_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return lamina_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT_IDS, params=params)


async def _refused(call) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value


def test_the_launcher_made_a_token(stack):
    token = stack.config.cluster_token
    assert token is not None and len(token) >= 32


async def test_the_scheduler_does_not_generate_without_the_token(stack):
    (scheduler,) = await _registered(stack, "scheduler")
    address = scheduler.meta["grpc"]
    async with open_channel(address, stack.config.cluster_token) as ch:
        before = await lamina_pb2_grpc.SchedulerStub(ch).Stats(lamina_pb2.Empty(), timeout=30)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = lamina_pb2_grpc.SchedulerStub(ch)
        await _refused(stub.Generate(_generate_request("unauthenticated"), timeout=30).read())
        await _refused(stub.Stats(lamina_pb2.Empty(), timeout=30))
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    async with open_channel(address, stack.config.cluster_token) as ch:
        stub = lamina_pb2_grpc.SchedulerStub(ch)
        after = await stub.Stats(lamina_pb2.Empty(), timeout=30)
        # The refused Generate never reached the scheduler: nothing queued, run or stepped.
        assert (after.num_waiting, after.num_running, after.num_steps) == (0, 0, before.num_steps)
        tokens, finish = [], ""
        async for chunk in stub.Generate(_generate_request("authenticated"), timeout=300):
            tokens += chunk.token_ids
            finish = chunk.finish_reason or finish
    assert (len(tokens), finish) == (MAX_TOKENS, "length")


async def test_an_attention_worker_does_not_free_kv_without_the_token(stack):
    """Free of a running request's sequence, without the token, while it decodes: refused,
    and the request ends with every token; with the token the call is served."""
    (attention,) = await _registered(stack, "attention")
    (scheduler,) = await _registered(stack, "scheduler")
    token = stack.config.cluster_token
    async with open_channel(scheduler.meta["grpc"], token) as ch:
        stream = lamina_pb2_grpc.SchedulerStub(ch).Generate(_generate_request("victim", VICTIM_TOKENS), timeout=300)
        first = await stream.read()
        tokens = list(first.token_ids)
        (stats,) = await attention_stats(stack)
        assert stats.num_sequences == 1  # the victim's KV, on the only attention worker
        async with grpc.aio.insecure_channel(attention.meta["grpc"]) as raw:
            stub = lamina_pb2_grpc.AttentionControlStub(raw)
            await _refused(stub.Free(lamina_pb2.FreeRequest(seq_ids=["victim"]), timeout=30))
        async with open_channel(attention.meta["grpc"], "not-the-token") as wrong:
            stub = lamina_pb2_grpc.AttentionControlStub(wrong)
            await _refused(stub.Free(lamina_pb2.FreeRequest(seq_ids=["victim"]), timeout=30))
        (stats,) = await attention_stats(stack)
        assert stats.num_sequences == 1
        finish = first.finish_reason
        while (chunk := await stream.read()) is not grpc.aio.EOF:  # read(), as for the first: no iterator
            tokens += chunk.token_ids
            finish = chunk.finish_reason or finish
    assert (len(tokens), finish) == (VICTIM_TOKENS, "length")
    async with open_channel(attention.meta["grpc"], token) as ch:  # served with the token (nothing left to free)
        await lamina_pb2_grpc.AttentionControlStub(ch).Free(lamina_pb2.FreeRequest(seq_ids=["victim"]), timeout=30)


async def test_the_data_plane_refuses_a_connection_without_the_token(stack):
    (attention,) = await _registered(stack, "attention")
    with pytest.raises(transports.AuthError):
        await transports.connect(attention.endpoint, transports.TransportConfig())
    with pytest.raises(transports.AuthError):
        await transports.connect(attention.endpoint, transports.TransportConfig(auth_token="not-the-token"))
    conn = await transports.connect(attention.endpoint, stack.config.transport_config())
    await conn.close()
