"""Mutation check: break one rule of the contract at a time in a copy of the
repository and confirm that the default test run catches it.

Each mutation is one textual change to ``src/stem_indexer/operator/contract.py``, the
home of the semantics; the reference (``reference.py``) restates the rules
row by row on its own, so a broken contract must show up as a disagreement
with it, or with the hand-computed cases. Run from the repository root:

    python tools/mutation_check.py                 # the default run, each mutation
    python tools/mutation_check.py --tests tests/test_semantics.py --tests tests/test_budget.py

Exit status 1 if some mutation survives (its run passes).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = "src/stem_indexer/operator/contract.py"
MUTATIONS = {  # name: (original text, replacement)
    "budget: the medium branch starts one block later":
        ("torch.where(p < BRANCH_MEDIUM, p,", "torch.where(p <= BRANCH_MEDIUM, p,"),
    "ties: equal scores go to the higher block index":
        ("return (ordered.to(torch.int64) << 32) | (_LOW32 - blocks)",
         "return (ordered.to(torch.int64) << 32) | blocks"),
    "causal: rows aligned top-left instead of right-down":
        ("return torch.minimum((i + (kb - qb + 1)).clamp(min=0), kb)",
         "return torch.minimum((i + 1).clamp(min=0), kb)"),
}


def run(name: str, old: str, new: str, tests: list[str]) -> tuple[bool, str, float]:
    with tempfile.TemporaryDirectory(prefix="stem_mutant_") as tmp:
        for part in ("src", "tests", "benchmarks", "pyproject.toml", "README.md"):
            src = ROOT / part
            (shutil.copytree if src.is_dir() else shutil.copy)(src, Path(tmp) / part)
        path = Path(tmp) / CONTRACT
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"{name}: the text to mutate is not found once in {CONTRACT}")
        path.write_text(text.replace(old, new))
        env = dict(os.environ, PYTHONPATH=str(Path(tmp) / "src"))
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *tests], cwd=tmp, env=env, capture_output=True, text=True)
        summary = (re.findall(r"^=*\s*(\d+ (?:failed|passed).*?)\s*=*$", proc.stdout, re.M)
                   or [proc.stdout.strip().splitlines()[-1:]])[-1]
        return proc.returncode != 0, str(summary), time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", action="append", default=[],
                        help="test paths to run (default: the default run)")
    args = parser.parse_args(argv)
    survivors = 0
    print("| mutation | caught | tests | s |\n|---|---|---|---|")
    for name, (old, new) in MUTATIONS.items():
        caught, summary, seconds = run(name, old, new, args.tests)
        survivors += not caught
        print(f"| {name} | {'yes' if caught else 'NO'} | {summary} | {seconds:.0f} |", flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
