"""Every ``python`` block of the README runs as it stands, each on its own in a
fresh interpreter, within a minute on CPU. The interpreters run together
(most of their time is importing torch and transformers), so each gets two
minutes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> list[subprocess.CompletedProcess]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                                       os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                              cwd=tmp_path_factory.mktemp(f"block{i}"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i, code in enumerate(BLOCKS)]
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += "\n(killed after 120 s)"
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.mark.parametrize("n", range(len(BLOCKS)), ids=[f"block{i + 1}" for i in range(len(BLOCKS))])
def test_readme_block_runs(n, finished):
    proc = finished[n]
    assert proc.returncode == 0, f"README block failed:\n{BLOCKS[n]}\n{proc.stderr[-3000:]}"
