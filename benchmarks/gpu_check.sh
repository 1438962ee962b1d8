#!/usr/bin/env bash
# GPU check of the Triton path (one H200, under five minutes): correctness on a
# case subset (128K and 1M-token kv included), CUDA-graph capture, speed against
# a torch composite and the roofline. Writes $OUT/gpu_check.md (default ./out).
#   benchmarks/gpu_check.sh             # on the GPU
#   benchmarks/gpu_check.sh --dry-run   # tiny shapes on CPU, Triton interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export OUT=${OUT:-./out}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 290 "$PY" benchmarks/gpu_check.py "$@"
