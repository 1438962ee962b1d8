"""The Triton (CUDA) path, run on CPU tensors by Triton's interpreter.

The interpreter tests (``@interpreted``) run in one child pytest with
``TRITON_INTERPRET=1`` (``tests/_interpreter.py``); with it set, they simply
run here.

Interpreted kernels are slow: the cases here are tiny, hand-computed first
(ties, NaN, -0.0, the selection's edges), then exact-score (integer) random
cases that must be bit-identical to the reference and to the CPU path, then a
few small cases of the table compared as the runner does (docs/CONTRACT.md section 5,
plus identity for integer data). Each runs with tiny tiles and with the GPU
configuration itself (``default_config``: the same tiles for sm_90 and
sm_80). Outputs are poisoned first so that an element no kernel writes
cannot pass.

On a machine with CUDA the last tests run the compiled kernels through the
registered op, including a CUDA-graph capture.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from stem_indexer.testing import cases, compare  # noqa: E402
from stem_indexer.operator.contract import IndexerParams  # noqa: E402
from stem_indexer.operator.ops.triton import launch  # noqa: E402

from _interpreter import interpreted  # noqa: E402
from _helpers import (  # noqa: E402
    Inputs, assert_out_equal, expected_tensors, make_inputs, metadata_for, random_inputs, run_ref,
    spec_row_facts)

POISON = 0x5EEDBEEF
# Tiles small enough that every row with more than 16 candidates takes the
# chunked (radix) selection, and items span several row blocks; pointer loads.
# Four query rows per selection program (fewer programs for the interpreter to
# run); the GPU configurations' one and two run in the ``gpu`` cases.
TINY = launch.Config(block_m=16, block_n=16, block_k=16, tma=False, nprog=2, score_warps=4,
                     score_stages=1, score_maxnreg=None, rows=4, block_c=16, block_w=16,
                     select_warps=4)
# Configurations a test runs with: TINY, and what the launcher picks for a GPU
# (sm_90 and sm_80 get the same tiles; the interpreter's own default, TMA
# descriptors on small tiles, runs in the costlier tests only).
CONFIGS = (TINY, pytest.param(90, marks=pytest.mark.slow))
CONFIG_IDS = ("tiny", "gpu")
# (precision, configuration) pairs of the costlier tests: both precisions with
# TINY, one each with the GPU configuration and the interpreter's default.
PRECISION_CONFIGS = ((1, TINY, "tiny"), (2, 90, "gpu"), (2, TINY, "tiny"), (1, None, "default"))


# --------------------------------------------------------------------------- #
# Running the launcher
# --------------------------------------------------------------------------- #


def _config(config, inp: Inputs):
    if config is None or isinstance(config, launch.Config):
        return config
    nq, qmax, df = inp.qflat.shape[1:]
    return launch.default_config(nq // inp.kflat.shape[1], qmax, inp.kflat.shape[2], df,
                                 arch=config, sms=2)


def run_triton(inp, config=None, **params):
    """The Triton launcher on CPU tensors (interpreted), metadata from the op."""
    p = IndexerParams(**params)
    md = metadata_for(inp, **params)
    return launch.stem_indexer_triton(inp.qflat, inp.kflat, inp.vbias, inp.q_seq_lens,
                                      inp.kv_seq_lens, inp.num_prompt_tokens, md, p,
                                      config=_config(config, inp), poison=POISON)


def run_cpu_op(inp, **params):
    md = metadata_for(inp, **params)
    return torch.ops.custom.npu_stem_indexer(*inp.tensors(),
                                             num_prompt_tokens=inp.num_prompt_tokens,
                                             metadata=md, **params)


# --------------------------------------------------------------------------- #
# Hand-computed rows
# --------------------------------------------------------------------------- #

# One query block over n key blocks, Bs=Ts=1 (scale 1), Df=1, q=1: the score of
# block j is kflat[j] + vbias[j]. A prompt of 100 blocks with rate 0 gives
# K = k_block_num_bias_medium; sink {0} and window {n-1} are forced;
# candidates are blocks 1..n-2.
HAND = dict(causal=False, stem_block_size=1, stem_stride=1, initial_blocks=1, window_size=1,
            k_block_num_rate_medium=0.0, k_block_num_bias_medium=2)


def _one_row(kvals, vbias=None):
    vbias = [0.0] * len(kvals) if vbias is None else vbias
    return make_inputs([[[[1.0]]]], [[[[v] for v in kvals]]], [[vbias]], [1], [len(kvals)],
                       prompt=[100])


def _expect_row(picks, n):
    return expected_tensors([[[sorted({0, n - 1} | set(picks))]]], n)


@interpreted
@pytest.mark.parametrize("precision", [1, 2])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_ties_go_to_the_lower_block_index(precision, config):
    # candidate scores 3, 3, 7, 3, 3, 2 -> block 3, then the lowest 3 (block 1)
    inp = _one_row([5, 3, 3, 7, 3, 3, 2, 9])
    out = run_triton(inp, config, **HAND, topk_score_precision=precision)
    assert_out_equal(out, _expect_row([1, 3], 8), "triton")


@interpreted
def test_bf16_ranking_rounds_before_ranking():
    # vbias 1 + 2^-9 > 1 + 2^-10 > 1 in float32; in bf16 (8 significant bits)
    # 1 + 2^-9 rounds to nearest even 1.0 and 1 + 2^-10 to 1.0: all tie.
    vb = [0.0, 1.0, 1.0 + 2.0**-10, 1.0 + 2.0**-9, 0.0, 0.0, 0.0, 0.0]
    inp = _one_row([0] * 8, vb)
    fp32 = run_triton(inp, **HAND, topk_score_precision=1)
    bf16 = run_triton(inp, **HAND, topk_score_precision=2)
    assert_out_equal(fp32, _expect_row([2, 3], 8), "precision 1")
    assert_out_equal(bf16, _expect_row([1, 2], 8), "precision 2")


@interpreted
@pytest.mark.parametrize("precision", [1, 2])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_minus_zero_ties_plus_zero_and_nan_ranks_last(precision, config):
    nan = float("nan")
    # candidates 1..6: nan, -0.0, +0.0, nan, -1, -2 -> -0.0 (block 2) ties +0.0
    # (block 3) and wins as the lower index; then block 3.
    inp = _one_row([0] * 8, [0.0, nan, -0.0, 0.0, nan, -1.0, -2.0, 0.0])
    out = run_triton(inp, config, **HAND, topk_score_precision=precision)
    assert_out_equal(out, _expect_row([2, 3], 8), "triton")


# (label, candidate scores, take, expected picks as candidate positions 0..)
INF = float("inf")
SELECTION_EDGES = [
    ("all-equal", [1.0] * 12, 5, [0, 1, 2, 3, 4]),
    ("ties-straddle-threshold", [5, 3, 7, 5, 5, 7, 5, 3, 1], 4, [0, 2, 3, 5]),
    ("take-1", [2, 3, 9, 9, 1, 9], 1, [2]),
    ("take-count-minus-1", [4, 4, 1, 4, 4, 4, 4], 6, [0, 1, 3, 4, 5, 6]),
    ("nan-ties-minus-inf", [float("nan"), -INF, -1e30, float("nan"), -INF], 3, [0, 1, 2]),
    ("extremes", [INF, -INF, 3e38, -3e38, 0.0, -0.0, 1e-45, -1e-45], 5, [0, 2, 4, 5, 6]),
]


@interpreted
@pytest.mark.parametrize("precision", [1, 2])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("label,scores,take,picks", SELECTION_EDGES,
                         ids=[e[0] for e in SELECTION_EDGES])
def test_selection_edges(label, scores, take, picks, precision, config):
    vbias = [0.0, *scores, 0.0]  # candidates are blocks 1..len(scores)
    inp = _one_row([0] * len(vbias), vbias)
    params = dict(HAND, k_block_num_bias_medium=take, topk_score_precision=precision)
    out = run_triton(inp, config, **params)
    expected = run_ref(inp, **params)
    assert_out_equal(expected, _expect_row([1 + c for c in picks], len(vbias)),
                     f"{label}: reference")
    assert_out_equal(out, expected, f"triton {label}")


def test_selection_edges_are_consistent():
    # take = count - 1 leaves out exactly one candidate: the lowest score.
    for label, scores, take, picks in SELECTION_EDGES:
        assert len(picks) == take < len(scores), label


@interpreted
@pytest.mark.parametrize("candidates,precision,config", [
    (8190, 1, 90), pytest.param(8300, 2, 90, marks=pytest.mark.slow)], ids=["8190-p1", "8300-p2"])
def test_long_rows_with_ties(candidates, precision, config):
    # Integer scores in [-4, 4]: hundreds of keys tie at the threshold. With
    # the GPU configurations 8190 candidates stay in registers (one bit per
    # pass), 8300 take the radix select over the row in memory.
    gen = torch.Generator().manual_seed(candidates + precision)
    n = candidates + 2
    vbias = torch.randint(-4, 5, (n,), generator=gen).float().tolist()
    inp = _one_row([0] * n, vbias)
    inp.num_prompt_tokens = torch.tensor([n], dtype=torch.int32)
    params = dict(HAND, k_block_num_rate_large=0.0, k_block_num_bias_large=200,
                  topk_score_precision=precision)
    expected = run_ref(inp, **params)
    assert int(expected[1].sum()) == 202
    assert_out_equal(run_triton(inp, config, **params), expected, "triton")


@interpreted
def test_causal_rows_empty_rows_and_padding():
    # Batch 0: q 3 blocks over kv 2 blocks (row 0 sees nothing), Qmax 4 (row 3
    # is padding); batch 1: kv 0 (all rows empty). Bs=Ts=1, nothing binds.
    inp = make_inputs([[[[1.0]] * 4]] * 2, [[[[1.0]] * 3]] * 2, [[[0.0] * 3]] * 2, [3, 2], [2, 0])
    out = run_triton(inp, stem_block_size=1, stem_stride=1, initial_blocks=1, window_size=1)
    rows = [[[[], [0], [0, 1], []]], [[[], [], [], []]]]
    assert_out_equal(out, expected_tensors(rows, 3), "triton")


# --------------------------------------------------------------------------- #
# Row facts: the contract's budget and ranges, evaluated as tensors
# --------------------------------------------------------------------------- #


def test_row_facts_match_the_spec_restated():
    gen = torch.Generator().manual_seed(3)
    params = IndexerParams(stem_block_size=4, stem_stride=2, alpha=0.3, initial_blocks=2,
                           window_size=3, k_block_num_rate_medium=0.7,
                           k_block_num_rate_large=0.35, k_block_num_bias_large=3)
    qmax, kmax, bs = 9, 300, 4
    q_lens = torch.randint(0, qmax * bs + 1, (40,), generator=gen, dtype=torch.int32)
    kv_lens = torch.randint(0, kmax * bs + 1, (40,), generator=gen, dtype=torch.int32)
    prompt = kv_lens + torch.randint(0, 400, (40,), generator=gen, dtype=torch.int32)
    for causal in (True, False):
        p = dataclasses.replace(params, causal=causal)
        facts = launch.row_facts(q_lens, kv_lens, prompt, qmax, kmax, p)
        for b in range(40):
            qb, kb = -(-int(q_lens[b]) // bs), -(-int(kv_lens[b]) // bs)
            for i in range(qmax):
                s2, forced, cands, k = spec_row_facts(int(q_lens[b]), int(kv_lens[b]),
                                                      int(prompt[b]), i, p)
                if i >= qb or kb == 0:
                    s2, forced, cands, k = 0, set(), 0, 0
                got = facts[b, i].tolist()
                assert got[0] == s2 and got[1] + (s2 - got[2]) == len(forced), (b, i, got)
                assert got[2] - got[1] == cands and got[3] == min(k, cands), (b, i, got, k)


# --------------------------------------------------------------------------- #
# Exact scores: bit-identical to the reference and to the CPU path
# --------------------------------------------------------------------------- #

# (label, batch shapes, attributes): tiny shapes with many ties (integer data
# in [-3, 3], Df <= 8) and binding budgets (prompts of 60..200 blocks).
EXACT = [
    ("gqa-causal-varlen", dict(nq=4, nk=2, qmax=5, kmax=40, df=8, q_lens=[5, 3, 0, 1],
                               kv_lens=[40, 23, 9, 0], prompt=[70, 60, 100, 5]),
     dict(stem_block_size=1, stem_stride=1, k_block_num_bias_medium=3,
          k_block_num_rate_medium=0.05)),
    ("mqa-noncausal-alpha", dict(nq=3, nk=1, qmax=4, kmax=33, df=4, q_lens=[4, 2],
                                 kv_lens=[33, 30], prompt=[180, 200]),
     dict(causal=False, stem_block_size=1, stem_stride=1, alpha=0.3,
          k_block_num_rate_large=0.05, k_block_num_bias_large=2)),
    ("bs4-tails-window0", dict(nq=2, nk=2, qmax=3, kmax=30, df=8, q_lens=[9, 5],
                               kv_lens=[117, 97], prompt=[400, 300]),
     dict(stem_block_size=4, stem_stride=2, initial_blocks=0, window_size=0,
          k_block_num_rate_medium=0.05, k_block_num_bias_medium=1,
          k_block_num_rate_large=0.02, k_block_num_bias_large=2)),
    ("g8-df24", dict(nq=16, nk=2, qmax=3, kmax=20, df=24, q_lens=[3], kv_lens=[20],
                     prompt=[90]),
     dict(stem_block_size=1, stem_stride=1, k_block_num_rate_medium=0.0,
          k_block_num_bias_medium=4)),
]


def _exact_params() -> list:
    """Every EXACT shape with every pair of PRECISION_CONFIGS. The default run
    keeps one pair per shape, the first two in turn (each shape once, each of
    the two pairs twice)."""
    out = []
    for n, entry in enumerate(EXACT):
        for m, (precision, config, name) in enumerate(PRECISION_CONFIGS):
            slow = m != (n + 1) % 2
            out.append(pytest.param(*entry, precision, config, id=f"{entry[0]}-p{precision}-{name}",
                                    marks=[pytest.mark.slow] if slow else []))
    return out


@interpreted
@pytest.mark.parametrize("label,shape,attrs,precision,config", _exact_params())
def test_exact_scores_identical_to_reference_and_cpu(label, shape, attrs, precision, config):
    gen = torch.Generator().manual_seed(len(label) * 7 + precision)
    inp = random_inputs(gen, batch=len(shape["q_lens"]), integer=True, **shape)
    params = dict(attrs, topk_score_precision=precision)
    expected = run_ref(inp, **params)
    assert int(expected[1].sum()) > 0
    assert_out_equal(run_triton(inp, config, **params), expected, f"triton {label}")
    assert_out_equal(run_cpu_op(inp, **params), expected, f"cpu {label}")


# --------------------------------------------------------------------------- #
# Small cases of the table, judged as the runner judges them
# --------------------------------------------------------------------------- #

TABLE_SUBSET = ("SI_WB_003", "SI_WB_004", "SI_WB_006", "SI_WB_007", "SI_WB_009", "SI_WB_012",
                "SI_WB_113", "SI_WB_014", "SI_WB_030", "SI_WB_133")


@interpreted
@pytest.mark.slow
@pytest.mark.parametrize("case", [cases.get_case(c) for c in TABLE_SUBSET],
                         ids=lambda c: c.label)
def test_case_table_subset(case):
    raw = case.make_inputs()
    inp = Inputs(**raw)
    params = case.op_kwargs()
    actual = run_triton(inp, **params)
    cpu = run_cpu_op(inp, **params)
    result = compare.compare(actual, cpu, raw, case.params)
    assert result.ok, result.summary()
    if case.data == "integer":
        assert_out_equal(actual, cpu, case.id)


# --------------------------------------------------------------------------- #
# Checks of the launcher itself
# --------------------------------------------------------------------------- #


@interpreted
def test_launcher_stays_in_bounds_with_metadata_for_other_inputs():
    """The launcher trusts its inputs (inside a CUDA-graph capture nothing else
    checks them): metadata built for other lengths, or with a plan pointing
    past the batch, still gives outputs of the right shape, every written
    index a key block or -1, and no access outside the tensors."""
    gen = torch.Generator().manual_seed(0)
    inp = random_inputs(gen, batch=2, nq=2, nk=1, qmax=2, kmax=8, df=4, q_lens=[2, 1],
                        kv_lens=[8, 5])
    other = random_inputs(gen, batch=2, nq=2, nk=1, qmax=2, kmax=8, df=4, q_lens=[2, 2],
                          kv_lens=[8, 8])
    p = IndexerParams(stem_block_size=1, stem_stride=1)
    wild = metadata_for(other, stem_block_size=1, stem_stride=1).clone()
    wild[16 + 4:16 + 4 + 8] = torch.tensor([5, -3, 9, 100, 1, 7, 2, 3], dtype=torch.int32)
    for md in (metadata_for(other, stem_block_size=1, stem_stride=1), wild):
        idx, seq_len = launch.stem_indexer_triton(*inp.tensors(), None, md, p, poison=POISON)
        assert idx.shape == (2, 2, 2, 8) and seq_len.shape == (2, 2, 2)
        written = idx[idx != POISON]
        assert bool(((written >= -1) & (written < 8)).all())


@interpreted
def test_selection_grid_split_in_launches(monkeypatch):
    # A grid larger than CUDA's limit is split into launches with offsets: the
    # limit lowered to 3 programs gives the same output in many launches.
    gen = torch.Generator().manual_seed(11)
    inp = random_inputs(gen, batch=2, nq=4, nk=2, qmax=5, kmax=40, df=8, q_lens=[5, 3],
                        kv_lens=[40, 23], prompt=[70, 60], integer=True)
    params = dict(stem_block_size=1, stem_stride=1, k_block_num_bias_medium=3,
                  k_block_num_rate_medium=0.05)
    monkeypatch.setattr(launch, "MAX_GRID", 3)
    assert_out_equal(run_triton(inp, **params), run_ref(inp, **params), "split grid")


@pytest.mark.skipif(launch.INTERPRETED, reason="the kernels are interpreted here")
def test_cpu_tensors_need_the_interpreter():
    inp = _one_row([1, 2, 3, 4])
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        run_triton(inp, **HAND)


# --------------------------------------------------------------------------- #
# Real CUDA (skipped without a GPU, and in the interpreter's process)
# --------------------------------------------------------------------------- #

cuda = pytest.mark.skipif(not torch.cuda.is_available() or launch.INTERPRETED,
                          reason="needs CUDA and compiled kernels")
CUDA_CASES = ("SI_WB_001", "SI_WB_003", "SI_WB_103", "SI_WB_013", "SI_WB_024", "SI_WB_045",
              "SI_WB_061", "SI_WB_077", "SI_WB_094", "SI_WB_165")


@cuda
@pytest.mark.parametrize("case_id", CUDA_CASES)
def test_cuda_op_matches_cpu_path(case_id):
    case = cases.get_case(case_id)
    raw = case.make_inputs()
    md = torch.ops.custom.npu_stem_indexer_metadata(
        raw["q_seq_lens"], raw["kv_seq_lens"], case.q_heads, case.kv_heads,
        causal=case.params.causal, stem_block_size=case.params.stem_block_size,
        dim_qkflat=case.dim, window_size=case.params.window_size)
    args = [raw[k] for k in ("qflat", "kflat", "vbias", "q_seq_lens", "kv_seq_lens")]
    prompt = raw["num_prompt_tokens"]
    cpu = torch.ops.custom.npu_stem_indexer(*args, num_prompt_tokens=prompt, metadata=md,
                                            **case.op_kwargs())
    dev = [a.cuda() for a in args]
    out = torch.ops.custom.npu_stem_indexer(
        *dev, num_prompt_tokens=None if prompt is None else prompt.cuda(), metadata=md.cuda(),
        **case.op_kwargs())
    out = tuple(t.cpu() for t in out)
    result = compare.compare(out, cpu, raw, case.params)
    assert result.ok, result.summary()
    if case.data == "integer":
        assert_out_equal(out, cpu, case_id)


@cuda
def test_cuda_graph_capture_replays_identically():
    gen = torch.Generator().manual_seed(5)
    inp = random_inputs(gen, batch=3, nq=4, nk=2, qmax=6, kmax=64, df=32, q_lens=[6, 1, 4],
                        kv_lens=[64, 40, 20], prompt=[100, 200, 20], integer=True)
    params = dict(stem_block_size=1, stem_stride=1, k_block_num_bias_medium=5,
                  k_block_num_rate_large=0.05)
    expected = run_ref(inp, **params)
    dev = inp.to("cuda")
    md = metadata_for(dev, **params)

    def call():
        return torch.ops.custom.npu_stem_indexer(*dev.tensors(),
                                                 num_prompt_tokens=dev.num_prompt_tokens,
                                                 metadata=md, **params)

    call()  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert_out_equal(tuple(t.cpu() for t in captured), expected, "graph replay")
    compiled = torch.compile(call, mode="reduce-overhead")
    for _ in range(3):
        assert_out_equal(tuple(t.cpu() for t in compiled()), expected, "reduce-overhead")
