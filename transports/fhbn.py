"""FHBN's CUDA side (``csrc/fhbn.cu``): build with nvcc, load with ctypes.

``nvcc`` comes from PyPI (``nvidia-cuda-nvcc``, ``nvidia-cuda-runtime``,
``nvidia-cuda-crt``, ``nvidia-nvvm``, in the ``dev`` extra) or a CUDA toolkit
(``CUDA_HOME`` or ``PATH``). Building needs no GPU; running needs a CUDA device (and,
for GPU-initiated sends, an mlx5 NIC). ``python -m lamina.transports.fhbn build [OUT]`` builds.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .rdma import device_availability as rdma_device_availability
from .rdma_transport import RdmaTransport

# lamina/csrc: the csrc/ folder (through its link) in a checkout, package data in a wheel.
SOURCE = Path(__file__).parent.parent / "csrc" / "fhbn.cu"
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


# ---------------------------------------------------------------- host-proxy fallback
# One request of the ring, laid out exactly as ``struct fhbn_proxy_req`` in csrc/fhbn.cu
# (checked against fhbn_proxy_req_size() by the build test). ``seq`` is written last by
# the producer (n + 1 for request n) and cleared to 0 by the proxy once posted, which is
# also what tells the producer the slot is free again.
PROXY_REQ = np.dtype([("laddr", "<u8"), ("raddr", "<u8"), ("lkey", "<u4"), ("rkey", "<u4"),
                      ("len", "<u4"), ("imm", "<u4"), ("seq", "<u8")])
assert PROXY_REQ.itemsize == 40

PostWrite = Callable[[int, int, int, int, int, int, int], None]
"""post(laddr, lkey, length, raddr, rkey, imm, wr_id): e.g. VerbsEndpoint.post_write_imm."""


class ProxyRing:
    """``num_slots`` work-request descriptors in a caller-provided buffer: numpy memory in
    tests, pinned host memory (a ``pin_memory()`` tensor, device-visible through UVA)
    when a CUDA kernel is the producer."""

    def __init__(self, buffer, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("a proxy ring needs at least one slot")
        self.num_slots = num_slots
        self.reqs = np.frombuffer(buffer, dtype=PROXY_REQ, count=num_slots)
        if not self.reqs.flags.writeable:
            raise ValueError("the proxy ring's buffer must be writable")

    @classmethod
    def allocate(cls, num_slots: int) -> ProxyRing:
        return cls(bytearray(num_slots * PROXY_REQ.itemsize), num_slots)

    @property
    def address(self) -> int:
        return self.reqs.ctypes.data

    def try_enqueue(self, n: int, laddr: int, lkey: int, length: int, raddr: int, rkey: int,
                    imm: int) -> bool:
        """Host-side producer (same protocol as the device's ``fhbn_proxy_enqueue``):
        fill slot ``n % num_slots`` and publish it; False while the slot is not yet drained."""
        r = self.reqs[n % self.num_slots]
        if r["seq"] != 0:
            return False
        r["laddr"], r["raddr"], r["lkey"], r["rkey"], r["len"], r["imm"] = laddr, raddr, lkey, rkey, length, imm
        r["seq"] = n + 1  # last: publishes the request
        return True


class HostProxy:
    """The thread that drains GPU-enqueued requests from a ``ProxyRing`` and posts each
    with ``post`` (ibv_post_send through pyverbs) in order.

    Polls the next slot's ``seq`` for ``spin_s`` after the last request, then naps
    ``idle_sleep_s`` between polls so an idle proxy costs little CPU. ``start()`` /
    ``stop()`` own the thread; a failing ``post`` stops the proxy and is kept in
    ``error`` (re-raised by ``stop()``).
    """

    def __init__(self, ring: ProxyRing, post: PostWrite, *, spin_s: float = 50e-6,
                 idle_sleep_s: float = 200e-6) -> None:
        self.ring = ring
        self._post = post
        self._spin_s = spin_s
        self._idle_sleep_s = idle_sleep_s
        self.posted = 0  # requests drained and posted, in order
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("proxy already started")
        self._thread = threading.Thread(target=self._run, name="fhbn-host-proxy", daemon=True)
        self._thread.start()

    def drain(self) -> int:
        """Post every request published so far; returns how many."""
        reqs, slots = self.ring.reqs, self.ring.num_slots
        n = 0
        while True:
            r = reqs[self.posted % slots]
            if r["seq"] != self.posted + 1:
                return n
            self._post(int(r["laddr"]), int(r["lkey"]), int(r["len"]), int(r["raddr"]),
                       int(r["rkey"]), int(r["imm"]), self.posted)
            r["seq"] = 0  # frees the slot for the producer
            self.posted += 1
            n += 1

    def _run(self) -> None:
        last = time.perf_counter()
        try:
            while not self._stop.is_set():
                if self.drain():
                    last = time.perf_counter()
                elif time.perf_counter() - last > self._spin_s:
                    self._stop.wait(self._idle_sleep_s)
        except BaseException as exc:  # noqa: BLE001 (kept for stop(), which raises it: a thread has no caller)
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            raise self.error


class FhbnTransport(RdmaTransport):
    """``fhbn://DEVICE/PORT/HOST:TCPPORT``: needs a CUDA device and an RDMA device.

    Frames travel with the verbs slot protocol of ``rdma://`` (chunks taken from receive
    completions on the host; nothing in the slab for a device-side ``fhbn_wait_seq`` to
    poll); the GPU-initiated send and the host proxy above are primitives for
    device-resident producers, not used by ``Connection.send``.
    """

    scheme = "fhbn"

    @classmethod
    def availability(cls) -> str | None:
        reason = device_availability()
        if reason is not None:
            return reason
        return rdma_device_availability()


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "build":
        print(build(sys.argv[2] if len(sys.argv) > 2 else "build"))
    else:
        sys.exit("usage: python -m lamina.transports.fhbn build [OUT_DIR]")
