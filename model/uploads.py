"""Small host tensors (index tables, row lengths) sent to the device they index."""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`. To a GPU through pinned memory, without waiting: a copy
    from pageable memory first waits for everything queued on the stream. torch's caching
    host allocator keeps the pinned block until the copy is done."""
    device = torch.device(device)
    if device.type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
