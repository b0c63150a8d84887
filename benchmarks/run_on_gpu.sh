#!/bin/bash
# One lease of a GPU machine, planned ahead: its time is short (minutes), so every step
# has its own time cap and writes its output under $OUT as it goes, and a step that
# breaks does not stop the next one.
#
#   bash benchmarks/run_on_gpu.sh tests    # setup, pytest -m gpu, 50 saves: GPU memory flat?
#   bash benchmarks/run_on_gpu.sh bench    # setup, bench_save (CUDA methods), bench_ranks
#   bash benchmarks/run_on_gpu.sh ranks    # setup, bench_ranks alone (RANKS, REPEATS)
#   bash benchmarks/run_on_gpu.sh extra    # expandable segments; two trainers on one GPU
#
# The machine has torch but not our other dependencies, and reaches no package index:
# the wheels for its Python travel in .whl/ (benchmarks/README.md says how to get them).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
STEP=${1:-tests}
export PYTHONUNBUFFERED=1

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi

facts() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import sys, torch, zmq; print('python', sys.version.split()[0], '| torch',
torch.__version__, '| CUDA', torch.version.cuda, '| cuda available', torch.cuda.is_available(),
'| pyzmq', zmq.__version__)"
    echo "yama ptrace_scope: $(cat /proc/sys/kernel/yama/ptrace_scope 2>&1)"
    ls /proc/driver/nvidia/version /dev/nvidiactl 2>&1
    echo "cores $(nproc); $(free -g | sed -n 2p)"; df -h /tmp /dev/shm | tail -2; uname -r
}

# step NAME CAP_S CMD...: run one step under a time cap, its output to $OUT/NAME.log
step() {
    local name=$1 cap=$2; shift 2
    echo "=== $name (cap ${cap}s) $(date +%T)"
    timeout -k 10 "$cap" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc $(date +%T)"
    tail -n 25 "$OUT/$name.log"
}

case "$STEP" in
tests)
    facts 2>&1 | tee "$OUT/facts.txt"
    timeout_flag=""
    python3 -c "import pytest_timeout" 2>/dev/null && timeout_flag="--timeout 120"
    step pytest_gpu "${CAP_TESTS:-200}" python3 -m pytest -m gpu -v -p no:cacheprovider \
        $timeout_flag -rfEs tests/gpu
    # DAEMON_PROFILE=1: the daemon profiles itself too (CKPTD_CUDA_PROFILE; its time is not
    # in the trainer's profile). Python 3.12's profiler sees every thread of the daemon and
    # slows it down, so the figures of such a run compare only with another profiled one.
    CKPTD_CUDA_PROFILE="${DAEMON_PROFILE:+$OUT/cuda_profile}" step gpu_saves "${CAP_SAVES:-150}" python3 benchmarks/bench_gpu_saves.py --size-gib 1 --profile \
        --saves "${SAVES:-50}" --workdir /dev/shm --out "$OUT/RESULTS_GPU_saves.md"
    ;;
bench)
    facts >"$OUT/facts_bench.txt" 2>&1
    step bench_save "${CAP_SAVE:-240}" python3 benchmarks/bench_save.py --size-gib 2 \
        --workload training --no-cpu --repeats 3 --workdir /dev/shm \
        --only "pinned,ckptd torchasynccheckpoint,shm stager reused,enable_cache" \
        --out "$OUT/RESULTS_GPU_save.md"
    step bench_ranks "${CAP_RANKS:-120}" python3 benchmarks/bench_ranks.py --size-gib 2 \
        --ranks 1,2,4,8 --repeats 3 --workdir /dev/shm \
        --out "$OUT/RESULTS_GPU_ranks.md"
    ;;
ranks)
    step bench_ranks "${CAP_RANKS:-120}" python3 benchmarks/bench_ranks.py --size-gib 2 \
        --ranks "${RANKS:-1,2,4,8}" --repeats "${REPEATS:-3}" --workdir /dev/shm \
        --out "$OUT/RESULTS_GPU_ranks.md"
    ;;
extra)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step gpu_saves_expandable \
        "${CAP_SAVES:-150}" python3 benchmarks/bench_gpu_saves.py --size-gib 1 \
        --workdir /dev/shm --out "$OUT/RESULTS_GPU_saves_expandable.md"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step bench_ranks_expandable \
        "${CAP_RANKS:-90}" python3 benchmarks/bench_ranks.py --size-gib 2 --ranks 1,2 \
        --repeats 3 --workdir /dev/shm --out "$OUT/RESULTS_GPU_ranks_expandable.md"
    ;;
*)
    echo "usage: $0 tests|bench|ranks|extra" >&2; exit 2 ;;
esac
