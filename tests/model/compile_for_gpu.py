"""Compiles Triton kernel launches for a CUDA target with no GPU present (Triton's own
compiler and the ptxas it ships), for tests/model/test_paged_decode_compiles.py, which
records the launches and runs this in a process of its own (that process must import
triton without TRITON_INTERPRET, which the tests' process sets).

stdin: JSON {"arch": 90, "launches": [{"kernel": name in lamina.model.paged_decode_kernel,
"signature": {arg: Triton type or "constexpr"}, "constexprs": {arg: value, or
{"dtype": name} for a triton.language dtype, by its name: "bf16"}}]}. stdout: JSON, per launch {"shared":
bytes, "warps": n, "registers": n, "stack": bytes} or {"error": text}.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lamina.model import paged_decode_kernel


def _value(v):
    return tl.dtype(v["dtype"]) if isinstance(v, dict) else v


def _resources(cubin: bytes) -> dict[str, int]:
    """Registers and stack (local memory: spills) per thread, as cuobjdump reads them."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    return {"registers": int(re.search(r"REG:(\d+)", text)[1]), "stack": int(re.search(r"STACK:(\d+)", text)[1])}


def main() -> None:
    job = json.load(sys.stdin)
    target = GPUTarget("cuda", job["arch"], 32)
    results = []
    for launch in job["launches"]:
        fn = getattr(paged_decode_kernel, launch["kernel"])
        constexprs = {k: _value(v) for k, v in launch["constexprs"].items()}
        try:
            compiled = triton.compile(ASTSource(fn=fn, signature=launch["signature"], constexprs=constexprs),
                                      target=target)
        except Exception as exc:  # noqa: BLE001 (any compile error is reported per launch: the test names it)
            results.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        results.append({"shared": compiled.metadata.shared, "warps": compiled.metadata.num_warps,
                        **_resources(compiled.asm["cubin"])})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
