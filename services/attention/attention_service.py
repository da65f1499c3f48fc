"""The attention service: one process holding KV and computing attention.

Data plane: a transport listener; each connection (a model or prefill worker)
sends ATTEND (or ATTEND_Q then ATTEND_KV) and STORE_KV frames and gets RESULT, ACK
or ERROR back, each echoing its request's tag (lamina.services.wire).
Control plane: gRPC AttentionControl (Free, Stats, Fork, Retain) and health. Its occupancy is
also written to the metadata store every second (`occupancy()`, NS:stats:attention:ID).
Under the colocated layout the service runs inside a model worker's process, which
attends on its core by a call (`count_local` keeps the figures of that work).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import prometheus_client
import torch

from lamina import transports
from lamina.aio import install_uvloop
from lamina.model.checkpoints import load_config
from lamina.planner.measure.kernels import synchronize
from lamina.services.addresses import with_host
from lamina.services.attention.attention_core import AttentionCore
from lamina.services.config import StackConfig
from lamina.services.counter_totals import CounterTotals
from lamina.services.devices import compute_dtype, open_device
from lamina.services.kv_budget import kv_budget_here
from lamina.services.placement import head_range
from lamina.services.protos import lamina_pb2, lamina_pb2_grpc
from lamina.services.runtime import ServiceRuntime, abort_for_remote_error
from lamina.services.warm_up import graph_plan
from lamina.services.wire import (
    Attend,
    Kind,
    RemoteError,
    StoreKV,
    Tag,
    ack_frame,
    error_frame,
    frame_tag,
    incoming,
    result_frame,
    short_repr,
)
from lamina.transports.host_staging import DEVICE_WAITS, has_cuda

log = logging.getLogger(__name__)

# Q-early halves one connection may leave waiting for their K, V: a few per micro-batch
# in flight is all a model worker needs; more is a broken or hostile peer.
_MAX_HELD_Q = 64


@dataclass(frozen=True)
class _HeldQ:
    layer: int
    seqs: list[tuple[str, int]]
    q: torch.Tensor  # [T, Hq, D]
    out: torch.Tensor  # [T, Hq, D]: attention over the KV held when Q came
    lse: torch.Tensor  # [T, Hq]


class _Control(lamina_pb2_grpc.AttentionControlServicer):
    def __init__(self, core: AttentionCore) -> None:
        self.core = core

    async def Free(self, request, context):  # noqa: N802 (gRPC method names)
        self.core.free(list(request.seq_ids))
        return lamina_pb2.Empty()

    async def Retain(self, request, context):  # noqa: N802
        freed = self.core.retain(set(request.seq_ids), request.idle_s)
        if freed:
            log.warning("freed %d sequence(s) no request holds (untouched for %g s or more): %s", len(freed),
                        request.idle_s, short_repr(freed))
        return lamina_pb2.RetainReply(freed=freed)

    async def Stats(self, request, context):  # noqa: N802
        c = self.core
        return lamina_pb2.AttentionStats(num_sequences=c.num_sequences, num_tokens=c.slabs.num_used_tokens,
                                         used_bytes=c.used_bytes, capacity_bytes=c.capacity_bytes,
                                         occupancy=c.slabs.occupancy, fragmentation=c.slabs.fragmentation,
                                         capacity_tokens=c.slabs.num_total_tokens,
                                         num_sequence_tokens=c.slabs.num_sequence_tokens)

    async def Fork(self, request, context):  # noqa: N802
        try:
            self.core.fork(request.source, list(request.seq_ids), request.num_tokens)
        except RemoteError as exc:  # e.g. the source is unknown: this worker restarted since its prefill
            await abort_for_remote_error(context, exc)
        return lamina_pb2.Empty()


class AttentionService:
    def __init__(self, config: StackConfig, index: int = 0) -> None:
        self.config = config
        self.index = index
        self.service_id = f"attention-{index}"
        model_cfg = load_config(config.model)
        heads = model_cfg.num_kv_heads
        if config.partition == "head":
            start, end = head_range(index, config.attention.workers, model_cfg.num_kv_heads)
            heads = end - start
        device = open_device("attention.device", config.attention.device)
        # Under a Stack the capacity is set already (with_kv_budget); started on its own,
        # this process counts only itself.
        budget = kv_budget_here(config, whole_host=False, model=model_cfg)
        log.info("attention KV: %.2f GiB on %s (%s)", budget.per_holder / (1 << 30), device, budget.why)
        self.core = AttentionCore(model_cfg, budget.per_holder, heads,
                                  kv_quant=config.attention.kv_quant, device=device,
                                  dtype=compute_dtype(config.attention.compute_dtype),
                                  cuda_graphs=config.attention.cuda_graphs)
        t0 = time.monotonic()
        if self.core.warm_up():
            log.info("attention kernels ready on %s in %.1f s", device, time.monotonic() - t0)
        self.runtime = ServiceRuntime("attention", self.service_id, config)
        r = self.runtime.registry
        self.m_frames = prometheus_client.Counter("lamina_attention_frames", "data-plane frames handled",
                                                  ["kind"], registry=r)
        self.m_errors = prometheus_client.Counter("lamina_attention_errors", "refused frames", ["code"], registry=r)
        self.m_used = prometheus_client.Gauge("lamina_attention_kv_used_bytes", "KV bytes in use", registry=r)
        self.m_seqs = prometheus_client.Gauge("lamina_attention_sequences", "sequences held", registry=r)
        self.m_compute = prometheus_client.Counter("lamina_attention_compute_seconds",
                                                   "CPU time handling frames (KV writes, attention)", registry=r)
        self.m_send = prometheus_client.Counter("lamina_attention_send_seconds", "time sending replies", registry=r)
        self.m_device_wait = prometheus_client.Counter(
            "lamina_attention_device_wait_seconds", "time this process waited for its GPU's work before sending "
            "(replies: part of the send time)", registry=r)
        self.m_graph_replays = prometheus_client.Counter(
            "lamina_attention_graph_replays", "decode frames whose attention was replayed as a CUDA graph", registry=r)
        self.m_graph_failures = prometheus_client.Counter(
            "lamina_attention_graph_capture_failures", "layer, batch and context buckets whose CUDA graph capture "
            "failed (their frames run eagerly)", registry=r)
        self.m_graph_captures = prometheus_client.Counter(
            "lamina_attention_graph_captures", "CUDA graphs of the decode attention captured (at start, "
            "warm_up_graph_keys, or by the first frame that needs one)", registry=r)
        # The process's device waits (one clock for every connection: counted from its value
        # now) and the core's graph replays, captures and failed captures.
        self._totals = CounterTotals({"device_wait": self.m_device_wait, "graph_replays": self.m_graph_replays,
                                      "graph_failures": self.m_graph_failures,
                                      "graph_captures": self.m_graph_captures},
                                     start={"device_wait": DEVICE_WAITS.seconds})
        self._frame_counters: dict[int, prometheus_client.Counter] = {}  # m_frames' child by frame kind
        self._listener: transports.Listener | None = None
        if not config.colocated:  # colocated, the model worker decides (its step graphs may serve every step)
            self.capture_graphs()

    def capture_graphs(self) -> int:
        """The decode attention's CUDA graphs captured before the worker serves, for every
        bucket of services/warm_up.py's `graph_plan` and every layer, where decode frames
        replay them: the core has graphs (a GPU's paged kernel) and frames come whole
        (no Q-early) in its dtype. Where the GPU runs out of memory, the worker serves with
        what was captured (logged): the rest are captured at the first frame that needs
        them, as without the plan. Returns the graphs made."""
        graphs, cfg = self.core.graphs, self.config
        plan = graph_plan(cfg, self.core.cfg.max_position_embeddings)
        if plan is None or graphs is None or cfg.pipeline.q_early \
                or compute_dtype(cfg.model_worker.compute_dtype) != graphs.dtype:
            return 0
        t0, before = time.monotonic(), graphs.captures
        try:
            graphs.prepare(self.core.cfg.num_layers, plan.buckets, plan.contexts)
            synchronize(self.core.device)
            log.info("%d CUDA graphs of the decode attention captured in %.1f s", graphs.captures - before,
                     time.monotonic() - t0)
        except torch.OutOfMemoryError as exc:
            log.warning("CUDA graphs captured at start: stopped after %d, out of memory (%s); the others are captured "
                        "at the first frame that needs them", graphs.captures - before, exc)
        self._count_waits_and_graphs()
        return graphs.captures - before

    async def _serve_connection(self, conn: transports.Connection) -> None:
        # One peer (a model or prefill worker). Frames are handled in arrival order and
        # every reply echoes its request's tag, so the peer matches replies by id.
        # Q-early halves wait here between their ATTEND_Q and ATTEND_KV frames.
        held: dict[Tag, _HeldQ | RemoteError] = {}
        async for frame in incoming(conn, "data"):
            t0 = time.thread_time()  # CPU time: the work done, however busy the host is
            reply = self._handle(frame, held)
            t1 = time.perf_counter()
            self.m_compute.inc(time.thread_time() - t0)
            self._frames_of(frame.kind).inc()
            self.m_used.set(self.core.used_bytes)
            self.m_seqs.set(self.core.num_sequences)
            if reply is not None:
                await conn.send(reply)
                self.m_send.inc(time.perf_counter() - t1)
            self._count_waits_and_graphs()

    def _frames_of(self, kind: int) -> prometheus_client.Counter:
        """The frame counter of a kind, its labelled child looked up once (every frame counts)."""
        counter = self._frame_counters.get(kind)
        if counter is None:
            name = Kind(kind).name if kind in Kind._value2member_map_ else "other"
            counter = self._frame_counters[kind] = self.m_frames.labels(name)
        return counter

    def _count_waits_and_graphs(self) -> None:
        """The process's device waits and the core's graph replays, captures and failed
        captures since the last count."""
        graphs = self.core.graphs
        self._totals.report({"device_wait": DEVICE_WAITS.seconds, "graph_replays": graphs.replays if graphs else 0,
                             "graph_failures": graphs.failures if graphs else 0,
                             "graph_captures": graphs.captures if graphs else 0})

    def _handle(self, frame: transports.Frame, held: dict) -> transports.Frame | None:
        """The reply to one frame (None when it needs none). A frame that cannot be
        applied is answered with an ERROR frame and changes nothing: it never ends
        the connection."""
        tag = None
        try:
            tag = frame_tag(frame)
            if self.core.native and has_cuda(frame):
                # cuda_ipc hands over GPU tensors; the native kernels read CPU memory (the
                # reply then goes back through host memory, as the sender's staging expects).
                frame = transports.Frame(frame.kind, frame.header,
                                         [t.cpu() if isinstance(t, torch.Tensor) else t for t in frame.tensors])
            if frame.kind == Kind.ATTEND:
                msg = Attend.from_frame(frame)
                out, _ = self.core.attend(msg.layer, msg.seqs, msg.query, msg.key, msg.value, need_lse=False)
                return result_frame(tag, out)
            if frame.kind == Kind.ATTEND_Q:
                return self._hold(tag, frame, held)
            if frame.kind == Kind.ATTEND_KV:
                part = held.pop(tag, None)  # first: a refused K, V still ends its Q's wait
                msg = Attend.from_frame(frame)
                if part is None:
                    raise RemoteError("protocol", f"ATTEND_KV {short_repr(tag)} without its ATTEND_Q")
                if isinstance(part, RemoteError):
                    raise part
                if (msg.layer, msg.seqs) != (part.layer, part.seqs):
                    raise RemoteError("protocol", f"ATTEND_KV {short_repr(tag)} names other sequences or another layer "
                                                  f"than its ATTEND_Q")
                return result_frame(tag, self.core.append_and_combine(msg.layer, msg.seqs, part.q, msg.key,
                                                                      msg.value, part.out, part.lse))
            if frame.kind == Kind.STORE_KV:
                return ack_frame(tag) if self.core.store(StoreKV.from_frame(frame)) else None
            raise RemoteError("protocol", f"unexpected frame kind {frame.kind}")
        except RemoteError as exc:
            self.m_errors.labels(exc.code).inc()
            return error_frame(tag, exc.code, str(exc))
        except Exception as exc:  # a bug: the checks let through what the core cannot apply
            log.exception("attention worker failed on a frame of kind %s", frame.kind)
            self.m_errors.labels("internal").inc()
            return error_frame(tag, "internal", f"{type(exc).__name__}: {exc}")

    def _hold(self, tag: Tag, frame: transports.Frame, held: dict) -> transports.Frame | None:
        """Q-early's first half: attend over the KV held so far and keep the partials
        until K and V of the same tag arrive. A refused Q is answered then, as its tag's
        one reply; only a connection holding too many halves is answered at once."""
        if tag in held:
            held[tag] = RemoteError("protocol", f"ATTEND_Q {short_repr(tag)} arrived twice before its ATTEND_KV")
            return None
        if len(held) >= _MAX_HELD_Q:
            raise RemoteError("protocol", f"{len(held)} ATTEND_Q frames already await their ATTEND_KV")
        try:
            msg = Attend.from_frame(frame)
            q = msg.query
            held[tag] = _HeldQ(msg.layer, msg.seqs, q, *self.core.attend_held(msg.layer, msg.seqs, q))
        except RemoteError as exc:
            held[tag] = exc  # answered (and counted) when K, V of the same tag arrive
        return None

    def count_local(self, compute_s: float) -> None:
        """Attention a model worker in this process computed on the core by a call
        (colocated): its CPU time, and the KV it holds now."""
        self.m_compute.inc(compute_s)
        self.m_used.set(self.core.used_bytes)
        self.m_seqs.set(self.core.num_sequences)
        self._count_waits_and_graphs()

    def occupancy(self) -> dict:
        """KV held here, as published to the metadata store."""
        c = self.core
        return {"used_tokens": c.slabs.num_used_tokens, "capacity_tokens": c.slabs.num_total_tokens,
                "sequences": c.num_sequences, "used_bytes": c.used_bytes, "capacity_bytes": c.capacity_bytes}

    async def run(self) -> None:
        address = self.config.data_address(self.service_id)
        self._listener = await transports.listen(address, self._serve_connection, self.config.transport_config())
        try:
            await self.runtime.serve(
                lambda s: lamina_pb2_grpc.add_AttentionControlServicer_to_server(_Control(self.core), s),
                endpoint=with_host(self._listener.address, self.config.advertised_host),
                meta={"index": self.index, "kv_heads": self.core.num_kv_heads, "device": str(self.core.device)},
                stats=self.occupancy)
        finally:
            await self._listener.close()


def serve(config: StackConfig, threads: int | None = None, index: int = 0) -> None:
    torch.set_num_threads(threads or config.attention.threads)
    install_uvloop()
    asyncio.run(AttentionService(config, index).run())
