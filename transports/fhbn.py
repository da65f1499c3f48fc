"""FHBN's CUDA side (``csrc/fhbn.cu``): build with nvcc, load with ctypes.

``nvcc`` comes from PyPI (``nvidia-cuda-nvcc``, ``nvidia-cuda-runtime``,
``nvidia-cuda-crt``, ``nvidia-nvvm``, in the ``dev`` extra) or a CUDA toolkit
(``CUDA_HOME`` or ``PATH``). Building needs no GPU; running needs a CUDA device (and,
for GPU-initiated sends, an mlx5 NIC). ``python -m transports.fhbn build [OUT]`` builds.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "fhbn.cu"
DEFAULT_ARCHS = ("80", "90")  # A100, H100/H200
EXPORTS = ("fhbn_wait_seq", "fhbn_store_seq", "fhbn_launch_post_write_imm", "fhbn_map_uar",
           "fhbn_unmap_uar", "fhbn_launch_proxy_enqueue", "fhbn_proxy_req_size", "fhbn_sq_size")


def find_nvcc() -> str | None:
    """The PyPI wheel's nvcc, else $CUDA_HOME/bin/nvcc, else nvcc on PATH."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cuda_nvcc"):
            cand = Path(root) / sub / "bin" / "nvcc"
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build(out_dir: str | os.PathLike, archs: tuple[str, ...] = DEFAULT_ARCHS, nvcc: str | None = None) -> Path:
    """Compile csrc/fhbn.cu to ``out_dir/libfhbn.so`` (static cudart); returns its path."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found: pip install 'lamina[dev]' or set CUDA_HOME")
    out = Path(out_dir) / "libfhbn.so"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [nvcc, "-O2", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static", "-o", str(out), str(SOURCE)]
    for arch in archs:
        cmd[1:1] = ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr}")
    return out


def load(path: str | os.PathLike) -> ctypes.CDLL:
    """Load a built library and declare its C signatures."""
    lib = ctypes.CDLL(str(path))
    u64, u32, vp = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p
    lib.fhbn_wait_seq.argtypes = [vp, u64, vp, vp]
    lib.fhbn_store_seq.argtypes = [vp, u64, vp]
    lib.fhbn_launch_post_write_imm.argtypes = [vp, u64, u32, u32, u64, u32, u32, vp]
    lib.fhbn_map_uar.argtypes = [vp, ctypes.c_size_t, ctypes.POINTER(vp)]
    lib.fhbn_unmap_uar.argtypes = [vp]
    lib.fhbn_launch_proxy_enqueue.argtypes = [vp, u32, u64, u64, u32, u32, u64, u32, u32, vp]
    lib.fhbn_proxy_req_size.restype = ctypes.c_size_t
    lib.fhbn_sq_size.restype = ctypes.c_size_t
    return lib


def device_availability() -> str | None:
    """``None`` when a CUDA device can run the kernels here, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device on this machine (or torch is a CPU build)"
    return None


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "build":
        print(build(sys.argv[2] if len(sys.argv) > 2 else "build"))
    else:
        sys.exit("usage: python -m transports.fhbn build [OUT_DIR]")
