"""The GPU check's CUDA tests (``benchmarks/gpu/gpu_check.sh --all``): which run
first, and how.

* ``curated``, the first step of the check: the CUDA tests that had not yet
  run on a GPU (``CURATED``: the paged Triton kernel, ``backend="triton"``,
  the plan and run against float64 attention, the paged run's picks and
  ``IndexCache.write`` against the CPU path, the CUDA-graph captures) and
  ``CASE_IDS`` of the case table against the reference (eager mode; the
  indexer check compares 14 more cases with the CPU path).
* ``rest``, the check's last step, for the time left: every other CUDA test
  (``-k cuda``), the case table's single mode left to
  ``STEM_INDEXER_DEVICE=cuda tests/run.sh single``.

Both run pytest on the CUDA variants (``STEM_INDEXER_DEVICE=cuda``) in
``--workers`` processes with ``--dist load`` (tests, not files, are shared
out: one file's compiles do not hold one worker), Inductor's compile threads
capped (``TORCHINDUCTOR_COMPILE_THREADS``, default 2 a worker), and write a
JUnit XML to ``$OUT`` (``cuda_tests_curated.xml``, ``cuda_tests_rest.xml``).
Stopped by ``timeout -s INT``, pytest still prints its summary and writes
the XML with the tests that ran.

``--dry-run`` collects the same selection on the CPU (``--collect-only``):
a test renamed or removed fails the dry run, not the GPU's.

    python benchmarks/gpu/gpu_tests.py curated
    python benchmarks/gpu/gpu_tests.py rest --dry-run
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CURATED = (
    "tests/test_index_cache_cuda.py",
    "tests/test_index_write_triton.py",
    "tests/test_paged_attention.py::test_cuda_kernel_matches_the_reference",
    "tests/test_paged.py::test_cuda_paged_run_matches_the_cpu_path_and_replays_from_a_graph",
    "tests/test_attention.py::test_cuda_triton_backend_matches_masked_dense",
    "tests/test_plan.py::test_the_run_is_attention_on_its_blocks",
    "tests/test_plan.py::test_one_plan_serves_many_layers",
    "tests/test_plan.py::test_cuda_graph_replays_the_run",
    "tests/test_triton.py::test_cuda_graph_capture_replays_identically",
    "tests/test_cases_single.py::test_case",
)
# The case table's ids for test_case above (eager, against the reference):
# tails, non-causal, empty batches, q longer than kv, the budget's float32
# roundings, the 256 cap, a mixed batch of 23, R = 1, no forced blocks with
# integer scores, an odd Df, bf16 ranking with ties.
CASE_IDS = ("SI_WB_002", "SI_WB_005", "SI_WB_008", "SI_WB_014", "SI_WB_024", "SI_WB_031",
            "SI_WB_045", "SI_WB_072", "SI_WB_082", "SI_WB_093", "SI_WB_103")
WORKERS = 6


def command(which: str, out: Path, *, dry_run: bool = False,
            workers: int = WORKERS) -> tuple[list[str], dict[str, str]]:
    """The pytest arguments and environment of ``which`` (curated or rest)."""
    env = dict(os.environ, STEM_INDEXER_DEVICE="cpu" if dry_run else "cuda")
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "2")
    env.pop("STEM_INDEXER_MODE", None)
    args = ["-q", "-o", "addopts=", "-p", "no:cacheprovider", "-rfE", "--durations=10",
            f"--junitxml={out / f'cuda_tests_{which}.xml'}"]
    args += ["--collect-only", "-n", "0"] if dry_run else ["-n", str(workers), "--dist", "load"]
    if which == "curated":
        env["STEM_INDEXER_CASE_ID"] = ",".join(CASE_IDS)
        return args + list(CURATED), env
    env.pop("STEM_INDEXER_CASE_ID", None)
    # Every CUDA test but the curated ones and the case table's single mode;
    # a file whose imports fail on the device costs its own tests only.
    deselect = [f"--deselect={test}" for test in CURATED]
    return args + ["--continue-on-collection-errors", "-k", "cuda", *deselect, "tests"], env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=("curated", "rest"))
    parser.add_argument("--dry-run", action="store_true",
                        help="collect the selection on CPU instead of running it")
    parser.add_argument("--workers", type=int, default=WORKERS)
    args = parser.parse_args(argv)
    out = Path(os.environ.get("OUT", "./out")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    pytest_args, env = command(args.which, out, dry_run=args.dry_run, workers=args.workers)
    os.chdir(ROOT)
    print("pytest " + " ".join(pytest_args), flush=True)
    # Replaced by pytest (same process): the step's SIGINT reaches pytest itself.
    os.execvpe(sys.executable, [sys.executable, "-m", "pytest", *pytest_args], env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
