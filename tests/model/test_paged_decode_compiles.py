"""The paged and buffer attention kernels compiled for the GPUs they run on (Hopper,
sm_90) on this machine, which has none: Triton's compiler and the ptxas it ships take
the launches exactly as lamina.model.paged_decode makes them for each model shape and
dtype a GPU serves, and build them to machine code. The interpreter that runs the
kernels here (tests/model/test_paged_decode.py) accepts programs that do not compile;
this catches those, and a half-precision kernel that spills registers to local memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="needs triton (pip install '.[dev]' installs it)")

from lamina.model import paged_decode
from lamina.model.kv_attention import SlotBatch

HOPPER = 90
# A Hopper multiprocessor's shared memory for one block (227 KiB, opted into by Triton).
SHARED_LIMIT = 227 * 1024
# (model, query heads, KV heads, head dim, dtype): float32 is the exactness tests' (SmolLM2);
# bfloat16 is what the benchmark serves every shape in; float16 the other half precision.
SHAPES = [("smollm2-135m", 9, 3, 64, torch.float32), ("smollm2-135m", 9, 3, 64, torch.bfloat16),
          ("llama-3.2-1b", 32, 8, 64, torch.bfloat16), ("llama-3.1-8b", 32, 8, 128, torch.bfloat16),
          ("llama-3.1-8b", 32, 8, 128, torch.float16)]
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64"}


class _Recorder:
    """Stands for the kernels' module: each launch is recorded as (kernel, Triton
    signature, constexprs), not run."""

    def __init__(self) -> None:
        self.launches: list[dict] = []

    def __getattr__(self, name: str):
        from lamina.model import paged_decode_kernel

        names = getattr(paged_decode_kernel, name).arg_names
        launches = self.launches

        class Grid:
            def __getitem__(self, grid):
                def launch(*args, **constexprs):
                    signature = {n: _type(a) for n, a in zip(names, args)} | dict.fromkeys(constexprs, "constexpr")
                    launches.append({"kernel": name, "signature": signature,
                                     "constexprs": {k: _constexpr(v) for k, v in constexprs.items()}})
                return launch

        return Grid()


def _type(arg) -> str:
    if isinstance(arg, torch.Tensor):
        return "*" + _TYPES[arg.dtype]
    if isinstance(arg, float):
        return "fp32"
    return "i32" if -2**31 <= arg < 2**31 else "i64"


def _constexpr(value):
    import triton.language as tl

    return {"dtype": value.name} if isinstance(value, tl.dtype) else value


def _launches(monkeypatch) -> list[tuple[str, dict]]:
    """Every launch the host code makes for SHAPES, as on a GPU (products in the KV's
    dtype unless float32), each with the shape it was made for; duplicates dropped."""
    recorder = _Recorder()
    monkeypatch.setattr(paged_decode, "_kernels", lambda device: recorder)
    rule = paged_decode.products_in_float32
    monkeypatch.setattr(paged_decode, "products_in_float32", lambda dtype, device: rule(dtype, torch.device("cuda")))
    made: list[tuple[str, dict]] = []
    for model, hq, hkv, d, dtype in SHAPES:
        start = len(recorder.launches)
        q = torch.zeros(2, hq, d, dtype=dtype)
        pool = torch.zeros(8, hkv, d, dtype=dtype)
        slots = paged_decode.PagedSlots.of(SlotBatch.build([[1, 2, 3], [4, 5]], 8), "cpu")
        paged_decode.paged_attention(q, [1, 1], pool, pool, slots)
        # A row of 151 keys in 3 splits: their combine is launched too.
        buffers = [torch.zeros(1, 2, 160, hkv, d, dtype=dtype) for _ in range(2)]
        rows = paged_decode.BufferRows.of(buffers, [150, 1], [1, 1])
        paged_decode.attend_buffers(0, q, torch.zeros(2, hkv, d, dtype=dtype), torch.zeros(2, hkv, d, dtype=dtype),
                                    rows, splits=3)
        # A CUDA graph's decode step over the slab (model/step_graphs.py), in 3 splits.
        table = paged_decode.SlabRows.table([3, 2], torch.tensor([1, 2, 3, 4, 5]), rows=4)
        slab = paged_decode.SlabRows.over(table, torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32), 512)
        q4 = torch.zeros(4, hq, d, dtype=dtype)
        paged_decode.attend_slab(pool, pool, q4, torch.zeros(4, hkv, d, dtype=dtype),
                                 torch.zeros(4, hkv, d, dtype=dtype), slab, splits=3)
        made += [(f"{model} {str(dtype).removeprefix('torch.')}", launch) for launch in recorder.launches[start:]]
    unique = {json.dumps(launch, sort_keys=True): (shape, launch) for shape, launch in made}
    return list(unique.values())


def test_the_kernels_compile_for_hopper_as_launched(monkeypatch):
    launches = _launches(monkeypatch)
    assert {launch["kernel"] for _, launch in launches} == {"paged_decode", "buffer_decode", "buffer_append",
                                                             "combine_splits", "slab_append"}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    job = json.dumps({"arch": HOPPER, "launches": [launch for _, launch in launches]})
    done = subprocess.run([sys.executable, "-P", str(Path(__file__).with_name("compile_for_gpu.py"))], input=job,
                          capture_output=True, text=True, env=env, timeout=600)
    if done.returncode and "ptxas" in done.stderr:
        pytest.skip(f"triton's ptxas does not run here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    for (shape, launch), result in zip(launches, json.loads(done.stdout), strict=True):
        what = f"{launch['kernel']} for {shape}"
        assert "error" not in result, f"{what}: {result.get('error')}"
        assert result["shared"] <= SHARED_LIMIT, f"{what}: {result['shared']} bytes of shared memory"
        served = next(launch["signature"][name] for name in ("q", "k", "out") if name in launch["signature"])
        if "fp32" not in served:  # a half-precision kernel
            assert result["stack"] == 0, f"{what} spills: {result}"
