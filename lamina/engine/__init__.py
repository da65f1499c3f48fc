"""The local engine: continuous batching over the split model in one process.

It runs the same code path the distributed services use (slices, the attention
operator over token-granular KV, the sampler), with attention computed in
process instead of on attention workers.
"""

from lamina.engine.engine import Engine, EngineConfig, RequestOutput
from lamina.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
