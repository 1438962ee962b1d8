#!/usr/bin/env bash
# The GPU check, sized for one 600-second command on a rented H100 or H200.
# Writes to $OUT (default ./out): gpu_check.log (every step's output), the
# tables (gpu_check.md, gpu_attention.md, gpu_break_even.md: each line
# appended as it is produced) and the tests' JUnit XML (cuda_tests_*.xml).
#   benchmarks/gpu/gpu_check.sh            # the indexer: correctness on a case subset (128K and
#                                          # 1M-token kv included), CUDA-graph capture, speed
#                                          # against a torch composite and the roofline
#   benchmarks/gpu/gpu_check.sh --variants # plus its kernels under other launch configurations
#   benchmarks/gpu/gpu_check.sh --all      # everything, in steps whose limits add up to 420 s:
#       1. the curated CUDA tests (benchmarks/gpu/gpu_tests.py curated): those that had not yet
#          run on a GPU (the paged kernel, backend="triton", plan and run against float64
#          attention, the paged run's picks and IndexCache.write against the CPU path,
#          the CUDA-graph captures) and 11 cases of the case table
#       2. the indexer check above
#       3. stem_attention against SDPA and FlexAttention's dense kernel, 32K to 128K (and
#          backend="triton", the paged Triton kernel, against FlexAttention on the same
#          selection); stem_paged_run at 128K in 16-token pages (its Triton picks against
#          the CPU path's, compiled and graph-replayed equal to eager, timed against
#          stem_run); stem_run on one stem_plan at 128K (eager, compiled, graph-replayed)
#       4. the dense_above break-even at 32K
#       5. every other CUDA test (gpu_tests.py rest), for the time left
#   benchmarks/gpu/gpu_check.sh --all --dry-run # about a minute on CPU: tiny shapes, the Triton
#                                               # interpreter, the test selections collected
# Each step runs under `timeout -s INT -k 15 LIMIT`: stopped at its limit, pytest prints its
# summary and writes its XML, the scripts keep the lines they wrote; a failed or stopped step
# is reported and the next one runs. STEM_GIT_SHA names the commit measured in every output:
# pass the host's (the device machine may get a copy without .git, or with a stale one),
#   STEM_GIT_SHA=$(git rev-parse HEAD) benchmarks/gpu/gpu_check.sh --all
# else it is taken from git here, where there is one.
# The kernels' compile report (no GPU needed): python -m stem_indexer.operator.ops.triton.aot
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export OUT=${OUT:-./out} PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
# Inductor's compile workers per process: the test step runs several processes.
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-2}
if [ -z "${STEM_GIT_SHA:-}" ]; then
    if STEM_GIT_SHA=$(git rev-parse HEAD 2>/dev/null); then
        [ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] \
            || STEM_GIT_SHA="$STEM_GIT_SHA+dirty"
    else
        STEM_GIT_SHA=unknown
    fi
fi
export STEM_GIT_SHA
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"

all=0; dry=(); rest=()
for arg in "$@"; do
    case "$arg" in
        --all) all=1 ;;
        --dry-run) dry=(--dry-run) ;;
        *) rest+=("$arg") ;;
    esac
done

failed=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, output to the log, go on
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s)" | tee -a "$LOG"
    local t0=$SECONDS
    timeout -s INT -k 15 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local said="exit $rc"
    case "$rc" in 124|137) said="stopped at its limit (exit $rc)" ;; esac
    echo "=== $name: $said after $((SECONDS - t0))s" | tee -a "$LOG"
    [ "$rc" = 0 ] || failed+=("$name ($said)")
}

{
    echo "gpu_check $* on $(hostname), git $STEM_GIT_SHA, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    if [ ${#dry[@]} = 0 ] && command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,clocks.sm,driver_version --format=csv,noheader
    fi
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee -a "$LOG"

if [ "$all" = 0 ]; then
    # The limit leaves room for --variants (its first calls compile each configuration).
    step "indexer check" 420 "$PY" benchmarks/gpu/gpu_check.py "${dry[@]}" "${rest[@]}"
else
    # The limits add up to 420 s (tests/test_bench.py holds them to it): with the
    # 15-second grace of each and the start, the whole fits one 600-second command.
    step "CUDA tests: curated" 140 "$PY" benchmarks/gpu/gpu_tests.py curated "${dry[@]}"
    step "indexer check" 80 "$PY" benchmarks/gpu/gpu_check.py "${dry[@]}" --reps 5
    step "attention" 130 "$PY" benchmarks/gpu/gpu_attention.py "${dry[@]}" --reps 3
    step "break-even" 30 "$PY" benchmarks/gpu/gpu_attention.py "${dry[@]}" --break-even 32768 \
        --budgets 32,64,128,192 --reps 3
    step "CUDA tests: the rest" 40 "$PY" benchmarks/gpu/gpu_tests.py rest "${dry[@]}"
fi
if [ ${#failed[@]} = 0 ]; then
    echo "gpu_check: every step passed" | tee -a "$LOG"
else
    echo "gpu_check: FAILED: ${failed[*]}" | tee -a "$LOG"
    exit 1
fi
