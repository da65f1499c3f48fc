"""Where the Triton kernels' tests run: compiled on a GPU, or on CPU tensors under Triton's
interpreter, which tests/conftest.py turns on only where torch finds no CUDA device."""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest
import torch

NO_TRITON = pytest.mark.skipif(find_spec("triton") is None, reason="needs triton (pip install '.[dev]' installs it)")
INTERPRETER_OFF = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton's interpreter is off (a CUDA host: the kernels run compiled there, in the cuda cases)")
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch finds none here)")
# A test of the kernels on CPU tensors: triton installed, its interpreter on.
INTERPRETED = [NO_TRITON, INTERPRETER_OFF]
# The kernels' devices: CPU tensors under the interpreter, and a GPU.
KERNEL_DEVICES = [pytest.param("cpu", marks=INTERPRETER_OFF), pytest.param("cuda", marks=NO_CUDA)]
