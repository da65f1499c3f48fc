"""attention.kv_capacity_bytes auto (services/kv_budget.py): 1 GiB on the CPU; on a GPU the
share of gpu_memory_utilization of its memory that the weights, prefix caches and process
reserves of the stack's services there leave each KV holder, from the configuration
alone; a GPU that leaves too little is refused naming the setting. The GPU's total memory
is given here (no GPU); the attention service and lamina up read it from torch."""

from __future__ import annotations

import pytest

from lamina.model.random_models import SHAPES
from lamina.planner.shapes import ModelShape
from lamina.services.config import ConfigError, load_config
from lamina.services.kv_budget import CPU_KV_BYTES, MIN_KV_BYTES, PROCESS_RESERVE_BYTES, kv_budget, same_device

GIB = 1 << 30
PARAMS_8B = ModelShape.of(SHAPES["llama-3.1-8b"], "llama-3.1-8b").num_params
ON_GPU = {"LAMINA_PREFILL_DEVICE": "cuda", "LAMINA_MODEL_DEVICE": "cuda", "LAMINA_ATTENTION_DEVICE": "cuda"}


def test_on_the_cpu_auto_is_one_gib_and_a_set_capacity_is_kept():
    assert kv_budget(load_config(env={}), PARAMS_8B, None).per_holder == CPU_KV_BYTES == GIB
    set_here = load_config(env={}, overrides={"attention.kv_capacity_bytes": 3 * GIB})
    assert kv_budget(set_here, PARAMS_8B, None).per_holder == 3 * GIB
    on_gpu = load_config(env=ON_GPU, overrides={"attention.kv_capacity_bytes": 3 * GIB})
    assert kv_budget(on_gpu, PARAMS_8B, 140 * GIB) == kv_budget(set_here, PARAMS_8B, None)


def test_on_one_gpu_the_kv_gets_what_the_weights_caches_and_processes_leave():
    """8B in bfloat16 on a 140 GiB GPU, 0.9 of it usable: colocated, one prefill and one
    model worker hold the weights twice, the prefill's device tier 256 MiB, 2 processes
    reserve 2 GiB each; the one core gets the rest. Disaggregated with 2 attention
    workers: 4 processes, the rest split in two."""
    weights = 2 * PARAMS_8B * 2
    rest = 0.9 * 140 * GIB - weights - (256 << 20)
    colocated = kv_budget(load_config(env=ON_GPU, overrides={"layout": "colocated"}), PARAMS_8B, 140 * GIB)
    assert colocated.per_holder == int(rest - 2 * PROCESS_RESERVE_BYTES) >> 20 << 20
    assert 91 * GIB < colocated.per_holder < 92 * GIB
    assert colocated.why.startswith("auto: 0.9 of 140.0 GiB on cuda, less 30.2 GiB (1 prefill worker(s)' weights "
                                    "in bfloat16, 1 model worker(s)' weights in bfloat16, their prefix caches' "
                                    "device tier) and 4.0 GiB for 2 process(es), over 1 KV holder(s)")
    split = kv_budget(load_config(env=ON_GPU, overrides={"layout": "disaggregated", "attention.workers": 2}),
                      PARAMS_8B, 140 * GIB)
    assert split.per_holder == int((rest - 4 * PROCESS_RESERVE_BYTES) / 2) >> 20 << 20
    # float32 weights count 4 bytes each; a lower utilization leaves less.
    f32 = kv_budget(load_config(env={**ON_GPU, "LAMINA_MODEL_DTYPE": "float32"}, overrides={"layout": "colocated"}),
                    PARAMS_8B, 140 * GIB)
    assert colocated.per_holder - f32.per_holder == pytest.approx(2 * PARAMS_8B, abs=1 << 20)
    lower = kv_budget(load_config(env={**ON_GPU, "LAMINA_GPU_MEMORY_UTILIZATION": "0.5"},
                                  overrides={"layout": "colocated"}), PARAMS_8B, 140 * GIB)
    assert colocated.per_holder - lower.per_holder == pytest.approx(0.4 * 140 * GIB, abs=1 << 20)


