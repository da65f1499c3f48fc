"""deploy/install_pins.py, which `make install` and the compose image run after torch: the
pins of constraints.txt that torch's own requirements contradict are dropped, the rest
kept as they are; the ucx extra is the one for the installed torch's CUDA."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "install_pins.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_ci_constraints_pass_through_beside_the_cpu_build_and_lose_only_what_a_cuda_build_contradicts():
    import torch

    constraints = SCRIPT.parents[1] / "constraints.txt"
    done = _run("constraints", str(constraints))
    assert done.returncode == 0, done.stderr
    lines = constraints.read_text().splitlines(keepends=True)
    if torch.version.cuda is None:  # CI's
        assert done.stdout == "".join(lines)
        return
    kept = done.stdout.splitlines(keepends=True)
    dropped = [line.strip() for line in lines if line not in kept]
    assert kept == [line for line in lines if line.strip() not in dropped]  # in order, unchanged
    assert dropped and all(f"{line} dropped: torch's dependencies need" in done.stderr for line in dropped)


def test_a_pin_that_torch_requires_otherwise_is_dropped_and_named(tmp_path):
    # torch requires typing-extensions>=4.10.0 and sympy>=1.13.3 (the CPU build as PyPI's CUDA one).
    pins = tmp_path / "constraints.txt"
    pins.write_text("typing-extensions==4.0.0\nSympy==1.13.3\nmsgpack==1.0.0\nsympy==1.0\n")
    done = _run("constraints", str(pins))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Sympy==1.13.3\nmsgpack==1.0.0\n"
    assert "typing-extensions==4.0.0 dropped: torch's dependencies need typing-extensions>=4.10.0" in done.stderr
    assert "sympy==1.0 dropped" in done.stderr


def test_the_ucx_extra_follows_the_torch_build():
    import torch

    done = _run("extras", "dev,ucx,ray")
    assert done.returncode == 0, done.stderr
    cuda13 = (torch.version.cuda or "").startswith("13.")
    assert done.stdout.strip() == ("dev,ucx-cu13,ray" if cuda13 else "dev,ucx,ray")


def test_a_wrong_call_prints_the_usage():
    done = _run("pins")
    assert done.returncode == 2 and "make install" in done.stderr
