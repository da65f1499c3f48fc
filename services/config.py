"""Typed configuration of the whole stack: one file (YAML or TOML) for every service.

Precedence: defaults < file < environment (LAMINA_* and REDIS_URL) < command-line
flags. Everything is validated at start; a bad value stops the service with one
clear message naming the setting.

    model: null                 # checkpoint dir or .gguf; null = SmolLM2-135M-Instruct
    weights: as_file            # as_file | float32 | q8_0 | q4 (packed linears: docs/model.md)
    redis_url: null             # null = embedded redis-server (lamina up starts it)
    namespace: lamina           # prefix of every Redis key
    layout: disaggregated       # disaggregated: attention workers of their own | colocated: each model
                                # worker attends in its own process (its KV held there; no attention
                                # worker processes, attention.workers = model_worker.workers); LAMINA_LAYOUT
    transport: tcp              # tcp | ucx | shm | cuda_ipc (data plane; cuda_ipc: GPU tensors between
                                # services on one host, docs/transports.md)
    partition: request          # request | head (how KV is spread over attention workers)
    cluster_token: null         # shared secret every gRPC call and data-plane connection between services
                                # must present; null: lamina up generates one, a service started alone
                                # accepts everyone on loopback (and logs a warning) and refuses to start
                                # on any other host unless insecure. docs/security.md
    insecure: false             # serve without cluster_token on a host other than loopback (every service
                                # but the gateway, whose own rule is gateway.insecure); --insecure sets
                                # both; LAMINA_INSECURE
    host: 127.0.0.1             # interface every service binds (0.0.0.0: all, as in a container); LAMINA_HOST
    advertise_host: null        # address registered for peers; null: host, or for 0.0.0.0 / :: the
                                # address of this machine's hostname (services/addresses.py); LAMINA_ADVERTISE_HOST
    ports: {grpc: 0, metrics: 0}   # this service's gRPC and Prometheus ports (0: the system picks), fixed
                                # for health probes and scraping; one service per host only (lamina up
                                # refuses non-zero); LAMINA_GRPC_PORT, LAMINA_METRICS_PORT
    gateway: {port: 8000, api_key: null, max_queue: 256, served_model_name: null,
              insecure: false}   # insecure: serve without api_key on a host other than loopback
    scheduler: {max_batch_size: 0, max_queue: 256, policy: fcfs,   # policy: fcfs | fpf | relaxed_fpf
                join_hold_ms: 5000.0}   # services/scheduler/join_hold.py
                                # max_batch_size: sequences decoding at once (0, auto: 64 with the
                                # model workers on the CPU, 256 on a GPU)
    prefill: {workers: 1, threads: 0, device: cpu, dtype: auto, cache_block_tokens: 16,
              cache_device_bytes: 268435456,
              cache_host_bytes: 536870912, cache_disk_bytes: 0, cache_dir: null, cache_eviction: lru,
              routing: prefix, routing_load_weight: 0.0, routing_min_gain_tokens: 32,
              routing_max_queue_gap_tokens: 4096,
              max_batch_tokens: 2048, chunk_tokens: 0, batch_window_ms: 5.0, batch_window_max_ms: 50.0,
              cache_quantize_4bit: false, cache_quant_group_size: 64, peer_fetch: auto,
              peer_fetch_prior_gbps: 1.0, prefetch: true}
                                # workers: prefill processes prefill-0..P-1, each with its own cache
                                # (cache_dir/prefill-I when P > 1); threads: at most this many compute
                                # threads a forward (0: model_worker.threads), each forward taking the
                                # host's cores other processes' threads leave; device: cpu | cuda | cuda:N, where
                                # the prefill workers compute and their cache's device tier lives
                                # (float32 weights off CPU; LAMINA_PREFILL_DEVICE); dtype: auto (float32
                                # on the CPU, bfloat16 on a GPU) | float32 | bfloat16 | float16, of their
                                # weights, activations and KV (another than float32 needs weights:
                                # float32 on the CPU; LAMINA_PREFILL_DTYPE); routing: prefix (the
                                # worker holding the longest prefix among those queued at most
                                # routing_max_queue_gap_tokens more than the least; a prefix no worker
                                # holds routing_min_gain_tokens more of than the others counts for
                                # nothing: the worker sent the least work lately) | round_robin;
                                # cache_quantize_4bit: host and disk tiers hold 4-bit blocks;
                                # peer_fetch: auto (pull a peer's longer prefix when the measured
                                # transfer beats recomputing it) | always | off (docs/kvstore.md);
                                # prefetch: waiting prompts' prefixes move up to the device tier
                                # while a forward computes (LAMINA_PREFILL_PREFETCH);
                                # chunk_tokens: at most this many of a prompt's tokens a forward,
                                # so prompts queued behind a long one join its next forward (0:
                                # auto, 512 on a CPU, 2048 on a GPU; LAMINA_PREFILL_CHUNK_TOKENS)
    model_worker: {threads: 1, workers: 1, device: cpu, dtype: auto, cuda_graphs: true, step_graphs: true}
                                # threads: the packed products' (torch's ops run on one);
                                # LAMINA_MODEL_THREADS; device: cpu | cuda | cuda:N, where the slices
                                # and sampling compute (LAMINA_MODEL_DEVICE); dtype: auto (float32 on
                                # the CPU, bfloat16 on a GPU) | float32 | bfloat16 | float16 of weights
                                # and activations (other than float32 needs weights: float32 on the
                                # CPU; LAMINA_MODEL_DTYPE); cuda_graphs:
                                # decode slices replayed as CUDA graphs on a GPU (LAMINA_MODEL_CUDA_GRAPHS);
                                # step_graphs: with them, colocated on the attention core's GPU, a
                                # decode step replayed whole, its attention included (LAMINA_MODEL_STEP_GRAPHS)
    pipeline: {micro_batches: 2, min_micro_batch: 16, q_early: false,
               mode: fixed}     # fixed: micro-batches per model worker (colocated: 1); rotational: M + 1 over M workers
    attention: {workers: 2, max_workers: 0, threads: 1, kv_capacity_bytes: 0, gpu_memory_utilization: 0.9,
                kv_quant: none, device: cpu, dtype: auto, cuda_graphs: true}
                                # kv_capacity_bytes: each core's KV; 0 (auto): 1 GiB on the CPU, on a
                                # GPU what the stack's processes there leave of gpu_memory_utilization
                                # of its memory (services/kv_budget.py; LAMINA_GPU_MEMORY_UTILIZATION);
                                # kv_quant: none | q4: KV rows stored 4-bit group-wise (docs/model.md;
                                # q4 on the CPU only); device, dtype: where the KV slab lives and
                                # attention computes, and the KV's dtype (auto: float32 on the CPU,
                                # bfloat16 on a GPU; LAMINA_ATTENTION_DEVICE, LAMINA_ATTENTION_DTYPE);
                                # cuda_graphs: on a GPU each decode frame's attention replayed as
                                # a CUDA graph (LAMINA_ATTENTION_CUDA_GRAPHS);
                                # workers: LAMINA_ATTENTION_WORKERS, started with; max_workers
                                # (0: = workers): more may join the running stack up to it, and
                                # leave (request partitioning); LAMINA_ATTENTION_MAX_WORKERS
    data_plane: {busy_poll_us: null, checksum_payloads: false, shm_ring_bytes: 16777216,
                 cuda_ipc_ring_bytes: 67108864, cuda_ipc_device_order: false,
                 ucx_progress_mode: blocking, ucx_tls: null,
                 ucx_device_memory: true, native_frames: true}   # see docs/transports.md;
                                # cuda_ipc_device_order: frames sent without waiting for the
                                # GPU, ordered on it (LAMINA_CUDA_IPC_DEVICE_ORDER)
    # deadlines: every wait on a peer (docs/reliability.md)
    deadlines: {reply_s: 10, rpc_s: 30, step_s: 30, health_s: 2, recovery_s: 120, startup_s: 60,
                kv_reclaim_s: 60, prefill_tokens_per_s: 50}
    warm_up: true               # prefill and model workers run one made-up forward, and the gateway its
                                # tokenizer's first encodes, before they serve (services/warm_up.py;
                                # LAMINA_WARM_UP)
    warm_up_graph_keys: 4096    # with warm_up, on a GPU: the CUDA graphs of every batch bucket up to
                                # scheduler.max_batch_size and every context bucket up to this many
                                # keys captured before the workers serve; 0: each at its first
                                # step (LAMINA_WARM_UP_GRAPH_KEYS)
    fork_services: true         # lamina up forks its services (on Linux) from one process that imported
                                # their modules once (seconds of CPU less per service start and
                                # restart); false: each starts a fresh interpreter (LAMINA_FORK_SERVICES)
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lamina.services.addresses import WILDCARD_HOSTS, advertised_host

TRANSPORTS = ("tcp", "ucx", "shm", "cuda_ipc")
PARTITIONS = ("request", "head")
POLICIES = ("fcfs", "fpf", "relaxed_fpf")
WEIGHT_CHOICES = ("float32", "q8_0", "q4", "as_file")  # lamina.model.packing.WEIGHT_CHOICES (tested equal)
KV_QUANT_CHOICES = ("none", "q4")  # lamina.model.kv_quant.KV_QUANT_CHOICES (tested equal)
PIPELINE_MODES = ("fixed", "rotational")
LAYOUTS = ("disaggregated", "colocated")
PREFILL_ROUTINGS = ("prefix", "round_robin")  # lamina.services.scheduler.prefill_routing
PEER_FETCH_MODES = ("auto", "always", "off")  # lamina.services.scheduler.prefix_fetch_policy (tested equal)


# Dtypes a model or attention worker computes in (torch's names;
# lamina.model.placement.COMPUTE_DTYPES, tested equal).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# What a service's `dtype` may say: one of those, or auto (the default): float32 on the
# CPU (the packed kernels' and the exactness checks'), bfloat16 on a GPU (half the bytes
# a decode step reads, as vLLM and SGLang serve by default).
DTYPE_SETTINGS = ("auto", *COMPUTE_DTYPES)


def resolve_dtype(dtype: str, device: str) -> str:
    """A `*.dtype` setting as the dtype computed in on `device`: auto is float32 on the
    CPU and bfloat16 elsewhere; any other setting is itself."""
    if dtype != "auto":
        return dtype
    return "float32" if device.split(":")[0] == "cpu" else "bfloat16"


class _Computes:
    """A section of a service that computes on `device` in `dtype` (a setting)."""

    device: str
    dtype: str

    @property
    def compute_dtype(self) -> str:
        """The dtype it computes in: `dtype`, auto resolved for `device` (resolve_dtype)."""
        return resolve_dtype(self.dtype, self.device)


def _is_device(name: str) -> bool:
    """cpu, cuda or cuda:N (a torch device name this configuration accepts)."""
    return name in ("cpu", "cuda") or (name.startswith("cuda:") and name[5:].isdigit())


def canonical_device(name: str) -> str:
    """A device setting as one name per device: a plain `cuda` is cuda:0, the device a
    service computes on when it names no index."""
    return "cuda:0" if name == "cuda" else name


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the setting."""


