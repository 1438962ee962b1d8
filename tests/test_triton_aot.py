"""The CUDA kernels compiled ahead of time for sm_90 and sm_80, without a GPU.

``python -m stem_indexer.operator.ops.triton.aot --json`` compiles every kernel in
every configuration the launcher picks for the benchmark shapes; these tests
run its ``main`` here (through Triton's compile cache) and fail on any
register spill, or on a score kernel without tensor-core MMA instructions.
Under ``TRITON_INTERPRET=1`` the kernels of this process are interpreted and
cannot be compiled: the tests skip and say so.
All in the slow tier (``--run-slow``; CI runs the first): the two GPU
benchmark shapes (the 128K prefill and the 8K chunk over 1M keys, Df 2048:
both selection kernels, both score kernel specialisations) for sm_90, the
H100/H200 target, then every shape and Df for sm_90 and sm_80. The default
run compiles the paged attention kernel ahead of time
(``tests/test_paged_attention.py``).
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

pytest.importorskip("triton")

from stem_indexer.operator.ops.triton import aot, launch  # noqa: E402

FIELDS = {"kernel", "signature", "constexprs", "options", "regs", "stack_bytes",
          "spill_stores", "spill_loads", "mma", "shape"}
# (arch, shape keys, Dfs); None: all of them
TARGETS = [pytest.param((90, ("prefill", "chunk"), (2048,)), id="sm_90-gpu-benchmarks",
                        marks=pytest.mark.slow),
           pytest.param((90, None, None), id="sm_90", marks=pytest.mark.slow),
           pytest.param((80, None, None), id="sm_80", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=TARGETS)
def compiled(request):
    """(the AOT report of one target and selection as JSON entries, the cases it covers)."""
    if launch.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1: this process's kernels are interpreted")
    arch, shapes, dfs = request.param
    argv = ["--json", "--jobs", "1", "--arch", str(arch)]
    argv += [a for key in shapes or () for a in ("--shape", key)]
    argv += [a for df in dfs or () for a in ("--df", str(df))]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert aot.main(argv) == 0
    entries = json.loads(out.getvalue())
    assert {e["target"] for e in entries} == {f"sm_{arch}"}
    cases = {f"{s.name} Df{df} p{p}" for s in aot.SHAPES
             if shapes is None or aot.shape_key(s) in shapes
             for df in dfs or aot.DFS for p in aot.PRECISIONS}
    return entries, cases


def test_every_benchmark_case_is_compiled(compiled):
    entries, cases = compiled
    assert all(FIELDS <= set(entry) for entry in entries)
    for kernel in ("score_kernel", "select_kernel"):
        served = {case for e in entries if e["kernel"].endswith(":" + kernel)
                  for case in e["shape"]}
        assert served == cases, (kernel, sorted(cases ^ served))


def test_no_kernel_spills(compiled):
    entries, _ = compiled
    spilling = [(e["kernel"], e["target"], e["constexprs"], e["stack_bytes"], e["spill_stores"],
                 e["spill_loads"]) for e in entries
                if e["stack_bytes"] or e["spill_stores"] or e["spill_loads"]]
    assert not spilling, spilling


def test_score_kernels_use_tensor_core_mma(compiled):
    entries, _ = compiled
    scores = [e for e in entries if e["kernel"].endswith(":score_kernel")]
    assert scores
    assert all(e["mma"] > 0 for e in scores), [(e["target"], e["mma"]) for e in scores]
    # Pointer loads on both targets: the TMA loads gave wrong scores on an
    # H200 (see launch.default_config) and stay off.
    assert not any(e["constexprs"]["TMA"] for e in scores)
