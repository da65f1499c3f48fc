"""The prompts and transformers' greedy tokens that the engine's identity tests
(test_reference.py, test_quant.py) compare against, in one module so that both tests
share one cache of the reference's tokens (pytest imports each test file as a module of
its own)."""

from __future__ import annotations

import torch

COMPLETION_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics state that",
]
CHAT_PROMPTS = [
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning, my friend' into Spanish.",
]
MAX_NEW = 48


def reference_prompts(tok):
    return [tok.encode(p) for p in COMPLETION_PROMPTS] + [
        tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS
    ]


# transformers' greedy tokens by (reference model, prompt): test_quant's file-weights test
# asks the same reference for the same prompts, each a sequential generate of MAX_NEW steps.
_HF_GREEDY: dict[tuple[int, tuple[int, ...]], list[int]] = {}


def hf_greedy(hf, ids):
    key = (id(hf), tuple(ids))
    if key not in _HF_GREEDY:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=MAX_NEW, do_sample=False)
        _HF_GREEDY[key] = out[0, len(ids):].tolist()
    return list(_HF_GREEDY[key])