def test_attention_on_a_gpu_of_its_own_counts_only_what_is_there():
    config = load_config(env={**ON_GPU, "LAMINA_ATTENTION_DEVICE": "cuda:1"},
                         overrides={"layout": "disaggregated", "attention.workers": 2})
    budget = kv_budget(config, PARAMS_8B, 80 * GIB)
    assert budget.per_holder == int((0.9 * 80 * GIB - 2 * PROCESS_RESERVE_BYTES) / 2) >> 20 << 20
    assert "(no weights there)" in budget.why
    assert same_device("cuda", "cuda:0") and not same_device("cuda", "cuda:1") and not same_device("cpu", "cuda")


def test_a_gpu_that_leaves_no_kv_room_is_refused_naming_the_setting():
    config = load_config(env=ON_GPU, overrides={"layout": "colocated"})
    with pytest.raises(ConfigError, match=r"attention\.kv_capacity_bytes auto: 0\.9 of 32\.0 GiB on cuda, less "
                                          r"30\.2 GiB .* less than 64 MiB; set attention\.kv_capacity_bytes"):
        kv_budget(config, PARAMS_8B, 32 * GIB)
    assert kv_budget(config, PARAMS_8B, 40 * GIB).per_holder >= MIN_KV_BYTES


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_the_gpu_memory_utilization_is_a_fraction(value):
    with pytest.raises(ConfigError, match=r"attention\.gpu_memory_utilization must be above 0 and at most 1"):
        load_config(env={"LAMINA_GPU_MEMORY_UTILIZATION": value})
    with pytest.raises(ConfigError, match=r"attention\.kv_capacity_bytes must be a non-negative integer"):
        load_config(env={}, overrides={"attention.kv_capacity_bytes": -1})


def test_an_elastic_pool_and_a_service_on_its_own_count_what_may_be_there():
    """A pool that may grow to 3 workers gives each its third; a service started on its
    own (its peers elsewhere) counts only its own process: an attention worker its reserve,
    a colocated model worker also its weights."""
    grown = load_config(env=ON_GPU, overrides={"layout": "disaggregated", "attention.workers": 1,
                                               "attention.max_workers": 3})
    weights = 2 * PARAMS_8B * 2 + (256 << 20)
    assert kv_budget(grown, PARAMS_8B, 140 * GIB).per_holder == int(
        (0.9 * 140 * GIB - weights - 5 * PROCESS_RESERVE_BYTES) / 3) >> 20 << 20
    alone = kv_budget(grown, PARAMS_8B, 140 * GIB, whole_host=False)
    assert alone.per_holder == int(0.9 * 140 * GIB - PROCESS_RESERVE_BYTES) >> 20 << 20
    assert alone.why.endswith("over 1 KV holder(s), counting only this process")
    colocated = load_config(env=ON_GPU, overrides={"layout": "colocated"})
    own = kv_budget(colocated, PARAMS_8B, 140 * GIB, whole_host=False)
    assert own.per_holder == int(0.9 * 140 * GIB - PARAMS_8B * 2 - PROCESS_RESERVE_BYTES) >> 20 << 20


def test_a_stack_writes_the_counted_bytes_for_its_services(monkeypatch):
    """with_kv_budget (what Stack.start and lamina up apply): on a GPU, auto becomes the
    bytes counted over the whole host, which the services then read as set; on the CPU,
    or with a capacity set, the configuration is left as it is."""
    from types import SimpleNamespace

    import torch

    from lamina.services.kv_budget import with_kv_budget

    cpu = load_config(env={})
    assert with_kv_budget(cpu) == (cpu, None)
    set_here = load_config(env=ON_GPU, overrides={"attention.kv_capacity_bytes": GIB})
    assert with_kv_budget(set_here) == (set_here, None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=40 * GIB))
    gpu = load_config(env=ON_GPU, overrides={"layout": "colocated"})
    written, budget = with_kv_budget(gpu)
    assert budget is not None and written.attention.kv_capacity_bytes == budget.per_holder > MIN_KV_BYTES
    assert "over 1 KV holder(s)" in budget.why and "counting only" not in budget.why
    assert kv_budget(written, PARAMS_8B, None, whole_host=False).why == "attention.kv_capacity_bytes"
