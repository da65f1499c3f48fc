"""The attention service: one process holding KV and computing attention.

Data plane: a transport listener; each connection (a model or prefill worker)
sends ATTEND / STORE_KV frames and gets RESULT / ACK / ERROR back, in order.
Control plane: gRPC AttentionControl (Free, Stats) and health.
"""

from __future__ import annotations

import asyncio
import logging

import prometheus_client
import torch

import transports
from model.loader import load_config
from services.attention_core import AttentionCore
from services.config import StackConfig
from services.placement import head_range
from services.protos import lamina_pb2, lamina_pb2_grpc
from services.runtime import ServiceRuntime
from services.wire import Attend, Kind, RemoteError, StoreKV, ack_frame, error_frame, result_frame

log = logging.getLogger(__name__)


class _Control(lamina_pb2_grpc.AttentionControlServicer):
    def __init__(self, core: AttentionCore) -> None:
        self.core = core

    async def Free(self, request, context):  # noqa: N802 (gRPC method names)
        self.core.free(list(request.seq_ids))
        return lamina_pb2.Empty()

    async def Stats(self, request, context):  # noqa: N802
        c = self.core
        return lamina_pb2.AttentionStats(num_sequences=c.num_sequences, num_tokens=c.slabs.num_used_tokens,
                                         used_bytes=c.used_bytes, capacity_bytes=c.capacity_bytes,
                                         occupancy=c.slabs.occupancy, fragmentation=c.slabs.fragmentation,
                                         capacity_tokens=c.slabs.num_total_tokens)


class AttentionService:
    def __init__(self, config: StackConfig, index: int) -> None:
        self.config = config
        self.index = index
        self.service_id = f"attention-{index}"
        model_cfg = load_config(config.model)
        heads = model_cfg.num_kv_heads
        if config.partition == "head":
            start, end = head_range(index, config.attention.workers, model_cfg.num_kv_heads)
            heads = end - start
        self.core = AttentionCore(model_cfg, config.attention.kv_capacity_bytes, heads)
        self.runtime = ServiceRuntime("attention", self.service_id, config)
        r = self.runtime.registry
        self.m_frames = prometheus_client.Counter("lamina_attention_frames", "data-plane frames handled",
                                                  ["kind"], registry=r)
        self.m_errors = prometheus_client.Counter("lamina_attention_errors", "refused frames", ["code"], registry=r)
        self.m_used = prometheus_client.Gauge("lamina_attention_kv_used_bytes", "KV bytes in use", registry=r)
        self.m_seqs = prometheus_client.Gauge("lamina_attention_sequences", "sequences held", registry=r)
        self._listener: transports.Listener | None = None

    async def _serve_connection(self, conn: transports.Connection) -> None:
        # One peer: frames are answered in the order they arrive.
        while True:
            try:
                frame = await conn.recv()
            except transports.PeerClosed:
                return
            except transports.TransportError as exc:
                log.warning("data connection from %s dropped: %s", conn.peer, exc)
                return
            try:
                if frame.kind == Kind.ATTEND:
                    out, lse = self.core.attend(Attend.from_frame(frame))
                    reply = result_frame(out, lse)
                elif frame.kind == Kind.STORE_KV:
                    done = self.core.store(StoreKV.from_frame(frame))
                    reply = ack_frame() if done else None
                else:
                    raise RemoteError("protocol", f"unexpected frame kind {frame.kind}")
            except RemoteError as exc:
                self.m_errors.labels(exc.code).inc()
                reply = error_frame(exc.code, str(exc))
            except (KeyError, ValueError, TypeError, RuntimeError) as exc:
                self.m_errors.labels("bad_request").inc()
                reply = error_frame("bad_request", f"{type(exc).__name__}: {exc}")
            self.m_frames.labels(Kind(frame.kind).name if frame.kind in Kind._value2member_map_ else "other").inc()
            self.m_used.set(self.core.used_bytes)
            self.m_seqs.set(self.core.num_sequences)
            if reply is not None:
                await conn.send(reply)

    async def run(self) -> None:
        tcfg = self.config.transport_config()
        self._listener = await transports.listen(self.config.data_address(self.service_id), self._serve_connection, tcfg)
        try:
            await self.runtime.serve(
                lambda s: lamina_pb2_grpc.add_AttentionControlServicer_to_server(_Control(self.core), s),
                endpoint=self._listener.address, meta={"index": self.index, "kv_heads": self.core.num_kv_heads})
        finally:
            await self._listener.close()


def serve(config: StackConfig, index: int, threads: int | None = None) -> None:
    torch.set_num_threads(threads or config.attention.threads)
    transports.install_uvloop()
    asyncio.run(AttentionService(config, index).run())
