"""Every ``python`` block of the README runs as it stands.

The blocks run in order in one fresh interpreter, as a reader pasting them
into one session would: each in a namespace of its own (a block must import
what it uses), with whatever state the earlier blocks left in the libraries
(the CPU path's kept scratch buffers, registrations). Each block's outcome is
its own test result.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
TIMEOUT_S = 180

# Runs in the child: the blocks as JSON on stdin, one JSON line per block out.
DRIVER = """
import json, sys, traceback
for n, code in enumerate(json.load(sys.stdin)):
    try:
        exec(compile(code, f"<README block {n + 1}>", "exec"), {"__name__": "__main__"})
        result = None
    except BaseException:
        result = traceback.format_exc()
    print("\\nREADME-BLOCK " + json.dumps([n, result]), flush=True)
import gc
gc.freeze()  # exit without a last collection over the blocks' objects
"""


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    """Block number -> None (ran) or its traceback; "log" -> the child's output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                                       os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(BLOCKS),
                              env=env, cwd=tmp_path_factory.mktemp("readme"), text=True,
                              capture_output=True, timeout=TIMEOUT_S)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        log = f"{err.stdout or ''}{err.stderr or ''}\n(killed after {TIMEOUT_S} s)"
    found = dict(json.loads(line.split(" ", 1)[1]) for line in log.splitlines()
                 if line.startswith("README-BLOCK "))
    return {**found, "log": log[-3000:]}


@pytest.mark.parametrize("n", range(len(BLOCKS)), ids=[f"block{i + 1}" for i in range(len(BLOCKS))])
def test_readme_block_runs(n, outcomes):
    assert n in outcomes, f"README block {n + 1} did not finish; output:\n{outcomes['log']}"
    assert outcomes[n] is None, f"README block {n + 1} failed:\n{BLOCKS[n]}\n{outcomes[n]}"
