#!/usr/bin/env bash
# The GPU check. Writes its tables to $OUT (default ./out).
#   benchmarks/gpu_check.sh                # the indexer: correctness on a case subset (128K and
#                                          # 1M-token kv included), CUDA-graph capture, speed
#                                          # against a torch composite and the roofline
#   benchmarks/gpu_check.sh --variants     # plus its kernels under other launch configurations
#   benchmarks/gpu_check.sh --all          # everything, about 7 minutes on one H200:
#       1. every CUDA test (pytest -k cuda with STEM_INDEXER_DEVICE=cuda): indexer,
#          attention, flash functions, FlexAttention, the paged entry point and its
#          kernels, the HF integration on tiny models
#       2. the indexer check above
#       3. stem_attention against SDPA and FlexAttention's dense kernel, 32K to 128K (and the
#          backend="triton", the paged Triton kernel, against FlexAttention on the same
#          selection); then
#          stem_run on one stem_plan at 128K: eager, compiled (fullgraph, dynamic) and
#          replayed from a CUDA graph, each equal to stem_attention; and stem_paged_run on
#          the same tokens in 16-token pages: Triton picks = torch picks, compiled and
#          graph-replayed equal to eager, timed against stem_run
#       4. the dense_above break-even at 32K
#   benchmarks/gpu_check.sh --all --dry-run   # about 20 s on CPU: tiny shapes, Triton interpreter
# The kernels' compile report (no GPU needed): python -m stem_indexer.ops.triton.aot
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export OUT=${OUT:-./out} PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

all=0; dry=(); rest=()
for arg in "$@"; do
    case "$arg" in
        --all) all=1 ;;
        --dry-run) dry=(--dry-run) ;;
        *) rest+=("$arg") ;;
    esac
done
if [ "$all" = 0 ]; then
    # The limit leaves room for --variants (its first calls compile each configuration).
    exec timeout 420 "$PY" benchmarks/gpu_check.py "${dry[@]}" "${rest[@]}"
fi

failed=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, note a failure, go on
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0))s"
    [ "$rc" = 0 ] || failed+=("$name (exit $rc)")
}

if [ ${#dry[@]} = 0 ]; then
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,clocks.sm,driver_version \
        --format=csv,noheader
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    STEM_INDEXER_DEVICE=cuda step "CUDA tests" 200 "$PY" -m pytest -q -o addopts="" -rfE \
        -n 6 --dist loadfile -k cuda tests
fi
step "indexer check" 120 "$PY" benchmarks/gpu_check.py "${dry[@]}" --reps 5
step "attention" 240 "$PY" benchmarks/gpu_attention.py "${dry[@]}"
step "break-even" 60 "$PY" benchmarks/gpu_attention.py "${dry[@]}" --break-even 32768
if [ ${#failed[@]} = 0 ]; then
    echo "gpu_check --all: every step passed"
else
    echo "gpu_check --all: FAILED: ${failed[*]}"
    exit 1
fi
