"""This process's compute threads: one setting for the packed products and torch's ops.

The products (lamina.model.quant's native kernel) are nearly all of a decode step's work, and
they split their outputs over threads of their own. Torch's ops (norms' neighbours,
SiLU, sampling, prefill attention) are small beside them and run on one thread: torch's
OpenMP workers spin after each op, and on the cores the products' workers need that
spinning cost more than the ops gain (docs/model.md, Threads).
"""

from __future__ import annotations

import torch

from lamina.model import quant


def set_compute_threads(n: int) -> None:
    """n threads for the packed products, one for torch's intra-op work."""
    quant.set_kernel_threads(n)
    torch.set_num_threads(1)


def compute_threads() -> int:
    return quant.kernel_threads()
