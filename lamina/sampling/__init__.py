"""Sampling, below both the local engine and the services: what turns a step's logits
into tokens, and when a sequence stops.

- `params`: `SamplingParams`, a request's sampling parameters.
- `sampler`: `Sampler` and each sequence's `SeqSampling` (penalties, grammar, seeded
  pick, log-probabilities), the one place a token is sampled.
- `penalties`, `grammar`, `logprobs`: the sampler's parts.
- `stop`: the stop rule (`stop_reason`).
"""
