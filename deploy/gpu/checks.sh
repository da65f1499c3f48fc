#!/usr/bin/env bash
# A GPU machine's checks in one go, each result written to OUT as it is made (each step's
# end, with the seconds since the start, also to OUT/steps.log), in this order: nvidia-smi,
# the Python and package versions and the install (deploy/gpu/install_offline.sh); the CUDA unit tests
# (those whose ids name cuda: the paged and buffer attention kernels against the native
# kernel and SDPA, the attention core on the GPU, the sampler on the GPU against the CPU,
# the engine and the model and attention workers against transformers, micro-batches on
# their own streams, decode slices replayed as CUDA graphs, cuda_ipc in one process and
# to a child process, the prefix cache's GPU tier); bench/gpu_decode.py on the models and
# shapes given; `lamina profile --device cuda` and the planner's predictions of the
# benchmark's points from it; the stack on the GPU against transformers
# (tests/e2e/test_stack_cuda.py, seven stacks); the conformance suite over cuda_ipc.
# For a machine lent for minutes: run it once with a time limit, then read OUT (what
# finished is there, whatever was cut off).
#
#   deploy/gpu/checks.sh OUT [WHEELS] [-- BENCH ARGS...]
#   e.g. deploy/gpu/checks.sh "$OUT" .whl -- --models random:llama-3.2-1b:bfloat16 --batches 1,16,64 --contexts 512,2048
set -uo pipefail
out=${1:?usage: deploy/gpu/checks.sh OUT [WHEELS] [-- BENCH ARGS...]}
shift
wheels=.whl
if [ $# -gt 0 ] && [ "$1" != "--" ]; then wheels=$1; shift; fi
[ "${1:-}" = "--" ] && shift
mkdir -p "$out"
python=${PYTHON:-python3}
site=/tmp/lamina-site
# Each step's end, with the seconds since the start, to the terminal and OUT/steps.log.
note() { echo "$* (at ${SECONDS} s)" | tee -a "$out/steps.log"; }
{ date; nvidia-smi; "$python" --version; "$python" -m pip list 2>/dev/null; } > "$out/device.txt" 2>&1
if ! deploy/gpu/install_offline.sh "$wheels" "$site" > "$out/install.log" 2>&1; then
    note "install failed: $out/install.log"; tail -20 "$out/install.log"; exit 1
fi
note "installed"
export PYTHONPATH=$site
# Quickest and most telling first: a machine lent for minutes may be taken back mid-way,
# and what is in OUT by then comes back.
"$python" -P -m pytest -q -rs --durations=0 -k cuda --timeout 600 \
    tests/model/test_paged_decode.py tests/model/test_sampling_sampler.py tests/model/test_kv_attention.py \
    tests/model/test_engine_devices.py tests/services/test_attention_core.py tests/services/test_devices.py \
    tests/services/test_rotation.py tests/transports/test_cuda_ipc.py tests/kvstore/test_kv_prefix_cache_cuda.py \
    > "$out/tests.log" 2>&1
note "tests: exit $? ($(tail -1 "$out/tests.log"))"
"$python" bench/gpu_decode.py --out "$out/rows.jsonl" "$@" > "$out/bench.log" 2>&1
note "bench: exit $?"
tail -5 "$out/bench.log"
# The device's profile, then the planner's predictions of the benchmark's engine points from it.
"$python" -m lamina.cli profile --device cuda --quick --out "$out/profile-cuda.json" > "$out/profile.log" 2>&1
note "profile: exit $? ($(tail -1 "$out/profile.log"))"
"$python" bench/planner_validation.py --gpu "$out/rows.jsonl" --profile "$out/profile-cuda.json" \
    > "$out/planner.log" 2>&1
note "planner: exit $? ($(tail -2 "$out/planner.log" | head -1))"
# Whole stacks on the GPU (seven of them), then the conformance suite over cuda_ipc.
"$python" -P -m pytest -q -rs --durations=0 --timeout 900 tests/e2e/test_stack_cuda.py > "$out/e2e.log" 2>&1
note "e2e: exit $? ($(tail -1 "$out/e2e.log"))"
"$python" -P -m pytest -q -rs -k cuda_ipc --timeout 600 tests/transports/test_conformance.py \
    > "$out/conformance.log" 2>&1
note "conformance: exit $? ($(tail -1 "$out/conformance.log"))"
