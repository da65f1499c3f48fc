"""Packed-weight products: which kernel computes each weight format fastest, at decode batch sizes.

For every format (f32 panels, q8_0, q4_0, q4_1) and batch size (--batches, default 1, 10
and 64 rows), the products of one decode step of SmolLM2-135M's decoder (30 layers of the
fused QKV [960, 576], O [576, 576], gate/up [3072, 576] and down [576, 1536] matrices, each
layer's own random weights, so that they are read from memory as in a real step, not from
cache) are timed with:

- `native`: lamina.model.quant's kernel over the packed weight (csrc/qmatmul.c), as
  `lamina profile` times it (lamina.planner.measure.kernels: the layers and the run);
- `torch_f32`: torch's linear over the dequantized float32 weight (what the engine ran before);
- `torch_int4pack`: torch's `_weight_int4pack_mm_for_cpu` (group-wise int4, tinygemm's
  (q - 8) * scale + zero form: Q4_0 is scale d, zero 0; Q4_1 scale d, zero m + 8d), with
  float32 activations (so slow that it runs over --slow-layers layers, its time scaled to
  the whole decoder), and with bfloat16 activations (`torch_int4pack_bf16`, not exact: it
  rounds x and the result to bfloat16) for reference. Q8_0 has no torch kernel with groups
  (`_weight_int8pack_mm` scales whole channels only).

Variants run interleaved, --repeat times; medians of this process's CPU time (the machine
is shared: wall time counts the time others run; with one thread CPU time is the compute).
One torch thread (--threads). The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F  # noqa: N812 (torch's conventional name)

from lamina.model import quant
from lamina.planner.measure.kernels import LAYER, make_layers, native_run  # what `lamina profile` times


def _int4pack(pw: quant.PackedWeight, bf16: bool):
    """tinygemm's form of a q4_0 / q4_1 weight: int4 pack and [K/32, N, 2] scales and zeros."""
    q, d, m = quant.unpack_quantized(pw)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    d = d.float()
    zero = torch.zeros_like(d) if m is None else m.float() + 8 * d  # w = (q - 8) * d + zero
    sz = torch.stack([d, zero], dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]
    return packed, sz.bfloat16() if bf16 else sz


def _variants(fmt: str, layers: list[list[quant.PackedWeight]], slow_layers: int) -> dict:
    floats = [[quant.dequantize(pw) for pw in layer] for layer in layers]
    out = {  # name -> (run, factor that scales its time to the whole decoder)
        "native": (native_run(layers), 1.0),
        "torch_f32": (lambda x: [F.linear(x[w.shape[1]], w) for layer in floats for w in layer], 1.0),
    }
    if fmt in ("q4_0", "q4_1"):
        for bf16 in (False, True):
            used = layers if bf16 else layers[:slow_layers]
            packs = [[(_int4pack(pw, bf16), pw.k) for pw in layer] for layer in used]

            def run(x, packs=packs, bf16=bf16):
                return [torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x[k].bfloat16() if bf16 else x[k], p, quant.GROUP, sz) for layer in packs for (p, sz), k in layer]

            out["torch_int4pack_bf16" if bf16 else "torch_int4pack"] = (run, len(layers) / len(used))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,10,64")
    ap.add_argument("--formats", default="f32,q8_0,q4_0,q4_1")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--slow-layers", type=int, default=2, help="layers for torch's int4 kernel with float32 x")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if quant.NATIVE is None:
        raise SystemExit("model._qmatmul is not built: run `make native`")
    gen = torch.Generator().manual_seed(0)
    results: dict = {}
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); AVX2 kernel: {quant.NATIVE.has_avx2()}; "
          f"{args.layers} layers of {LAYER} (outputs, inputs)")
    for fmt in args.formats.split(","):
        layers = make_layers(fmt, args.layers, gen)
        nbytes = sum(pw.nbytes for layer in layers for pw in layer)
        variants = _variants(fmt, layers, args.slow_layers)
        for m in (int(b) for b in args.batches.split(",")):
            x = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
            times: dict[str, list[float]] = {name: [] for name in variants}
            for f, _ in variants.values():
                f(x)  # warm-up
            for _ in range(args.repeat):
                for name, (f, _) in variants.items():
                    t = time.process_time()
                    f(x)
                    times[name].append(time.process_time() - t)
            med = {name: statistics.median(ts) * variants[name][1] for name, ts in times.items()}
            best = min(med, key=med.get)
            results.setdefault(fmt, {})[m] = {name: round(s * 1e3, 2) for name, s in med.items()}
            print(f"{fmt:5} batch {m:3}: " + "  ".join(
                f"{name} {s * 1e3:7.1f} ms" for name, s in med.items())
                + f"   fastest: {best} ({nbytes / med['native'] / 1e9:.1f} GB/s of packed weight for native)")
    print(json.dumps({"ms": results, "layers": args.layers, "repeat": args.repeat, "threads": args.threads,
                      "load_avg_1min": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
