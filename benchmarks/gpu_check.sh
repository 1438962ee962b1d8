#!/usr/bin/env bash
# GPU check of the Triton path (one H200, under four minutes): correctness on a
# case subset (128K and 1M-token kv included), CUDA-graph capture, speed against
# a torch composite and the roofline, each kernel's time. Writes
# $OUT/gpu_check.md (default ./out).
#   benchmarks/gpu_check.sh               # on the GPU
#   benchmarks/gpu_check.sh --variants    # plus the kernels under other configurations
#   benchmarks/gpu_check.sh --dry-run     # tiny shapes on CPU, Triton interpreter
# The kernels' compile report (no GPU needed): python -m stem_indexer.ops.triton.aot
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export OUT=${OUT:-./out}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# The limit leaves room for --variants (its first calls compile each configuration).
exec timeout 420 "$PY" benchmarks/gpu_check.py "$@"