@dataclass(frozen=True)
class GatewaySection:
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 256
    served_model_name: str | None = None
    # Without api_key the gateway listens only on a loopback host, unless this is set.
    insecure: bool = False


# scheduler.max_batch_size auto (0): sequences decoding at once with the model workers on
# the CPU, and on a GPU (the largest batch bucket its CUDA graphs capture).
CPU_MAX_BATCH = 64
GPU_MAX_BATCH = 256


@dataclass(frozen=True)
class SchedulerSection:
    # Sequences decoding at once; 0 (auto): CPU_MAX_BATCH with the model workers on the CPU,
    # GPU_MAX_BATCH on a GPU, set when the configuration is read.
    max_batch_size: int = 0
    max_queue: int = 256
    policy: str = "fcfs"
    # A prefilled request whose model worker decodes nothing waits up to this long for the
    # requests prefilling on that host, and they join together (lamina.services.scheduler.join_hold);
    # 0: every request joins at once.
    join_hold_ms: float = 5000.0


@dataclass(frozen=True)
class ModelWorkerSection(_Computes):
    threads: int = 1
    workers: int = 1  # model-slice worker processes; the scheduler spreads sequences over them
    # Where the slices and sampling compute (cpu, cuda, cuda:N) and in which dtype: packed
    # weights run on CPU kernels in float32, so elsewhere (or in another dtype) the
    # linears are plain float32 or cast to `dtype` (auto: float32 on the CPU, bfloat16 on
    # a GPU; `compute_dtype` says which).
    device: str = "cpu"
    dtype: str = "auto"
    # On a GPU, each decode slice captured as a CUDA graph per batch-size bucket and
    # replayed (model/slice_graphs.py); false: every slice runs eagerly.
    cuda_graphs: bool = True
    # With cuda_graphs, colocated (layout colocated) on the GPU of its attention core's
    # paged kernel: each decode step captured whole, every layer's attention included, per
    # batch and context bucket (model/step_graphs.py); false: the slices' graphs only.
    step_graphs: bool = True


