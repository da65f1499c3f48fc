"""Which packed format each weight of a loaded model takes: `load_model(path, weights=...)`.

| weights | decoder linears | LM head (and the embedding) |
| --- | --- | --- |
| `float32` | f32 panels | f32 panels |
| `q8_0` | q8_0 | q8_0 |
| `q4` | q4_1: LM-Offload's group-wise min-max 4-bit | q8_0 |
| `as_file` | a GGUF's own format where the kernels read it (Q8_0, Q4_0, Q4_1), else f32 panels | the same |

A tied embedding reads the LM head's packed table (no second copy of the vocabulary);
an untied one keeps its float table with `float32`, takes the head's format with `q8_0`
and `q4`, and the file's with `as_file`. Without the native kernel (`lamina.model.quant.NATIVE`
is None) `float32` keeps torch's own linears, and the quantized choices run, slowly, by
dequantizing at each product.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from lamina.model import quant
from lamina.model.llama import FUSED_PROJECTIONS, LlamaForCausalLM
from lamina.model.quant import PackedWeight, QuantEmbedding, QuantLinear

WEIGHT_CHOICES = ("float32", "q8_0", "q4", "as_file")
_DECODER_FORMAT = {"float32": "f32", "q8_0": "q8_0", "q4": "q4_1"}
_HEAD_FORMAT = {"float32": "f32", "q8_0": "q8_0", "q4": "q8_0"}


def check_weights(weights: str) -> str:
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"unknown weights {weights!r} (choose from {', '.join(WEIGHT_CHOICES)})")
    return weights


def pack_model(model: LlamaForCausalLM, weights: str,
               from_file: dict[str, PackedWeight] | None = None) -> dict[str, int]:
    """Replace the model's linears (and embedding) by packed ones, in place.

    from_file: the checkpoint's packed matrices by Hugging Face name (`as_file`).
    Returns how many matrices took each format.
    """
    check_weights(weights)
    if weights == "float32" and quant.NATIVE is None:
        return {"torch": sum(isinstance(m, nn.Linear) for m in model.modules())}
    from_file = from_file or {}
    formats: Counter[str] = Counter()
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        packed = _choose(name, module, weights, from_file, model.config.tie_word_embeddings)
        formats[packed.fmt] += 1
        model.set_submodule(name, QuantLinear(packed, module.bias))
    cfg = model.config
    # The embedding changes type (nn.Embedding -> QuantEmbedding), like the linears above.
    if cfg.tie_word_embeddings:
        head = model.lm_head
        assert isinstance(head, QuantLinear)  # replaced in the loop above, like every linear
        model.set_submodule("model.embed_tokens", QuantEmbedding(head))
    elif weights != "float32":
        table = _choose("model.embed_tokens", model.model.embed_tokens, weights, from_file, False)
        model.set_submodule("model.embed_tokens", QuantEmbedding(QuantLinear(table)))
        formats[table.fmt] += 1
    return dict(formats)


def _choose(name: str, module: nn.Module, weights: str, from_file: dict[str, PackedWeight],
            tied: bool) -> PackedWeight:
    weight = module.weight  # an nn.Linear's or nn.Embedding's
    assert isinstance(weight, torch.Tensor)
    w = weight.detach()
    is_head = name in ("lm_head", "model.embed_tokens")
    if weights == "as_file":
        path, _, last = name.rpartition(".")
        parts = [f"{path}.{p}.weight" for p in FUSED_PROJECTIONS[last]] if last in FUSED_PROJECTIONS else [
            f"{name}.weight"]
        if name == "lm_head" and tied:  # the file stores the tied matrix once, as the embedding
            parts = ["model.embed_tokens.weight"]
        found = [f for f in (from_file.get(p) for p in parts) if f is not None]
        # One format for a fused projection: parts stored differently run as float32.
        if len(found) == len(parts) and len({f.fmt for f in found}) == 1:
            return found[0] if len(found) == 1 else quant.concat_rows(found)
        return quant.pack_float(w)
    fmt = (_HEAD_FORMAT if is_head else _DECODER_FORMAT)[weights]
    return quant.pack_float(w) if fmt == "f32" else quant.quantize(w, fmt)

