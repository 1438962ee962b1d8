"""benchmarks/indexer_bench.py: the plain baseline and the GEMM line are right, and one tiny
shape runs end to end (timings are printed by the benchmark, never asserted)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import stem_indexer  # noqa: F401  (registers the ops)
import indexer_bench as bench
from stem_indexer.ops import native
from stem_indexer.testing.cases import get_case
from stem_indexer.testing.runner import golden_outputs

TINY = bench.Shape("T", "tiny causal mixed batch", (300, 1, 640), (900, 700, 640), 4, 2,
                   dim=32, repeat=1)


@pytest.mark.parametrize("case_id", ["SI_WB_001", "SI_WB_039", "SI_WB_050", "SI_WB_077",
                                     "SI_WB_082", "SI_WB_177"])
def test_plain_baseline_equals_reference(case_id):
    """The baseline a user would write is exact too (ties by its stable sort)."""
    case = get_case(case_id)
    inputs = case.make_inputs()
    # The baseline budgets with the kv length as the prompt: the cases chosen
    # must have no prompt lengths of their own (a precondition, not a skip).
    assert case.prompt_lens is None and inputs.pop("num_prompt_tokens") is None, case_id
    expected, _ = golden_outputs(case)
    got = bench.plain_indexer(inputs, case.params)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[0], expected[0])


def test_gemm_line_is_the_op_without_its_selection(monkeypatch):
    """The ``gemm`` line runs the op's own score matmuls, and no selection."""
    ranking = bench.Shape("R", "budget binds (71 key blocks)", (300, 1, 640), (9000, 7300, 640),
                          4, 2, dim=32, repeat=1)
    inputs = ranking.make_inputs()
    params = ranking.params
    metadata = bench._metadata(inputs, params)
    seen = []
    real = torch.bmm

    def spy(a, b, *args, **kwargs):
        seen.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "bmm", spy)
    bf16 = native.scores_bf16  # the products on CPUs with bfloat16 dot products
    monkeypatch.setattr(native, "scores_bf16",
                        lambda a, b, *rest: (seen.append((tuple(a.shape), tuple(b.shape))),
                                             bf16(a, b, *rest))[1])
    bench.run_op(inputs, metadata, params)
    by_op, seen[:] = list(seen), []
    selected = []
    monkeypatch.setattr(native, "select_rows", lambda *args: selected.append(1))
    bench.scores_only(inputs, metadata, params)()
    assert seen == by_op and len(seen) > 0
    assert selected == []  # the closure stubs the selection out itself


def test_gemm_floor_multiplies_every_visible_pair(monkeypatch):
    """The bf16 / float32 GEMM lines compute the scores of every causally
    visible (query block, key block) pair: with one query block per matmul
    exactly those, with tiles of them at least those; and the values are
    the products."""
    inputs = TINY.make_inputs()
    params = TINY.params
    want = bench.visible_pairs(inputs, params) * TINY.q_heads
    real = torch.matmul
    for tile, exact in ((1, True), (32, False)):
        done = []

        def spy(a, b, *, out):
            done.append(a.shape[0] * b.shape[1])
            return real(a, b, out=out)

        monkeypatch.setattr(torch, "matmul", spy)
        bench.visible_gemm(inputs, params, torch.float32, tile=tile)()
        assert (sum(done) == want) if exact else (sum(done) >= want)
    monkeypatch.setattr(torch, "matmul", real)
    last = bench.visible_gemm(inputs, params, torch.float32, tile=10**6)()
    q, k = inputs["qflat"][2, 2:4].float().reshape(-1, 32), inputs["kflat"][2, 1, :5].float()
    assert torch.equal(last[1, :q.shape[0] * 5].view(-1, 5), q @ k.T)


def test_measure_shape_runs_and_checks():
    row = bench.measure_shape(TINY)
    assert row["check_exact"] and row["shape"] == "T"
    for key in ("op_ms", "gemm_ms", "plain_ms", "bf16_ms", "f32_ms", "op_over_floor"):
        assert row[key] > 0
    table = bench.markdown_table([row])
    assert table.count("\n") == 2 and "| T |" in table


def test_unknown_shape_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--shapes", "S1,S9"])
    assert exc.value.code == 2 and "unknown ['S9']" in capsys.readouterr().err


def test_shapes_match_the_benchmark_brief():
    s = bench.SHAPES
    assert (len(s["S1"].q_lens), s["S1"].q_heads, s["S1"].kv_heads) == (4, 64, 8)
    assert (s["S1"].q_lens[0] // 128, s["S1"].kv_lens[0] // 128) == (16, 64)
    assert (s["S3"].q_lens, s["S3"].kv_lens) == ((8192,), (1 << 20,))
    assert s["S4"].q_lens == s["S4"].kv_lens == (1 << 17,)
    assert len(s["S5"].q_lens) == 8 and max(s["S5"].kv_lens) <= 65536
    assert dataclasses.asdict(s["S2"].params) == dataclasses.asdict(stem_indexer.IndexerParams())


@pytest.mark.parametrize("stem, name", [
    ({"preset": "default", "exact_tail": 0}, "default"),     # the recorded cells' settings
    ({"preset": "default"}, "default-tail"),                 # the default exact_tail, 128
    ({"preset": "tight", "exact_tail": 64}, "tight-tail64"),
    ({"exact_tail": 0, "alpha": 0.5}, 'default {"alpha": 0.5}'),
])
def test_vllm_passkey_trials_are_named_by_their_settings(stem, name):
    """``vllm_bench.py passkey`` files a Stem engine's trials under a name
    its settings decide, so trials with and without the exact tail never
    share a cell."""
    import vllm_bench  # no vLLM import at module level

    assert vllm_bench.stem_config_name(stem) == name
