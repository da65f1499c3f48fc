"""Storage of prefix-cache block payloads in one tier each: device, host, disk.

A payload is either a full-precision tensor [num_layers, 2, block_size, n_kv_heads,
head_dim] or its QuantizedTensor. Tiers only store and account bytes; which block goes
where is decided by PrefixCache. Not thread-safe: PrefixCache serializes calls, except
`DiskTier.read`, which only reads an existing file and may run outside its lock.

Disk layout: one file per block, `<dir>/<block_hash>.kvb` = 8-byte little-endian header
length, a JSON header (parent hash, tokens, payload kind, shapes, dtypes), zero padding
to a 64-byte boundary, then the raw tensor bytes. Files are written to a temporary name
and renamed, so a crash leaves either a whole block or none; they are read back by
memory mapping, and `scan()` finds them again after a restart.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np
import torch

from lamina.kvstore.quant import QuantizedTensor

Payload = torch.Tensor | QuantizedTensor


class Tier(IntEnum):
    """Also the scheduler's tier distance; NOT_CACHED is distance 3."""

    DEVICE = 0
    HOST = 1
    DISK = 2
    NOT_CACHED = 3


def payload_nbytes(payload: Payload) -> int:
    if isinstance(payload, QuantizedTensor):
        return payload.nbytes
    return payload.numel() * payload.element_size()


class MemoryTier:
    """Device or host memory: a dict of payloads with a byte budget."""

    def __init__(self, tier: Tier, device: torch.device, capacity_bytes: int,
                 pin_memory: bool = False) -> None:
        self.tier = tier
        self.device = device
        self.capacity_bytes = capacity_bytes
        # Pinned host memory makes host->device copies asynchronous-capable and faster.
        self.is_pinned = pin_memory
        self.used_bytes = 0
        self._payloads: dict[str, Payload] = {}

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self._payloads

    def has_room(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.capacity_bytes

    def put(self, block_hash: str, payload: Payload) -> None:
        payload = _to_device(payload, self.device, self.is_pinned)
        self._payloads[block_hash] = payload
        self.used_bytes += payload_nbytes(payload)

    def get(self, block_hash: str) -> Payload:
        return self._payloads[block_hash]

    def pop(self, block_hash: str) -> Payload:
        payload = self._payloads.pop(block_hash)
        self.used_bytes -= payload_nbytes(payload)
        return payload


@dataclass(frozen=True)
class DiskRecord:
    block_hash: str
    parent_hash: str
    tokens: tuple[int, ...]
    num_bytes: int


_ALIGN = 64


class DiskTier:
    def __init__(self, directory: str | os.PathLike, capacity_bytes: int) -> None:
        self.tier = Tier.DISK
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._sizes: dict[str, int] = {}

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self._sizes

    def has_room(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.capacity_bytes

    def path_of(self, block_hash: str) -> Path:
        return self.directory / f"{block_hash}.kvb"

    def put(self, block_hash: str, payload: Payload, parent_hash: str,
            tokens: tuple[int, ...]) -> None:
        if isinstance(payload, QuantizedTensor):
            parts = [payload.packed, payload.mins, payload.scales]
            header = {"kind": "q4", "shape": list(payload.shape),
                      "dtype": str(payload.dtype).removeprefix("torch."),
                      "group_size": payload.group_size,
                      "sizes": [payload.packed.numel(), payload.mins.numel(),
                                payload.scales.numel()]}
        else:
            parts = [payload]
            header = {"kind": "raw", "shape": list(payload.shape),
                      "dtype": str(payload.dtype).removeprefix("torch.")}
        header.update(parent=parent_hash, tokens=list(tokens))
        blob = json.dumps(header).encode()
        head_len = 8 + len(blob)
        pad = (-head_len) % _ALIGN
        path = self.path_of(block_hash)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            f.write(b"\0" * pad)
            for t in parts:
                f.write(t.detach().cpu().contiguous().numpy().tobytes())
        os.replace(tmp, path)
        size = path.stat().st_size
        self._sizes[block_hash] = size
        self.used_bytes += size

    def read(self, block_hash: str) -> Payload:
        """Memory-maps the file and copies the payload out of it."""
        return _read_block(self.path_of(block_hash))

    def remove(self, block_hash: str) -> None:
        self.used_bytes -= self._sizes.pop(block_hash)
        self.path_of(block_hash).unlink(missing_ok=True)

    def file_size(self, block_hash: str) -> int:
        return self._sizes[block_hash]

    def scan(self) -> list[DiskRecord]:
        """Blocks already in the directory (after a restart); adopts them into the
        byte accounting. Unreadable files and leftover temporaries are deleted."""
        records = []
        for tmp in self.directory.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        for path in sorted(self.directory.glob("*.kvb")):
            try:
                header, _ = _read_header(path)
            except (OSError, ValueError, KeyError):
                path.unlink(missing_ok=True)
                continue
            size = path.stat().st_size
            self._sizes[path.stem] = size
            self.used_bytes += size
            records.append(DiskRecord(path.stem, header["parent"], tuple(header["tokens"]), size))
        return records


def _read_header(path: Path) -> tuple[dict, int]:
    """A block file's header and the offset of its payload."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return header, 8 + n + ((-(8 + n)) % _ALIGN)


def _read_block(path: Path) -> Payload:
    header, offset = _read_header(path)
    # mode "c": copy-on-write mapping, so torch gets a writable array and the file is
    # never modified.
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=offset)
    raw = torch.from_numpy(data)
    shape = tuple(header["shape"])
    if header["kind"] == "raw":
        dtype = getattr(torch, header["dtype"])
        return raw.view(dtype).view(shape).clone()
    n_packed, n_mins, n_scales = header["sizes"]
    packed = raw[:n_packed].clone()
    floats = raw[n_packed:n_packed + 4 * (n_mins + n_scales)].clone().view(torch.float32)
    return QuantizedTensor(packed, floats[:n_mins], floats[n_mins:], shape,
                           getattr(torch, header["dtype"]), header["group_size"])


def _to_device(payload: Payload, device: torch.device, pin: bool) -> Payload:
    if isinstance(payload, QuantizedTensor):
        moved = payload.to(device)
        if pin:
            moved = QuantizedTensor(moved.packed.pin_memory(), moved.mins.pin_memory(),
                                    moved.scales.pin_memory(), moved.shape, moved.dtype,
                                    moved.group_size)
        return moved
    tensor = payload.to(device)
    return tensor.pin_memory() if pin else tensor