@dataclass(frozen=True)
class PipelineSection:
    micro_batches: int = 2  # micro-batches in flight per model worker (1: no staggering; colocated: always 1)
    min_micro_batch: int = 16  # fewer micro-batches while they would hold fewer sequences than this
    q_early: bool = False  # send Q before K, V and combine partial attention by log-sum-exp
    # fixed: each model worker steps its own sequences in `micro_batches` micro-batches.
    # rotational: one model worker steps every sequence in M + 1 micro-batches (M model
    # workers) and runs each slice on whichever of the M workers is free (lamina.services.model.rotation).
    mode: str = "fixed"


@dataclass(frozen=True)
class PrefillSection(_Computes):
    workers: int = 1  # prefill worker processes (prefill-0..P-1), each with its own prefix cache
    # At most this many compute threads a forward (0: model_worker.threads); each forward
    # takes the host's cores that other processes' threads leave (services/prefill/free_cores.py).
    threads: int = 0
    # Where the prefill workers compute and their prefix cache's device tier lives: cpu, or
    # cuda / cuda:N (the host tier is then pinned CPU memory; weights float32, since the
    # packed ones run on CPU kernels). KV goes to the attention workers from CPU memory.
    device: str = "cpu"
    # The dtype of their weights, activations and the KV they send and cache (auto |
    # float32 | bfloat16 | float16; auto: float32 on the CPU, bfloat16 on a GPU); another
    # than float32 on the CPU needs weights: float32.
    dtype: str = "auto"
    cache_block_tokens: int = 16  # prefix-cache block size (tokens)
    cache_device_bytes: int = 256 << 20  # 0 disables the prefix cache
    cache_host_bytes: int = 512 << 20
    cache_disk_bytes: int = 0  # > 0 needs cache_dir
    cache_dir: str | None = None
    cache_eviction: str = "lru"  # lru | fifo | random
    max_batch_tokens: int = 2048  # prompts waiting together run as one forward up to this many tokens
    # A prompt computes at most this many of its tokens a forward, its KV kept in the worker
    # between its forwards, so prompts queued behind a long one join its next forward
    # instead of waiting for all of it (services/prefill/chunking.py). 0: auto, 512 on a
    # CPU, 2,048 on a GPU. A chunk past max_batch_tokens leaves no room beside it.
    chunk_tokens: int = 0
    batch_window_ms: float = 5.0  # how long a batch waits for more prompts before its forward
    # While prompts keep arriving (each within batch_window_ms of the last), a batch waits
    # for them up to this long in all, so that a burst of requests shares one forward.
    batch_window_max_ms: float = 50.0
    # Which prefill worker gets a prompt (lamina.services.scheduler.prefill_routing): prefix: among the
    # workers queued at most routing_max_queue_gap_tokens more than the least queued one, the
    # one whose cached prefix of it (looked up in the metadata store) minus routing_load_weight
    # x its queued tokens is largest; a prefix no worker holds routing_min_gain_tokens more of
    # than every other live worker counts for nothing (the worker sent the least work lately
    # takes the prompt).
    # round_robin: each in turn.
    routing: str = "prefix"
    routing_load_weight: float = 0.0
    routing_min_gain_tokens: int = 32
    routing_max_queue_gap_tokens: int = 4096
    # Host and disk tiers hold group-wise 4-bit blocks (lamina.kvstore.quant); device stays full precision.
    cache_quantize_4bit: bool = False
    cache_quant_group_size: int = 64
    # A prompt's worker pulls the longer prefix another worker caches over the data plane
    # (lamina.services.prefill.prefix_peers) instead of recomputing it: auto when the transfer is expected
    # to be faster (lamina.services.scheduler.prefix_fetch_policy), always, or off.
    peer_fetch: str = "auto"
    # The bandwidth assumed for a fetch until fetches have been measured (GB/s).
    peer_fetch_prior_gbps: float = 1.0
    # While a forward computes, the cached prefixes of the prompts waiting in the worker's
    # queue (the next 8) move up from host and disk to the device tier, and stay there
    # until their prompt has taken them (lamina.kvstore.prefetch); false: a prefix moves
    # up only when its own prefill asks for it.
    prefetch: bool = True

    def worker_cache_dir(self, index: int) -> str | None:
        """Prefill worker `index`'s disk tier: cache_dir itself with one worker, else a
        directory of its own in it (a disk tier deletes files it did not index)."""
        if self.cache_dir is None or self.workers == 1:
            return self.cache_dir
        return os.path.join(self.cache_dir, f"prefill-{index}")


