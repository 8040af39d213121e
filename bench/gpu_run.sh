#!/usr/bin/env bash
# One call on a lent GPU machine (torch and triton preinstalled, the repo uninstalled):
# the environment, the GPU tests, a CUDA fuzz chunk and (with SUITE_SECONDS > 0) the CPU suite on
# that machine's torch, side by side, then bench/gpu.py alone.
#
#     OUT=/tmp/aotc-gpu bash bench/gpu_run.sh [TEST_SECONDS] [BENCH_SECONDS] [SUITE_SECONDS] \
#         [VARIANTS_SECONDS] [FUZZ_PROGRAMS]
#
# VARIANTS_SECONDS > 0 then runs bench/gpu_variants.py (bench/results/gpu_variants.json);
# FUZZ_PROGRAMS (default 25) CUDA fuzz programs in each of four processes, 0 for none.
# Logs and bench/results/gpu.json land in $OUT; every part has its own time limit, so a part that
# hangs or fails still leaves the others' results.
set -u
OUT=${OUT:-/tmp/aotc-gpu}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 AOTC_GPU_CHECK=0 TRITON_INTERPRET=0 AOTC_CACHE=0
T=${1:-120}
B=${2:-300}
S=${3:-0}
V=${4:-0}
F=${5:-25}
PY=${PY:-python3}
{
    nvidia-smi -L
    $PY -c "import sys, torch, triton; print(sys.version); print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
    nproc
} >"$OUT/env.txt" 2>&1
(
    timeout "$T" $PY -m pytest -o addopts="" -p no:cacheprovider -q -n 4 \
        -m "gpu or not (opinfo or slow)" -k "cuda" \
        tests/passes/test_fusion.py tests/passes/test_split_reduction.py tests/e2e/test_triton.py \
        tests/runtime/test_guard_matrix.py \
        >"$OUT/tests.log" 2>&1
    echo "rc=$?" >>"$OUT/tests.log"
) &
[ "$F" -gt 0 ] && (
    for s in 0 1 2 3; do
        timeout $((T - 5)) $PY -m tests.fuzz.campaign --device cuda --modes triton,default,trace \
            --every 1 --progress 5 --programs "$F" --seed $((40100 + s * F)) --out /tmp/aotc-fz$s \
            >/tmp/aotc-fz$s.log 2>&1 &
    done
    wait
    for s in 0 1 2 3; do
        cat /tmp/aotc-fz$s.log /tmp/aotc-fz$s/summary.json /tmp/aotc-fz$s/*.py 2>/dev/null
    done >"$OUT/fuzz.log"
) &
if [ "$S" -gt 0 ]; then
    (
        timeout "$S" $PY -m pytest -p no:cacheprovider -n 8 -v --tb=short --timeout 150 \
            >"$OUT/suite.log" 2>&1
        echo "rc=$?" >>"$OUT/suite.log"
    ) &
fi
wait
if [ "$B" -gt 0 ]; then
    timeout "$B" $PY bench/gpu.py --reps 30 >"$OUT/bench.log" 2>&1
    echo "rc=$?" >>"$OUT/bench.log"
    cp bench/results/gpu.json "$OUT/" 2>/dev/null
fi
if [ "$V" -gt 0 ]; then
    timeout "$V" $PY bench/gpu_variants.py >"$OUT/variants.log" 2>&1
    echo "rc=$?" >>"$OUT/variants.log"
    cp bench/results/gpu_variants.json "$OUT/" 2>/dev/null
fi
exit 0
