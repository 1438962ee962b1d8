"""bench.py: the plain baseline and the GEMM line are right, and one tiny
shape runs end to end (timings are printed by the benchmark, never asserted)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import stem_indexer  # noqa: F401  (registers the ops)
from stem_indexer import bench
from stem_indexer.cases import get_case
from stem_indexer.runner import golden_outputs

TINY = bench.Shape("T", "tiny causal mixed batch", (300, 1, 640), (900, 700, 640), 4, 2,
                   dim=32, repeat=1)


@pytest.mark.parametrize("case_id", ["SI_WB_001", "SI_WB_039", "SI_WB_050", "SI_WB_077",
                                     "SI_WB_082", "SI_WB_177"])
def test_plain_baseline_equals_reference(case_id):
    """The baseline a user would write is exact too (ties by its stable sort)."""
    case = get_case(case_id)
    inputs = case.make_inputs()
    if inputs["num_prompt_tokens"] is not None:
        pytest.skip("the baseline budgets with the kv length as prompt")
    inputs.pop("num_prompt_tokens")
    expected, _ = golden_outputs(case)
    got = bench.plain_indexer(inputs, case.params)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[0], expected[0])


def test_gemm_line_computes_every_visible_score():
    """The line's matmuls cover every visible (query block, key block) pair."""
    inputs = TINY.make_inputs()
    params = TINY.params
    metadata = bench._metadata(inputs, params)
    seen = []
    real = torch.bmm

    def spy(a, b, *args, **kwargs):
        seen.append((a.shape[1], b.shape[2]))
        return real(a, b, *args, **kwargs)

    torch.bmm = spy
    try:
        bench.gemm_line(inputs, metadata, params)()
    finally:
        torch.bmm = real
    group = TINY.q_heads // TINY.kv_heads
    computed = sum(rows // group * keys for rows, keys in seen)
    assert computed >= bench.visible_pairs(inputs, params) > 0


def test_measure_shape_runs_and_checks():
    row = bench.measure_shape(TINY)
    assert row["check_exact"] and row["shape"] == "T"
    for key in ("op_ms", "gemm_ms", "sgemm_ms", "plain_ms"):
        assert row[key] > 0
    table = bench.markdown_table([row])
    assert table.count("\n") == 2 and "| T |" in table


def test_unknown_shape_is_refused(capsys):
    with pytest.raises(SystemExit, match="unknown"):
        bench.main(["--shapes", "S1,S9"])


def test_shapes_match_the_benchmark_brief():
    s = bench.SHAPES
    assert (len(s["S1"].q_lens), s["S1"].q_heads, s["S1"].kv_heads) == (4, 64, 8)
    assert (s["S1"].q_lens[0] // 128, s["S1"].kv_lens[0] // 128) == (16, 64)
    assert (s["S3"].q_lens, s["S3"].kv_lens) == ((8192,), (1 << 20,))
    assert s["S4"].q_lens == s["S4"].kv_lens == (1 << 17,)
    assert len(s["S5"].q_lens) == 8 and max(s["S5"].kv_lens) <= 65536
    assert dataclasses.asdict(s["S2"].params) == dataclasses.asdict(stem_indexer.IndexerParams())