@dataclass(frozen=True)
class AttentionSection(_Computes):
    workers: int = 2  # started with, and waited for, by the stack
    # The most the pool takes: workers with indexes workers .. max_workers - 1 join the
    # running stack when they register and leave when they deregister (request-level
    # partitioning only). 0: the same as workers (a fixed pool).
    max_workers: int = 0
    threads: int = 1
    # KV bytes each attention core holds; 0 (auto): 1 GiB on the CPU, on a GPU what the
    # stack's processes there leave of gpu_memory_utilization of its memory
    # (services/kv_budget.py).
    kv_capacity_bytes: int = 0
    gpu_memory_utilization: float = 0.9
    kv_quant: str = "none"  # q4: the KV pools hold 4-bit group-wise rows (lamina.model.kv_quant)
    # Where the KV slab lives and attention computes, and the dtype of its KV: the native
    # kernel on cpu/float32, torch's operators elsewhere (lamina.model.device_attention);
    # auto: float32 on the CPU, bfloat16 on a GPU.
    device: str = "cpu"
    dtype: str = "auto"
    # On a GPU, each decode frame's attention (the new K, V written, the paged kernel and
    # its combine) replayed as a CUDA graph per layer, batch and context bucket
    # (model/attend_graphs.py); false: launched eagerly.
    cuda_graphs: bool = True

    @property
    def pool_limit(self) -> int:
        """The most attention workers the pool takes (indexes below it)."""
        return max(self.workers, self.max_workers)


@dataclass(frozen=True)
class DataPlaneSection:
    """Transport settings of every data-plane connection (transports.TransportConfig)."""

    # Receivers spin this long before parking (adaptive; 0: never). null: 50 where the
    # host has a core for each data-plane process of the stack, else 0 (see data_plane_processes).
    busy_poll_us: float | None = None
    checksum_payloads: bool = False  # crc32 of payloads too (headers always are)
    shm_ring_bytes: int = 16 << 20  # per direction, shm transport
    cuda_ipc_ring_bytes: int = 64 << 20  # per direction, device memory of the cuda_ipc transport
    # cuda_ipc: a frame sent before its copies are done, the receiver's stream waiting on
    # the sender's interprocess event (false: the sender's host waits for its copies first)
    cuda_ipc_device_order: bool = False
    ucx_progress_mode: str = "blocking"  # blocking | thread | polling | thread-polling
    ucx_tls: str | None = None  # UCX_TLS for the ucx transport (null: UCX decides)
    ucx_device_memory: bool = True  # ucx: CUDA tensors from device memory where UCX can (false: staged)
    native_frames: bool = True  # native frame codec where built (false: the Python codec)


@dataclass(frozen=True)
class PortsSection:
    """Ports of one service process; 0: ephemeral. Fixed ports are for one service per
    host or container (health probes and Prometheus need to know where to look)."""

    grpc: int = 0
    metrics: int = 0


@dataclass(frozen=True)
class DeadlinesSection:
    """How long any wait on a peer may last before the waiter gives up (seconds; a rate in
    tokens a second where the name ends in _per_s)."""

    reply_s: float = 10.0  # an attention worker's reply to one layer, or its acknowledgement of prompt KV
    rpc_s: float = 30.0  # a unary gRPC call between services (Free, Stats; a prefill's: below)
    # A prefill call may take rpc_s more than the prompt tokens queued at its worker (its
    # own among them) take at the worker's published forward rate slowed 8 times, or at this
    # rate before it published one (services/scheduler/prefill_deadline.py).
    prefill_tokens_per_s: float = 50.0
    step_s: float = 30.0  # a model worker holding sequences that sends no step result for this long is lost
    health_s: float = 2.0  # a liveness probe of a peer during recovery
    recovery_s: float = 120.0  # a request waiting for its workers to be back before it ends with an error
    # A service starting while its Redis does not answer retries this long, then exits non-zero
    # (compose and Kubernetes may start Redis after the services).
    startup_s: float = 60.0
    # KV on an attention worker that no request holds (a Free that never reached it, a
    # prompt's KV a partition held back until after its request's Free) is freed once
    # untouched this long (the scheduler's reconciliation, every half service TTL).
    kv_reclaim_s: float = 60.0


