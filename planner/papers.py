"""The seed papers' analyses recomputed with the planner's models, for docs/planner.md:

- Lamina: throughput per dollar of H100 model workers with H20 attention workers against
  H100s alone (fp16, as in the paper), on the paper's three traces (their mean lengths),
  for the decode phase alone (the paper's cost analysis) and with prefill on the model
  workers.
- LM-Offload: whether 4-bit group-wise quantization of weights or KV pays, by where the
  tensor is read from and where it is dequantized; and the thread choice for CPU attention.

`python -m lamina.planner.papers [TRACES_DIR]` prints the tables in Markdown.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from lamina.planner.estimate import cpu_attention_ops
from lamina.planner.hardware import Device, load_catalogue, parse_hardware
from lamina.planner.perf.quantization import FP16, INT4, quantization_verdict
from lamina.planner.perf.threads import choose_threads
from lamina.planner.plan import plan
from lamina.planner.shapes import BUILTIN, ModelShape
from lamina.planner.workload import WorkloadStats, load_trace

PCIE4_X16 = 32e9  # bytes/s one way: where FlexGen-style offloading streams weights and KV


@dataclass(frozen=True)
class CostComparison:
    workload: str
    decode_only: bool
    homogeneous: str
    homogeneous_tok_s_per_usd_h: float
    disaggregated: str
    disaggregated_tok_s_per_usd_h: float

    @property
    def ratio(self) -> float:
        """Throughput at equal cost, disaggregated over homogeneous."""
        return self.disaggregated_tok_s_per_usd_h / self.homogeneous_tok_s_per_usd_h


def lamina_comparison(shape: ModelShape, stats: WorkloadStats, name: str, catalogue: Mapping[str, Device],
                      decode_only: bool) -> CostComparison:
    ranked = plan(shape, parse_hardware("H100,H20", catalogue), catalogue, stats, quantize="none",
                  decode_only=decode_only)

    def best(disaggregated: bool):
        return min((e for e in ranked if e.layout.is_disaggregated == disaggregated
                    and e.layout.model_device == "H100" and e.layout.attention_device in (None, "H20")),
                   key=lambda e: e.usd_per_mtok)

    homo, dis = best(False), best(True)
    per_usd = lambda e: e.unit_tok_s / e.layout.usd_per_hour(catalogue)  # noqa: E731
    return CostComparison(name, decode_only, homo.layout.describe(), per_usd(homo),
                          dis.layout.describe(), per_usd(dis))


@dataclass(frozen=True)
class QuantRow:
    case: str
    bandwidth: float
    vector_flops: float
    saved_s_per_gb: float
    cost_s_per_gb: float
    worth_it: bool


def lm_offload_quantization(catalogue: Mapping[str, Device]) -> list[QuantRow]:
    """Per 1e9 fp16 elements streamed, the time 4-bit storage saves and dequantization costs."""
    a100, cpu = catalogue["A100"], catalogue["CPU"]
    cases = [
        ("weights or KV over PCIe 4.0 x16, dequantized on an A100", PCIE4_X16, a100.vector_flops),
        ("KV in A100 HBM, attention on the A100", a100.achieved_bw, a100.vector_flops),
        ("KV in CPU DRAM, attention on all 96 cores", cpu.achieved_bw, cpu.vector_flops),
        ("KV in CPU DRAM, attention on 8 of 96 cores", cpu.achieved_bw, cpu.vector_flops * 8 / 96),
    ]
    rows = []
    for case, bw, flops in cases:
        v = quantization_verdict(1e9, bw, flops, INT4)
        rows.append(QuantRow(case, bw, flops, v.saved_s, v.cost_s, v.worth_it))
    return rows


def break_even_flops_per_byte() -> float:
    """Vector FLOP/s per byte/s above which 4-bit pays: dequant ops / bytes saved per element."""
    return INT4.dequant_ops_per_element / (2 - INT4.bytes_per_element)


def cpu_attention_threads(shape: ModelShape, catalogue: Mapping[str, Device], batch: int, context: int,
                          cores: int):
    """LM-Offload's inter-/intra-op choice for one layer of CPU attention, one op per KV head,
    on `cores` of the CPU node's cores (its whole memory bandwidth)."""
    ops = cpu_attention_ops(shape, catalogue["CPU"], batch, context, workers=1, kv=FP16)
    return choose_threads(ops, cores)


TRACE_FILES = {"Azure-Conv": "azure_conv_2023.csv", "Azure-Code": "azure_code_2023.csv",
               "Kimi-Conv": "kimi_conversation_trace.jsonl"}


def main(argv: list[str]) -> int:
    traces = Path(argv[0]) if argv else Path(__file__).resolve().parents[2] / "shared" / "traces"
    catalogue = load_catalogue()
    shape = BUILTIN["llama-3-70b"]
    print("| trace | phase | best H100-only | tok/s per USD/h | best H100 + H20 | tok/s per USD/h | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, file in TRACE_FILES.items():
        stats = load_trace(traces / file).stats()
        for decode_only in (True, False):
            c = lamina_comparison(shape, stats, name, catalogue, decode_only)
            phase = "decode only" if decode_only else "with prefill"
            print(f"| {name} | {phase} | {c.homogeneous} | {c.homogeneous_tok_s_per_usd_h:.1f} | "
                  f"{c.disaggregated} | {c.disaggregated_tok_s_per_usd_h:.1f} | {c.ratio:.2f} |")
    print("\n| stream | GB/s | vector TFLOP/s | saved s per 1e9 elements | dequant s | quantize? |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in lm_offload_quantization(catalogue):
        print(f"| {r.case} | {r.bandwidth / 1e9:.0f} | {r.vector_flops / 1e12:.1f} | {r.saved_s_per_gb:.4f} | "
              f"{r.cost_s_per_gb:.4f} | {'yes' if r.worth_it else 'no'} |")
    print(f"\nbreak-even: {break_even_flops_per_byte():.2f} vector FLOP per byte of bandwidth")
    for cores in (2, 8, 96):
        t = cpu_attention_threads(shape, catalogue, batch=32, context=4096, cores=cores)
        print(f"CPU attention, llama-3-70b, batch 32, context 4096, {cores} cores: "
              f"inter-op {t.inter_op} x intra-op {t.intra_op}, {t.makespan_s * 1e3:.2f} ms/layer, "
              f"efficiency {t.efficiency:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
