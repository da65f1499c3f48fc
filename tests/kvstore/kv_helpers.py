"""Shared helpers for the KV store tests (imported by name: pyproject.toml puts this
directory on the tests' path)."""

import torch

# Small synthetic KV shape: [num_layers, 2, block_size, n_kv_heads, head_dim].
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 2, 4, 4


def block_kv_bytes(block_size: int = BLOCK_SIZE) -> int:
    return NUM_LAYERS * 2 * block_size * NUM_KV_HEADS * HEAD_DIM * 4


def make_kv(num_tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_LAYERS, 2, num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g)