@dataclass(frozen=True)
class StackConfig:
    model: str | None = None
    weights: str = "as_file"  # how model and prefill workers hold the linears (lamina.model.packing)
    redis_url: str | None = None
    namespace: str = "lamina"
    # colocated: each model worker holds one attention worker's KV and attends in its own
    # process (services/model/model_service.py); the layout sets attention.workers.
    layout: str = "disaggregated"
    transport: str = "tcp"
    partition: str = "request"
    # Shared secret of the stack's services: gRPC calls carry it, data-plane handshakes
    # prove it (services/auth.py, transports/handshake.py). None: not authenticated.
    cluster_token: str | None = None
    # Services other than the gateway refuse to serve on a host other than loopback without
    # cluster_token, unless this is set (services/auth.py).
    insecure: bool = False
    host: str = "127.0.0.1"
    advertise_host: str | None = None  # what peers are given instead of host (services/addresses.py)
    ports: PortsSection = field(default_factory=PortsSection)
    gateway: GatewaySection = field(default_factory=GatewaySection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    prefill: PrefillSection = field(default_factory=PrefillSection)
    model_worker: ModelWorkerSection = field(default_factory=ModelWorkerSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    attention: AttentionSection = field(default_factory=AttentionSection)
    data_plane: DataPlaneSection = field(default_factory=DataPlaneSection)
    deadlines: DeadlinesSection = field(default_factory=DeadlinesSection)
    # Before it registers, each prefill and model worker runs one forward of a short made-up
    # sequence and the gateway its tokenizer's first encodes (services/warm_up.py), so the
    # first request does not pay for what is started lazily.
    warm_up: bool = True
    # With warm_up, on a GPU, the model and attention workers capture their CUDA graphs
    # before they register: every batch bucket up to scheduler.max_batch_size and, for
    # graphs that attend, every context bucket of at most this many keys (and at most the
    # model's context); 0: none (each is captured at the first step that needs it, which
    # then waits for it).
    warm_up_graph_keys: int = 4096
    # lamina up forks its services (on Linux) from one process that has imported their
    # modules (torch, the services' own) once, rather than starting each in a fresh interpreter,
    # which spends seconds of CPU on those imports at every start and restart
    # (services/launch/forker.py). False: fresh interpreters.
    fork_services: bool = True

    def __post_init__(self) -> None:
        self._check_layout()
        if self.scheduler.max_batch_size == 0:
            batch = CPU_MAX_BATCH if self.model_worker.device == "cpu" else GPU_MAX_BATCH
            object.__setattr__(self, "scheduler", dataclasses.replace(self.scheduler, max_batch_size=batch))
        _check(self.weights in WEIGHT_CHOICES, "weights", f"must be one of {', '.join(WEIGHT_CHOICES)}",
               self.weights)
        _check(self.transport in TRANSPORTS, "transport", f"must be one of {', '.join(TRANSPORTS)}", self.transport)
        _check(self.partition in PARTITIONS, "partition", f"must be one of {', '.join(PARTITIONS)}", self.partition)
        _check(self.pipeline.mode in PIPELINE_MODES, "pipeline.mode", f"must be one of {', '.join(PIPELINE_MODES)}",
               self.pipeline.mode)
        _check(self.attention.kv_quant in KV_QUANT_CHOICES, "attention.kv_quant",
               f"must be one of {', '.join(KV_QUANT_CHOICES)}", self.attention.kv_quant)
        _check(self.prefill.routing in PREFILL_ROUTINGS, "prefill.routing",
               f"must be one of {', '.join(PREFILL_ROUTINGS)}", self.prefill.routing)
        _check(isinstance(self.prefill.routing_load_weight, (int, float)) and self.prefill.routing_load_weight >= 0,
               "prefill.routing_load_weight", "must be a non-negative number", self.prefill.routing_load_weight)
        for name, device in (("prefill.device", self.prefill.device), ("model_worker.device", self.model_worker.device),
                             ("attention.device", self.attention.device)):
            _check(isinstance(device, str) and _is_device(device), name, "must be cpu, cuda or cuda:N", device)
        for name, dtype in (("model_worker.dtype", self.model_worker.dtype), ("attention.dtype", self.attention.dtype),
                            ("prefill.dtype", self.prefill.dtype)):
            _check(dtype in DTYPE_SETTINGS, name, f"must be one of {', '.join(DTYPE_SETTINGS)}", dtype)
        for name, section in (("model_worker", self.model_worker), ("prefill", self.prefill)):
            _check(section.compute_dtype == "float32" or self.weights == "float32" or section.device != "cpu",
                   "weights",
                   f"must be float32 when {name}.dtype is not float32 on the CPU (packed weights compute in float32)",
                   self.weights)
        _check(self.pipeline.mode == "fixed" or self.model_worker.device == "cpu", "pipeline.mode",
               "must be fixed when model_worker.device is not cpu (rotational slices reach peers as host "
               "tensors, which only a CPU worker computes on as they arrive)", self.pipeline.mode)
        _check(self.attention.kv_quant == "none" or (self.attention.device == "cpu"
                                                     and self.attention.compute_dtype == "float32"),
               "attention.kv_quant", "must be none unless attention.device is cpu and attention.dtype float32 "
               "(4-bit KV rows are decoded by the CPU kernel)", self.attention.kv_quant)
        _check(isinstance(self.prefill.routing_min_gain_tokens, int) and self.prefill.routing_min_gain_tokens >= 0,
               "prefill.routing_min_gain_tokens", "must be a non-negative integer",
               self.prefill.routing_min_gain_tokens)
        _check(isinstance(self.prefill.routing_max_queue_gap_tokens, int)
               and self.prefill.routing_max_queue_gap_tokens >= 0, "prefill.routing_max_queue_gap_tokens",
               "must be a non-negative integer", self.prefill.routing_max_queue_gap_tokens)
        _check(self.scheduler.policy in POLICIES, "scheduler.policy", f"must be one of {', '.join(POLICIES)}",
               self.scheduler.policy)
        _check(0 <= self.gateway.port < 65536, "gateway.port", "must be a TCP port", self.gateway.port)
        for name, value in (("ports.grpc", self.ports.grpc), ("ports.metrics", self.ports.metrics)):
            _check(isinstance(value, int) and 0 <= value < 65536, name, "must be a TCP port (0: any)", value)
        _check(isinstance(self.host, str), "host", "must be a host name or address", self.host)
        _check(self.advertise_host is None or (isinstance(self.advertise_host, str)
                                               and self.advertise_host not in WILDCARD_HOSTS),
               "advertise_host", "must be an address peers can reach, not a wildcard", self.advertise_host)
        for name, value in (("gateway.max_queue", self.gateway.max_queue),
                            ("scheduler.max_batch_size", self.scheduler.max_batch_size),
                            ("scheduler.max_queue", self.scheduler.max_queue),
                            ("prefill.workers", self.prefill.workers),
                            ("prefill.max_batch_tokens", self.prefill.max_batch_tokens),
                            ("model_worker.threads", self.model_worker.threads),
                            ("model_worker.workers", self.model_worker.workers),
                            ("pipeline.micro_batches", self.pipeline.micro_batches),
                            ("pipeline.min_micro_batch", self.pipeline.min_micro_batch),
                            ("attention.workers", self.attention.workers),
                            ("attention.threads", self.attention.threads),
                            ("prefill.cache_block_tokens", self.prefill.cache_block_tokens)):
            _check(isinstance(value, int) and value > 0, name, "must be a positive integer", value)
        utilization = self.attention.gpu_memory_utilization
        _check(isinstance(utilization, (int, float)) and 0 < utilization <= 1, "attention.gpu_memory_utilization",
               "must be above 0 and at most 1", utilization)
        for name, value in (("attention.kv_capacity_bytes", self.attention.kv_capacity_bytes),
                            ("prefill.threads", self.prefill.threads),
                            ("prefill.chunk_tokens", self.prefill.chunk_tokens),
                            ("prefill.cache_device_bytes", self.prefill.cache_device_bytes),
                            ("prefill.cache_host_bytes", self.prefill.cache_host_bytes),
                            ("prefill.cache_disk_bytes", self.prefill.cache_disk_bytes),
                            ("warm_up_graph_keys", self.warm_up_graph_keys)):
            _check(isinstance(value, int) and value >= 0, name, "must be a non-negative integer", value)
        for name, wait, most in (("scheduler.join_hold_ms", self.scheduler.join_hold_ms, 60_000),
                                 ("prefill.batch_window_ms", self.prefill.batch_window_ms, 1000),
                                 ("prefill.batch_window_max_ms", self.prefill.batch_window_max_ms, 1000)):
            _check(isinstance(wait, (int, float)) and 0 <= wait <= most, name,
                   f"must be a number of milliseconds in 0..{most}", wait)
        for f in dataclasses.fields(DeadlinesSection):
            value = getattr(self.deadlines, f.name)
            unit = "tokens a second" if f.name.endswith("_per_s") else "seconds"
            _check(isinstance(value, (int, float)) and value > 0, f"deadlines.{f.name}",
                   f"must be a positive number of {unit}", value)
        _check(self.prefill.peer_fetch in PEER_FETCH_MODES, "prefill.peer_fetch",
               f"must be one of {', '.join(PEER_FETCH_MODES)}", self.prefill.peer_fetch)
        prior_gbps = self.prefill.peer_fetch_prior_gbps
        _check(isinstance(prior_gbps, (int, float)) and prior_gbps > 0, "prefill.peer_fetch_prior_gbps",
               "must be a positive number", prior_gbps)
        _check(isinstance(self.prefill.cache_quantize_4bit, bool), "prefill.cache_quantize_4bit",
               "must be true or false", self.prefill.cache_quantize_4bit)
        _check(isinstance(self.prefill.prefetch, bool), "prefill.prefetch", "must be true or false",
               self.prefill.prefetch)
        _check(isinstance(self.prefill.cache_quant_group_size, int) and self.prefill.cache_quant_group_size > 0
               and self.prefill.cache_quant_group_size % 2 == 0, "prefill.cache_quant_group_size",
               "must be a positive even integer", self.prefill.cache_quant_group_size)
        _check(self.prefill.cache_eviction in ("lru", "fifo", "random"), "prefill.cache_eviction",
               "must be lru, fifo or random", self.prefill.cache_eviction)
        _check(not self.prefill.cache_disk_bytes or bool(self.prefill.cache_dir), "prefill.cache_dir",
               "must be set when prefill.cache_disk_bytes > 0", self.prefill.cache_dir)
        max_workers = self.attention.max_workers
        _check(isinstance(max_workers, int) and (max_workers == 0 or max_workers >= self.attention.workers),
               "attention.max_workers", f"must be 0 (a fixed pool) or at least attention.workers "
               f"({self.attention.workers})", self.attention.max_workers)
        _check(self.partition != "head" or self.attention.pool_limit == self.attention.workers,
               "attention.max_workers", "must be 0 under head-level partitioning (every worker holds a share of "
               "every request's heads, so the pool cannot grow)", self.attention.max_workers)
        try:
            self.transport_config()
        except ValueError as exc:
            raise ConfigError(f"configuration: data_plane: {exc}") from None

    def _check_layout(self) -> None:
        """Colocated: one attention worker in each model worker's process, so their counts
        are one number (`model_worker.workers`, set here over `attention.workers`), and
        what needs attention workers apart (head shares, rotation, a growing pool) is refused."""
        _check(self.layout in LAYOUTS, "layout", f"must be one of {', '.join(LAYOUTS)}", self.layout)
        if self.layout != "colocated":
            return
        _check(self.partition == "request", "partition", "must be request under layout colocated (each model "
               "worker holds its own sequences' whole KV)", self.partition)
        _check(self.pipeline.mode == "fixed", "pipeline.mode", "must be fixed under layout colocated (a model "
               "worker attends only its own sequences)", self.pipeline.mode)
        _check(self.attention.max_workers == 0, "attention.max_workers", "must be 0 under layout colocated "
               "(the attention workers are the model workers)", self.attention.max_workers)
        workers = self.model_worker.workers
        if isinstance(workers, int) and self.attention.workers != workers:
            object.__setattr__(self, "attention", dataclasses.replace(self.attention, workers=workers))

    @property
    def colocated(self) -> bool:
        return self.layout == "colocated"

    def transport_config(self):
        """The ``transports.TransportConfig`` of every data-plane connection."""
        from lamina.transports import TransportConfig  # torch-free: the package imports its frames on first use
        from lamina.transports.polling import default_budget_us
        dp = self.data_plane
        busy_poll = dp.busy_poll_us
        if busy_poll is None:
            busy_poll = default_budget_us(self.data_plane_processes)
        return TransportConfig(auth_token=self.cluster_token, busy_poll_us=busy_poll,
                               checksum_payloads=dp.checksum_payloads, shm_ring_bytes=dp.shm_ring_bytes,
                               cuda_ipc_ring_bytes=dp.cuda_ipc_ring_bytes,
                               cuda_ipc_device_order=dp.cuda_ipc_device_order,
                               ucx_progress_mode=dp.ucx_progress_mode, ucx_tls=dp.ucx_tls,
                               ucx_device_memory=dp.ucx_device_memory, native_frames=dp.native_frames)

    @property
    def advertised_host(self) -> str:
        """The host registered for this service's endpoints (services/addresses.py)."""
        return advertised_host(self.host, self.advertise_host)

    @property
    def rotational(self) -> bool:
        return self.pipeline.mode == "rotational"

    @property
    def prefill_threads(self) -> int:
        """The most compute threads a prefill forward takes: prefill.threads, or where it
        is 0 the model workers' (model_worker.threads)."""
        return self.prefill.threads or self.model_worker.threads

    @property
    def decode_micro_batches(self) -> int:
        """Micro-batches a decoding model worker keeps: M + 1 when rotational (M model
        workers, so that one micro-batch is at its attention while each worker computes
        another's slice); 1 when colocated, where a step computes its attention itself and
        there is no wait for other micro-batches to fill, while every micro-batch's step
        reads all the weights again (on 2 cores, 48 sequences a step: 7-16% more tokens/s
        as one batch than as two of 24); else `pipeline.micro_batches`."""
        if self.rotational:
            return self.model_worker.workers + 1
        return 1 if self.colocated else self.pipeline.micro_batches

    @property
    def data_plane_processes(self) -> int:
        """Processes that exchange frames and compute between them: attention workers,
        model workers and prefill workers (all on one host under `lamina up`)."""
        attention = 0 if self.colocated else self.attention.workers
        return attention + self.model_worker.workers + self.prefill.workers

    def data_address(self, service_id: str) -> str:
        """Where a service listens for data-plane frames (port 0: the system picks)."""
        if self.transport in ("shm", "cuda_ipc"):  # one host: named endpoints, no ports
            return f"{self.transport}://{self.namespace}-{service_id}-{os.getpid()}"
        return f"{self.transport}://{self.host}:0"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"configuration: {name} {rule} (got {value!r})")


_SECTIONS = {
    "gateway": GatewaySection, "scheduler": SchedulerSection, "prefill": PrefillSection,
    "model_worker": ModelWorkerSection, "pipeline": PipelineSection, "attention": AttentionSection,
    "data_plane": DataPlaneSection, "deadlines": DeadlinesSection, "ports": PortsSection,
}

# Environment variables and the settings they override.
ENV_OVERRIDES = {
    "REDIS_URL": "redis_url",
    "LAMINA_MODEL": "model",
    "LAMINA_WEIGHTS": "weights",
    "LAMINA_TRANSPORT": "transport",
    "LAMINA_LAYOUT": "layout",
    "LAMINA_PARTITION": "partition",
    "LAMINA_CLUSTER_TOKEN": "cluster_token",
    "LAMINA_INSECURE": "insecure",
    "LAMINA_NAMESPACE": "namespace",
    "LAMINA_API_KEY": "gateway.api_key",
    "LAMINA_PORT": "gateway.port",
    "LAMINA_BUSY_POLL_US": "data_plane.busy_poll_us",
    "LAMINA_CUDA_IPC_DEVICE_ORDER": "data_plane.cuda_ipc_device_order",
    "LAMINA_MICRO_BATCHES": "pipeline.micro_batches",
    "LAMINA_Q_EARLY": "pipeline.q_early",
    "LAMINA_KV_QUANT": "attention.kv_quant",
    "LAMINA_PIPELINE": "pipeline.mode",
    "LAMINA_PREFILL_WORKERS": "prefill.workers",
    "LAMINA_ATTENTION_WORKERS": "attention.workers",
    "LAMINA_ATTENTION_MAX_WORKERS": "attention.max_workers",
    "LAMINA_MODEL_THREADS": "model_worker.threads",
    "LAMINA_PREFILL_ROUTING": "prefill.routing",
    "LAMINA_PREFILL_DEVICE": "prefill.device",
    "LAMINA_PREFILL_DTYPE": "prefill.dtype",
    "LAMINA_MODEL_DEVICE": "model_worker.device",
    "LAMINA_MODEL_DTYPE": "model_worker.dtype",
    "LAMINA_MODEL_CUDA_GRAPHS": "model_worker.cuda_graphs",
    "LAMINA_MODEL_STEP_GRAPHS": "model_worker.step_graphs",
    "LAMINA_ATTENTION_DEVICE": "attention.device",
    "LAMINA_ATTENTION_CUDA_GRAPHS": "attention.cuda_graphs",
    "LAMINA_ATTENTION_DTYPE": "attention.dtype",
    "LAMINA_GPU_MEMORY_UTILIZATION": "attention.gpu_memory_utilization",
    "LAMINA_PEER_FETCH": "prefill.peer_fetch",
    "LAMINA_PREFILL_PREFETCH": "prefill.prefetch",
    "LAMINA_PREFILL_CHUNK_TOKENS": "prefill.chunk_tokens",
    "LAMINA_HOST": "host",
    "LAMINA_ADVERTISE_HOST": "advertise_host",
    "LAMINA_GRPC_PORT": "ports.grpc",
    "LAMINA_METRICS_PORT": "ports.metrics",
    "LAMINA_WARM_UP": "warm_up",
    "LAMINA_WARM_UP_GRAPH_KEYS": "warm_up_graph_keys",
    "LAMINA_FORK_SERVICES": "fork_services",
}


def _from_mapping(raw: Mapping[str, Any], source: str) -> StackConfig:
    known = {f.name: f for f in dataclasses.fields(StackConfig)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"{source}: unknown setting(s) {', '.join(unknown)}")
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _SECTIONS:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{source}: {key} must be a mapping")
            cls = _SECTIONS[key]
            fields = {f.name: f for f in dataclasses.fields(cls)}
            bad = sorted(set(value) - set(fields))
            if bad:
                raise ConfigError(f"{source}: unknown setting(s) {', '.join(f'{key}.{b}' for b in bad)}")
            kwargs[key] = cls(**{k: _coerce(f"{key}.{k}", v, fields[k].type) for k, v in value.items()})
        else:  # an environment variable's text too: LAMINA_INSECURE=false is False
            kwargs[key] = _coerce(key, value, known[key].type)
    return StackConfig(**kwargs)


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    ann = str(annotation)
    if value is None:
        return None
    kind = ann.split(" ")[0]
    try:
        if isinstance(value, bool) and kind in ("int", "float"):
            raise ValueError("a boolean")
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "bool":
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            if not isinstance(value, bool):
                raise ValueError("not a boolean")
            return value
        if kind == "str":
            return str(value)
    except (TypeError, ValueError) as exc:
        noun = {"int": "an integer", "float": "a number", "bool": "true or false"}.get(kind, kind)
        raise ConfigError(f"configuration: {name} must be {noun} (got {value!r})") from exc
    return value


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> StackConfig:
    """Read the file (if any), then apply environment and flag overrides ("a.b" keys)."""
    env = os.environ if env is None else env
    raw = _read_file(path)
    source = str(path) if path else "configuration"
    merged = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for var, key in ENV_OVERRIDES.items():
        if env.get(var):
            _set(merged, key, env[var])
    for key, value in (overrides or {}).items():
        if value is not None:
            _set(merged, key, value)
    try:
        return _from_mapping(merged, source)
    except TypeError as exc:
        raise ConfigError(f"{source}: {exc}") from exc


def _read_file(path: str | Path | None) -> dict[str, Any]:
    """The file's mapping as written ({} without a file)."""
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: configuration file not found")
    try:
        text = p.read_text()
        raw = tomllib.loads(text) if p.suffix == ".toml" else (yaml.safe_load(text) or {})
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{p}: not valid {'TOML' if p.suffix == '.toml' else 'YAML'}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping")
    return raw


def set_outside_defaults(path: str | Path | None, keys: Sequence[str], env: Mapping[str, str] | None = None) -> bool:
    """Whether the file at `path` (read once) or the environment sets any of `keys` ("a"
    or "a.b"), so that its value is not the default's."""
    env = os.environ if env is None else env
    if any(env.get(var) for var, key in ENV_OVERRIDES.items() if key in keys):
        return True
    raw = _read_file(path)

    def in_file(dotted: str) -> bool:
        node: Any = raw
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return False
            node = node[part]
        return True

    return any(map(in_file, keys))


def _set(raw: dict[str, Any], dotted: str, value: Any) -> None:
    if "." in dotted:
        section, key = dotted.split(".", 1)
        raw.setdefault(section, {})[key] = value
    else:
        raw[dotted] = value
