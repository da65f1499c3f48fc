"""The local engine: continuous batching over the split model in one process.

It shares with the distributed services the split model's slices, the sampler and
the batched attention kernel (lamina.model.kv_attention); it keeps KV in per-sequence
buffers and computes attention in process, where the services keep KV in slabs on
attention workers. docs/model.md says what is shared and what is not.
"""

from lamina.engine.engine import Engine, EngineConfig, RequestOutput
from lamina.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
