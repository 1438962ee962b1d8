"""The CUDA kernels compiled ahead of time for sm_90 and sm_80, without a GPU.

``python -m stem_indexer.ops.triton.aot --json`` compiles every kernel in
every configuration the launcher picks for the benchmark shapes; this test
runs it (in its own process, with Triton's directories in a temporary one)
and fails on any register spill, or on a score kernel without tensor-core MMA
instructions, on either target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from stem_indexer.ops.triton import aot  # noqa: E402

FIELDS = {"kernel", "signature", "constexprs", "options", "regs", "stack_bytes",
          "spill_stores", "spill_loads", "mma", "shape"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    home = tmp_path_factory.mktemp("triton_home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    proc = subprocess.run([sys.executable, "-m", "stem_indexer.ops.triton.aot", "--arch", "90",
                           "--arch", "80", "--json"], env=dict(env, TRITON_HOME=str(home)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_every_benchmark_case_is_compiled_for_both_targets(report):
    assert all(FIELDS <= set(entry) for entry in report)
    cases = {f"{s.name} Df{df} p{p}" for s in aot.SHAPES for df in aot.DFS
             for p in aot.PRECISIONS}
    for target in ("sm_90", "sm_80"):
        for kernel in ("score_kernel", "select_kernel"):
            served = {case for e in report if e["target"] == target
                      and e["kernel"].endswith(":" + kernel) for case in e["shape"]}
            assert served == cases, (target, kernel, sorted(cases - served))


def test_no_kernel_spills(report):
    spilling = [(e["kernel"], e["target"], e["constexprs"], e["stack_bytes"], e["spill_stores"],
                 e["spill_loads"]) for e in report
                if e["stack_bytes"] or e["spill_stores"] or e["spill_loads"]]
    assert not spilling, spilling


def test_score_kernels_use_tensor_core_mma(report):
    scores = [e for e in report if e["kernel"].endswith(":score_kernel")]
    assert {e["target"] for e in scores} == {"sm_90", "sm_80"}
    assert all(e["mma"] > 0 for e in scores), [(e["target"], e["mma"]) for e in scores]
    # Pointer loads on both targets: the TMA loads gave wrong scores on an
    # H200 (see launch.default_config) and stay off.
    assert not any(e["constexprs"]["TMA"] for e in scores)
