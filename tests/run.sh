#!/usr/bin/env bash
# Entry point in the style of the reference suite's test_run.sh.
#
#   tests/run.sh single|single_graph|batch|batch_graph [pytest args...]
#
# single*: one pytest test per case (tests/test_cases_single.py);
# batch*:  CSV -> .pt inputs + goldens -> run -> result.csv (tests/test_cases_batch.py);
# *_graph: the op runs inside torch.compile(fullgraph=True, dynamic=True).
# STEM_INDEXER_CASE_ID (comma-separated ids) and STEM_INDEXER_DEVICE pass through.
# Works from any directory; uses $PYTHON, else the active venv, else <repo>/.venv.
set -euo pipefail

usage() {
    echo "usage: $0 single|single_graph|batch|batch_graph [pytest args...]" >&2
    exit 2
}

[[ $# -ge 1 ]] || usage
target="$1"
shift
case "$target" in
    single)       file=test_cases_single.py; mode=eager ;;
    single_graph) file=test_cases_single.py; mode=graph ;;
    batch)        file=test_cases_batch.py;  mode=eager ;;
    batch_graph)  file=test_cases_batch.py;  mode=graph ;;
    *)            usage ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
    python="$PYTHON"
elif [[ -z "${VIRTUAL_ENV:-}" && -x "$root/.venv/bin/python" ]]; then
    python="$root/.venv/bin/python"
else
    python=python3
fi

cd "$root"
export STEM_INDEXER_MODE="$mode"
exec "$python" -m pytest "tests/$file" "$@"
