"""Where a service computes, checked once at its start.

Every compute service names its device and dtype in its section of the configuration
(`prefill.device`, `model_worker.device`/`dtype`, `attention.device`/`dtype`). A
device torch cannot reach here stops the service before it loads anything, with one
line naming the setting: a stack asked for CUDA on a machine without it fails at once
instead of deep inside the first step.
"""

from __future__ import annotations

import torch

from lamina.services.config import ConfigError, StackConfig

# The settings of each service kind that name a device (services/launch's kinds).
DEVICE_SETTINGS = {"prefill": "prefill.device", "model_worker": "model_worker.device",
                   "attention": "attention.device"}


def compute_device(setting: str, name: str) -> torch.device:
    """torch's device for `name` (cpu, cuda, cuda:N); ConfigError if this host has none such."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"configuration: {setting} is {name}, but torch finds no CUDA device here "
                              f"(torch {torch.__version__}); set {setting}: cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"configuration: {setting} is {name}, but this host has {count} CUDA device(s)")
    return device


def use_device(device: torch.device) -> None:
    """Makes a CUDA `device` the calling thread's current one (each thread has its own:
    a service's compute thread calls this too, services/prefill/forward_thread.py).
    Triton's launches, CUDA graph capture and cuda_ipc's ring follow the current device,
    not the tensors': a service on cuda:1 that left it at cuda:0 would launch its kernels
    on the wrong device. A plain `cuda` is the current device already (and set_device
    refuses a device without index)."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def open_device(setting: str, name: str) -> torch.device:
    """The device a process computes on (`compute_device`), made its current one
    (`use_device`): what every compute service and command does once at its start."""
    device = compute_device(setting, name)
    use_device(device)
    if device.type == "cuda" and device.index is None:
        # A plain `cuda` is the current device: named by its index, as `lamina status` and
        # the logs show it (and as the tensors made on it report theirs).
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def compute_dtype(name: str) -> torch.dtype:
    """torch's dtype of a validated `*.dtype` setting (services.config.COMPUTE_DTYPES)."""
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def check_devices(config: StackConfig, kinds: tuple[str, ...] = tuple(DEVICE_SETTINGS)) -> None:
    """Every device the named service kinds would compute on is here (ConfigError if not)."""
    for kind in kinds:
        setting = DEVICE_SETTINGS[kind]
        section, _, key = setting.partition(".")
        compute_device(setting, getattr(getattr(config, section), key))
