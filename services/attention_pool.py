"""The model side of the data plane: Q, K, V out to the attention workers, outputs back.

Request-level partitioning sends each sequence's rows to the one worker holding
its KV; head-level partitioning sends every row to every worker, each with its
share of the heads, and concatenates the outputs along heads. One step at a
time uses the pool (the owner awaits each call), so replies arrive in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import transports
from kvstore.metadata import MetadataStore
from model.config import ModelConfig
from services.config import StackConfig
from services.placement import head_range
from services.runtime import wait_for_services
from services.wire import Attend, Kind, StoreKV, expect


@dataclass(frozen=True)
class SeqRows:
    seq_id: str
    num_rows: int  # new tokens of this sequence in the step
    workers: Sequence[int]  # its placement


class AttentionPool:
    def __init__(self, conns: list[transports.Connection], partition: str, cfg: ModelConfig) -> None:
        self.conns = conns
        self.partition = partition
        self.cfg = cfg
        self.kv_heads = [head_range(w, len(conns), cfg.num_kv_heads) for w in range(len(conns))] \
            if partition == "head" else []

    @classmethod
    async def connect(cls, addresses: list[str], partition: str, cfg: ModelConfig,
                      tcfg: transports.TransportConfig) -> AttentionPool:
        conns = [await transports.connect(a, tcfg) for a in addresses]
        return cls(conns, partition, cfg)

    @classmethod
    async def from_registry(cls, store: MetadataStore, config: StackConfig, cfg: ModelConfig) -> AttentionPool:
        """Connect to the configured number of attention workers, as registered in Redis."""
        workers = await wait_for_services(store, "attention", config.attention.workers)
        tcfg = config.transport_config()
        return await cls.connect([w.endpoint for w in workers], config.partition, cfg, tcfg)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.conns), return_exceptions=True)

    async def attend(self, layer: int, seqs: Sequence[SeqRows], q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, commit: bool) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> attention output [T, Hq, D]."""
        if self.partition == "head":
            return await self._attend_heads(layer, seqs, q, k, v, commit)
        return await self._attend_requests(layer, seqs, q, k, v, commit)

    async def _attend_requests(self, layer, seqs, q, k, v, commit) -> torch.Tensor:
        rows: dict[int, list[int]] = {}
        members: dict[int, list[tuple[str, int]]] = {}
        start = 0
        for s in seqs:
            w = s.workers[0]
            rows.setdefault(w, []).extend(range(start, start + s.num_rows))
            members.setdefault(w, []).append((s.seq_id, s.num_rows))
            start += s.num_rows
        order = sorted(rows)
        index = {w: torch.tensor(rows[w], dtype=torch.long) for w in order}
        for w in order:
            idx = index[w]
            await self.conns[w].send(Attend(layer, members[w], commit, q[idx], k[idx], v[idx]).to_frame())
        frames = await _replies([self.conns[w] for w in order])
        out = torch.empty_like(q)
        for w, frame in zip(order, frames):
            out[index[w]] = expect(frame, Kind.RESULT).tensors[0]
        return out

    async def _attend_heads(self, layer, seqs, q, k, v, commit) -> torch.Tensor:
        members = [(s.seq_id, s.num_rows) for s in seqs]
        groups = self.cfg.num_groups
        for w, (h0, h1) in enumerate(self.kv_heads):
            msg = Attend(layer, members, commit, q[:, h0 * groups : h1 * groups], k[:, h0:h1], v[:, h0:h1])
            await self.conns[w].send(msg.to_frame())
        frames = await _replies(self.conns)
        return torch.cat([expect(f, Kind.RESULT).tensors[0] for f in frames], dim=1)

    async def store_layer(self, seq_id: str, workers: Sequence[int], layer: int, k: torch.Tensor,
                          v: torch.Tensor) -> None:
        """Hand one layer of a prefilled sequence's KV ([P, Hkv, D]) to its workers."""
        n = self.cfg.num_layers
        for w in workers:
            if self.partition == "head":
                h0, h1 = self.kv_heads[w]
                kk, vv = k[:, h0:h1], v[:, h0:h1]
            else:
                kk, vv = k, v
            await self.conns[w].send(StoreKV(seq_id, layer, n, kk, vv).to_frame())

    async def wait_stored(self, workers: Sequence[int]) -> None:
        """Await each worker's acknowledgement of a whole sequence's KV."""
        for frame in await _replies([self.conns[w] for w in workers]):
            expect(frame, Kind.ACK)


async def _replies(conns: Sequence[transports.Connection]) -> list[transports.Frame]:
    # Read every peer's reply before judging any: an error from one worker must not
    # leave another's reply unread on its connection, or the next step would get it.
    return [await c.recv() for c in conns]
