"""The local engine: continuous batching over the split model in one process.

It shares with the distributed services the split model's slices and its slice runner,
the step batch (lamina.model.batch), the sampler and the stop rule (lamina.sampling) and
the batched attention kernel (lamina.model.kv_attention); it keeps KV in per-sequence
buffers and computes attention in process, where the services keep KV in slabs on
attention workers. docs/model.md says what is shared and what is not. SamplingParams is
lamina.sampling.params', named here too for `from lamina.engine import Engine, SamplingParams`.
"""

from lamina.engine.engine import Engine, EngineConfig, RequestOutput
from lamina.sampling.params import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
