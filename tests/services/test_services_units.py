"""Service logic without processes: configuration, placement, policies, the attention core, frames."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lamina.model.attention import batched_attention
from lamina.model.config import ModelConfig
from lamina.services.attention.attention_core import AttentionCore
from lamina.services.config import ConfigError, load_config
from lamina.services.placement import head_range, place_request, placeable
from lamina.services.protos import lamina_pb2
from lamina.services.scheduler.scheduler_state import Request, admission_order, admission_refusal, can_admit
from lamina.services.wire import (
    Attend,
    Kind,
    RemoteError,
    StoreKV,
    ack_frame,
    decode_tag,
    error_frame,
    expect,
    frame_tag,
    result_frame,
)
from lamina.transports import Frame
from lamina.transports.polling import default_budget_us

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=6,
                  num_kv_heads=3, head_dim=4)


# -- configuration ---------------------------------------------------------------------------
def test_config_file_env_and_flags(tmp_path):
    f = tmp_path / "stack.yaml"
    f.write_text("transport: shm\nattention: {workers: 3}\nscheduler: {policy: relaxed_fpf}\n")
    cfg = load_config(f, env={"LAMINA_PARTITION": "head", "REDIS_URL": "redis://h:1"},
                      overrides={"gateway.port": 9000, "transport": None})
    assert (cfg.transport, cfg.partition, cfg.redis_url) == ("shm", "head", "redis://h:1")
    assert (cfg.attention.workers, cfg.gateway.port, cfg.scheduler.policy) == (3, 9000, "relaxed_fpf")
    toml = tmp_path / "stack.toml"
    toml.write_text('transport = "ucx"\n[gateway]\nport = 8123\n')
    assert load_config(toml, env={}).gateway.port == 8123


def test_data_plane_settings_reach_the_transport_config(tmp_path):
    f = tmp_path / "stack.yaml"
    f.write_text("cluster_token: s3cret\n"
                 "data_plane: {busy_poll_us: 0, checksum_payloads: true, native_frames: false}\n")
    tcfg = load_config(f, env={}, overrides={"data_plane.ucx_progress_mode": "thread"}).transport_config()
    assert (tcfg.auth_token, tcfg.busy_poll_us, tcfg.checksum_payloads, tcfg.ucx_progress_mode,
            tcfg.native_frames) == ("s3cret", 0.0, True, "thread", False)
    default = load_config(env={})
    assert default.transport_config().native_frames
    assert not default.transport_config().cuda_ipc_device_order  # host-ordered unless asked
    ordered = load_config(env={"LAMINA_CUDA_IPC_DEVICE_ORDER": "true"}).transport_config()
    assert ordered.cuda_ipc_device_order
    # Unset, the spin budget follows the host: 2 attention + 1 model + 1 prefill worker.
    assert default.data_plane_processes == 4
    assert default.transport_config().busy_poll_us == default_budget_us(4)


def test_weight_choices_are_the_loaders():
    from lamina.model.packing import WEIGHT_CHOICES as LOADER_CHOICES
    from lamina.services.config import WEIGHT_CHOICES

    assert WEIGHT_CHOICES == LOADER_CHOICES
    assert load_config(env={"LAMINA_WEIGHTS": "as_file"}).weights == "as_file"
    with pytest.raises(ConfigError, match="weights must be one of float32, q8_0, q4, as_file"):
        load_config(env={"LAMINA_WEIGHTS": "fp8"})


def test_model_worker_threads_from_environment_and_flags():
    assert load_config(env={"LAMINA_MODEL_THREADS": "2"}).model_worker.threads == 2
    assert load_config(env={}, overrides={"model_worker.threads": 3}).model_worker.threads == 3
    with pytest.raises(ConfigError, match=r"model_worker\.threads"):
        load_config(env={"LAMINA_MODEL_THREADS": "0"})


def test_the_rotational_pipeline_steps_one_more_micro_batch_than_model_workers():
    rotational = load_config(env={"LAMINA_PIPELINE": "rotational"}, overrides={"model_worker.workers": 3})
    assert (rotational.rotational, rotational.decode_micro_batches) == (True, 4)
    fixed = load_config(env={}, overrides={"model_worker.workers": 3, "pipeline.micro_batches": 2})
    assert (fixed.rotational, fixed.decode_micro_batches) == (False, 2)
    # Colocated, a step attends itself: no wait for other micro-batches to fill.
    colocated = load_config(env={}, overrides={"layout": "colocated", "pipeline.micro_batches": 2})
    assert (colocated.colocated, colocated.decode_micro_batches) == (True, 1)
    with pytest.raises(ConfigError, match=r"pipeline\.mode must be one of fixed, rotational"):
        load_config(env={"LAMINA_PIPELINE": "round-robin"})


def test_busy_polling_only_where_every_busy_process_has_a_core():
    assert default_budget_us(4, num_cores=2) == 0.0
    assert default_budget_us(4, num_cores=4) == 50.0
    assert default_budget_us(5, num_cores=16) == 50.0


@pytest.mark.parametrize(("text", "message"), [
    ("transport: carrier-pigeon\n", "transport must be one of tcp, ucx, shm"),
    ("attention: {workers: 0}\n", "attention.workers must be a positive integer"),
    ("attention: {workers: two}\n", "attention.workers must be an integer"),
    ("colour: blue\n", "unknown setting(s) colour"),
    ("gateway: {prot: 1}\n", "unknown setting(s) gateway.prot"),
    ("prefill: {cache_disk_bytes: 10}\n", "prefill.cache_dir must be set"),
    ("[unclosed\n", "not valid YAML"),
    ("data_plane: {busy_poll_us: -1}\n", "data_plane: busy_poll_us must be in 0..10000"),
    ("data_plane: {busy_poll_us: fast}\n", "data_plane.busy_poll_us must be a number"),
    ("data_plane: {checksum_payloads: maybe}\n", "data_plane.checksum_payloads must be true or false"),
    ("scheduler: {join_hold_ms: -1}\n", "scheduler.join_hold_ms must be a number of milliseconds in 0..60000"),
    ("prefill: {batch_window_max_ms: 2000}\n", "prefill.batch_window_max_ms must be a number of milliseconds"),
])
def test_config_errors_name_the_setting(tmp_path, text, message):
    f = tmp_path / "stack.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(f, env={})


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="configuration file not found"):
        load_config(tmp_path / "nope.yaml", env={})


# -- placement and policies --------------------------------------------------------------------
def test_head_ranges_cover_every_head_once():
    assert [head_range(w, 2, 3) for w in range(2)] == [(0, 1), (1, 3)]
    assert [head_range(w, 3, 3) for w in range(3)] == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="at most 3 attention workers"):
        head_range(0, 4, 3)


def test_placement_picks_the_least_loaded_worker_with_room():
    cap = [20, 20, 20]
    assert place_request("request", [10, 3, 3], cap, 5) == [1]
    assert place_request("request", [10, 3, 16], [20, 7, 20], 5) == [0]  # worker 1 lacks room
    assert place_request("request", [16, 16, 16], cap, 5) is None  # admission waits
    assert place_request("head", [10, 3, 3], cap, 5) == [0, 1, 2]
    assert place_request("head", [16, 3, 3], cap, 5) is None


def _req(rid: str, arrival: float, n_prompt: int = 3, **params) -> Request:
    return Request(rid, list(range(n_prompt)), lamina_pb2.SamplingParams(max_tokens=4, **params), asyncio.Queue(),
                   arrival=arrival)


def test_admission_order_per_policy():
    waiting = [_req("a", 0.0), _req("b", 1.0), _req("c", 2.0)]
    distances = [3, 1, 0]
    assert [r.request_id for r in admission_order(waiting, distances, "fcfs", 10.0)] == ["a", "b", "c"]
    assert [r.request_id for r in admission_order(waiting, distances, "fpf", 10.0)] == ["c", "b", "a"]
    # Relaxed-FPF: waiting x (4 - distance): a 10x1=10, b 9x3=27, c 8x4=32.
    assert [r.request_id for r in admission_order(waiting, distances, "relaxed_fpf", 10.0)] == ["c", "b", "a"]
    # A long wait outweighs a cached prefix: a 100x1=100, b 5x3=15.
    late = [_req("a", 0.0), _req("b", 95.0)]
    assert [r.request_id for r in admission_order(late, [3, 1], "relaxed_fpf", 100.0)] == ["a", "b"]
    assert [r.request_id for r in admission_order(late, [3, 1], "fpf", 100.0)] == ["b", "a"]


def test_admission_limits():
    assert can_admit(2, 1, 4) and not can_admit(3, 1, 4)


def test_placeable_capacity_leaves_out_workers_gone_or_not_answering():
    assert placeable([20, 30, 40], set()) == [20, 30, 40]
    assert placeable([20, 30, 40], {1}) == [20, 0, 40]  # left the pool
    assert placeable([20, 30, 40], {1}, [True, True, False]) == [20, 0, 0]  # worker 2 did not answer the probe
    assert placeable([20, 30, 40], set(), [True, True]) == [20, 30, 0]  # joined after the probe: not known healthy


def test_admission_refuses_what_could_never_run():
    def refusal(num_prompt: int, max_tokens: int = 8, n: int = 1, capacity: int = 100) -> str | None:
        return admission_refusal(num_prompt, max_tokens, n, max_model_len=64, max_batch_size=4, most_capacity=capacity)

    assert refusal(10) is None
    assert refusal(0) == "the prompt is empty"
    assert refusal(64) == "prompt has 64 tokens; the model's context length is 64"
    assert refusal(10, n=5) == "n=5 choices exceed the decode batch (4 sequences)"
    # KV of prompt + max_tokens (capped at the context length); with n choices the prompt once.
    assert refusal(10, max_tokens=100) is None  # 64 tokens at most
    assert refusal(10, capacity=17) == ("prompt plus max_tokens (18 tokens) exceeds the KV capacity of an "
                                        "attention worker (17 tokens)")
    assert refusal(10, n=3, capacity=33) == ("prompt plus 3 choices of max_tokens (34 tokens) exceeds the KV "
                                             "capacity of an attention worker (33 tokens)")
    assert refusal(10, n=3, capacity=34) is None


# -- attention core and frames ---------------------------------------------------------------
def _kv(n: int, heads: int = 3) -> torch.Tensor:
    return torch.randn(n, heads, 4)


def test_attention_core_store_then_decode_matches_local_attention():
    torch.manual_seed(0)
    core = AttentionCore(CFG, capacity_bytes=1 << 20, num_kv_heads=3)
    prompt_k = [_kv(5) for _ in range(2)]
    prompt_v = [_kv(5) for _ in range(2)]
    for layer in range(2):
        done = core.store(StoreKV("s", layer, 2, prompt_k[layer], prompt_v[layer]))
        assert done == (layer == 1)
    assert core.slabs.num_tokens("s") == 5
    q, k, v = torch.randn(1, 6, 4), _kv(1), _kv(1)
    for layer in range(2):
        out, _lse = core.attend(layer, [("s", 1)], q, k, v, need_lse=True)
        ref, _ = batched_attention(q, [1], [torch.cat([prompt_k[layer], k])], [torch.cat([prompt_v[layer], v])])
        torch.testing.assert_close(out, ref)
    assert core.slabs.num_tokens("s") == 6
    core.free(["s"])
    assert core.num_sequences == 0 and core.used_bytes == 0


def test_attention_core_errors_are_typed_and_recoverable():
    core = AttentionCore(CFG, capacity_bytes=2 * CFG.num_layers * 3 * 4 * 4 * 64, num_kv_heads=3)
    assert core.slabs.num_total_tokens == 64
    with pytest.raises(RemoteError, match="unknown_sequence"):
        core.attend(0, [("ghost", 1)], torch.randn(1, 6, 4), _kv(1), _kv(1))
    with pytest.raises(RemoteError, match="bad_request"):
        core.attend(0, [("x", 1)], torch.randn(1, 6, 4), _kv(1, 2), _kv(1, 2))
    # A prompt too big for the worker: one error, at the last layer, and nothing kept.
    big = _kv(200)
    assert core.store(StoreKV("big", 0, 2, big, big)) is False
    with pytest.raises(RemoteError, match="kv_full"):
        core.store(StoreKV("big", 1, 2, big, big))
    assert not core.slabs.has_request("big") and core.used_bytes == 0
    # A decode step that does not fit is refused before anything changes.
    small = _kv(60)
    core.store(StoreKV("s", 0, 2, small, small))
    core.store(StoreKV("s", 1, 2, small, small))
    with pytest.raises(RemoteError, match="kv_full"):
        core.attend(0, [("s", 5)], torch.randn(5, 6, 4), _kv(5), _kv(5))
    assert core.slabs.num_tokens("s") == 60


def test_frames_round_trip_and_errors():
    q, k, v = torch.randn(2, 6, 4), _kv(2), _kv(2)
    tag = decode_tag(1, 7, 3)
    for msg in (Attend(Kind.ATTEND, tag, 3, [("a", 1), ("b", 1)], q, k, v),
                Attend(Kind.ATTEND_Q, tag, 3, [("a", 1), ("b", 1)], q=q),
                Attend(Kind.ATTEND_KV, tag, 3, [("a", 1), ("b", 1)], k=k, v=v)):
        back = Attend.from_frame(msg.to_frame())
        assert (back.kind, back.tag, back.layer, back.seqs) == (msg.kind, (1, 7, 3), 3, [("a", 1), ("b", 1)])
        for name in "qkv":
            sent, got = getattr(msg, name), getattr(back, name)
            assert (got is None) if sent is None else torch.equal(got, sent)
    # Replies echo the tag they answer, so they are matched by id, never by order.
    assert frame_tag(result_frame(tag, q)) == tag
    assert frame_tag(ack_frame(("s",))) == ("s",)
    with pytest.raises(RemoteError, match="kv_full: no room"):
        expect(error_frame(tag, "kv_full", "no room"), Kind.RESULT)
    with pytest.raises(RemoteError, match="ATTEND_Q carries 1 tensors"):
        Attend.from_frame(Frame(kind=Kind.ATTEND_Q, header={"tag": [1, 1, 1], "layer": 0, "seqs": []},
                                tensors=[q, k]))
    with pytest.raises(RemoteError, match="without a tag"):
        frame_tag(Frame(kind=Kind.RESULT, header={}, tensors=[]))


def test_prefill_batches_take_waiting_prompts_up_to_the_token_limit():
    from lamina.services.prefill.prefill_service import take_batch
    from lamina.services.protos import lamina_pb2

    def req(n: int) -> lamina_pb2.PrefillRequest:
        return lamina_pb2.PrefillRequest(seq_id=f"s{n}", token_ids=list(range(n)))

    queue = [(req(n), None) for n in (10, 20, 30, 100, 5)]
    assert [r.seq_id for r, _ in take_batch(queue, 60)] == ["s10", "s20", "s30"]
    assert [r.seq_id for r, _ in take_batch(queue, 60)] == ["s100"]  # longer than the limit: alone
    assert [r.seq_id for r, _ in take_batch(queue, 60)] == ["s5"]
    assert queue == [] and take_batch(queue, 60) == []


def test_queued_prompts_whose_callers_went_away_are_dropped_and_released():
    """A prefill call cancelled, or past its deadline, while its prompt waited: its future is
    done, so it leaves the queue unforwarded and its prefetch protection ends; the others
    keep their order."""
    from concurrent.futures import Future

    from lamina.services.prefill.prefill_service import drop_abandoned
    from lamina.services.protos import lamina_pb2

    queue = [(lamina_pb2.PrefillRequest(seq_id=f"s{i}"), Future()) for i in range(4)]
    queue[1][1].cancel()
    queue[3][1].set_exception(TimeoutError())
    gone = [id(queue[1][0]), id(queue[3][0])]
    released: list = []
    assert drop_abandoned(queue, released.append) == 2
    assert [r.seq_id for r, _ in queue] == ["s0", "s2"] and released == gone
    assert drop_abandoned(queue, None) == 0 and len(queue) == 2


def test_a_prompt_whose_prefix_the_batch_computes_waits_for_the_next_batch():
    from lamina.services.prefill.prefill_service import shares_uncached_block, take_batch
    from lamina.services.protos import lamina_pb2

    bs = 4
    turn1 = list(range(100, 100 + 3 * bs))
    turn2 = turn1 + [7] * bs  # the next turn of the same conversation
    other = [9] * (3 * bs)
    # Nothing cached: turn 2 would compute turn 1's 3 blocks again in the same forward.
    assert shares_uncached_block(turn2, 0, [turn1], bs)
    # Those blocks cached already (or all but a part of a block): nothing to wait for.
    assert not shares_uncached_block(turn2, 3 * bs, [turn1], bs)
    assert not shares_uncached_block(turn2, 0, [other], bs)
    assert not shares_uncached_block(turn1[:bs], 0, [turn1], bs)  # its last token is computed anyway

    def req(name: str, ids: list[int]) -> lamina_pb2.PrefillRequest:
        return lamina_pb2.PrefillRequest(seq_id=name, token_ids=ids)

    def waits(r, taken) -> bool:
        return shares_uncached_block(list(r.token_ids), 0, [list(t.token_ids) for t in taken], bs)

    queue = [(req("t1", turn1), None), (req("t2", turn2), None), (req("o", other), None)]
    assert [r.seq_id for r, _ in take_batch(queue, 1000, waits)] == ["t1", "o"]
    assert [r.seq_id for r, _ in take_batch(queue, 1000, waits)] == ["t2"]  # at the head: never waits
    # A prompt that does not fit ends the batch; the ones after it stay, in order.
    queue = [(req("t1", turn1), None), (req("big", other * 10), None), (req("o", other), None)]
    assert [r.seq_id for r, _ in take_batch(queue, 100, waits)] == ["t1"]
    assert [r.seq_id for r, _ in queue] == ["big", "o"]


async def test_a_prefill_that_fails_after_its_call_stops_counting_once():
    """A request's prefill slot is given back exactly once, whether the prefill call or a
    step after it (here starting its choices) fails: admission counts prefilling requests."""
    from lamina.services.config import StackConfig
    from lamina.services.protos import lamina_pb2
    from lamina.services.scheduler.scheduler_service import SchedulerService, Status

    svc = SchedulerService(StackConfig(redis_url="redis://127.0.0.1:1"))  # no Redis call is made here
    svc.attention.capacity_tokens = [10_000]
    admission = svc.admission
    finished = []

    async def answered(req, token_ids):
        return lamina_pb2.PrefillResult(token_id=5)

    async def no_call(req, token_ids):
        raise RuntimeError("the metadata store failed")

    async def choices_fail(req, result):
        raise RuntimeError("forking the KV failed")

    async def finish(req, reason, notify=True):
        req.status = Status.FINISHED
        finished.append(reason)

    svc.start_choices, svc.finish = choices_fail, finish
    for i, call in enumerate((answered, no_call)):
        admission.prefill_call = call
        req = svc.submit(lamina_pb2.GenerateRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3],
                                                    params=lamina_pb2.SamplingParams(max_tokens=4)))
        admission.waiting.remove(req)
        admission.start_prefill(req)
        assert admission.num_prefilling == req.num_slots
        await asyncio.gather(*admission.tasks)
        assert admission.num_prefilling == 0 and req.status is Status.FINISHED
    assert finished == ["abort", "abort"]


async def test_a_full_queue_is_resource_exhausted_and_the_gateway_backend_calls_it_queue_full():
    """The scheduler refuses a request past `scheduler.max_queue` with QueueFull, answered
    RESOURCE_EXHAUSTED, which the gateway's backend raises as QueueFullError (HTTP 429:
    tests/gateway/test_gateway_http.py); a request that can never run is INVALID_ARGUMENT."""
    import grpc

    from lamina.gateway.backend import QueueFullError, RequestRefusedError
    from lamina.services.config import SchedulerSection, StackConfig
    from lamina.services.gateway.scheduler_client import _error
    from lamina.services.protos import lamina_pb2_grpc
    from lamina.services.scheduler.scheduler_service import SchedulerService, _SchedulerServicer
    from lamina.services.scheduler.scheduler_state import QueueFull

    svc = SchedulerService(StackConfig(redis_url="redis://127.0.0.1:1", scheduler=SchedulerSection(max_queue=1)))
    svc.attention.capacity_tokens = [10_000]  # no admission loop runs: a queued request stays queued

    def request(rid: str, prompt: list[int]) -> lamina_pb2.GenerateRequest:
        return lamina_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                          params=lamina_pb2.SamplingParams(max_tokens=4))

    svc.submit(request("queued", [1, 2, 3]))
    with pytest.raises(QueueFull, match=r"queue full \(1 requests waiting\)"):
        svc.submit(request("more", [1, 2, 3]))
    server = grpc.aio.server()
    lamina_pb2_grpc.add_SchedulerServicer_to_server(_SchedulerServicer(svc), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = lamina_pb2_grpc.SchedulerStub(channel)
            for prompt, code, error in (([1, 2, 3], grpc.StatusCode.RESOURCE_EXHAUSTED, QueueFullError),
                                        ([], grpc.StatusCode.INVALID_ARGUMENT, RequestRefusedError)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Generate(request("more", prompt)).read()
                assert info.value.code() is code
                assert isinstance(_error(info.value), error)
    finally:
        await server.stop(None)


async def test_the_first_token_carries_the_prompts_cached_tokens_to_the_gateway():
    """The prefill's count of prompt tokens its prefix cache served (PrefillResult.cached_tokens)
    rides on the request's first chunk (TokenChunk.cached_tokens) over the scheduler's real
    gRPC stream, and the gateway's backend maps it to TokenEvent.cached_tokens: once per
    request (n = 2: choice 0's first token; choice 1 forks that prefill's KV), 0 kept as 0."""
    import time

    import grpc

    from lamina.gateway.protocol import GenerateRequest
    from lamina.sampling.params import SamplingParams
    from lamina.services.config import StackConfig
    from lamina.services.gateway.scheduler_client import SchedulerBackend
    from lamina.services.protos import lamina_pb2_grpc
    from lamina.services.scheduler.scheduler_service import SchedulerService, _SchedulerServicer

    svc = SchedulerService(StackConfig(redis_url="redis://127.0.0.1:1"))  # no Redis call is made here
    svc.attention.capacity_tokens = [10_000]
    cached = {"two": 48, "one": 0}

    async def prefill_call(req, token_ids):
        return lamina_pb2.PrefillResult(token_id=5, cached_tokens=cached[req.group_id or req.request_id],
                                        choice_token_ids=[6] * len(req.choice_seeds))

    async def nothing(*args) -> None:
        return None

    svc.admission.prefill_call = prefill_call
    svc.admission.enqueue = svc.admission.start_prefill  # admitted at once: no attention workers here
    svc.record_placement = svc.free_kv = nothing
    server = grpc.aio.server()
    lamina_pb2_grpc.add_SchedulerServicer_to_server(_SchedulerServicer(svc), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    backend = SchedulerBackend(f"127.0.0.1:{port}")
    try:
        events = {}
        for rid, n in (("two", 2), ("one", 1)):
            request = GenerateRequest(rid, (1, 2, 3), SamplingParams(max_tokens=1), time.time(), n=n)
            events[rid] = [e async for e in await backend.generate(request)]
    finally:
        await backend.close()
        await server.stop(None)
    assert sorted((e.index, e.token_ids, e.cached_tokens) for e in events["two"]) == [(0, [5], 48), (1, [6], None)]
    assert [(e.token_ids, e.finish_reason, e.cached_tokens) for e in events["one"]] == [([5], "length", 0)]


def test_drop_frames_frees_what_a_failed_forward_held_at_once():
    """The frames an exception went through, with their tensors, go as soon as its
    tracebacks (its own and its cause's) are dropped, without a garbage collection."""
    import gc
    import weakref

    import torch

    from lamina import transports
    from lamina.services.prefill.prefill_service import drop_frames

    held: list[weakref.ref] = []

    def send() -> None:
        kv = torch.zeros(1 << 16)  # the forward's KV
        held.append(weakref.ref(kv))
        raise OSError("link down")

    def forward() -> None:
        kv = torch.zeros(1 << 16)
        held.append(weakref.ref(kv))
        try:
            send()
        except OSError as exc:
            raise transports.TransportError("attention worker 1 unreachable") from exc

    gc.disable()
    try:
        try:
            forward()
        except transports.TransportError as exc:
            failure = exc
        assert all(r() is not None for r in held)  # kept alive by the tracebacks
        drop_frames(failure)
        assert all(r() is None for r in held)
        assert str(failure) == "attention worker 1 unreachable" and isinstance(failure.__cause__, OSError)
    finally:
        gc.enable()
