"""Tiny hand-computed cases that pin docs/CONTRACT.md section 3 (semantics of one row).

Every expected row below was derived by hand from docs/CONTRACT.md section 3; the
derivation is in the comment next to it. Each case runs through
``stem_indexer.stem_indexer``, the raw ``torch.ops.custom.npu_stem_indexer``
(with metadata from the metadata op), both on the ``device`` of the
conftest fixture (cpu; cuda when available), and ``stem_indexer_reference``;
all three must equal the hand truth exactly.

Conventions used by most cases (so scores are trivially exact):

* ``stem_block_size = stem_stride = 1``: R = 1, scale 1/R^2 = 1, and every
  token is one block, so q/kv lengths are block counts;
* ``Df = 1`` and ``qflat = 1``: the score of key block j is
  ``S[j] = kflat[j] + vbias[j]``;
* a budget K chosen directly: ``num_prompt_tokens = 56`` gives P = 56 (the
  medium branch), and with ``k_block_num_rate_medium = 0`` the initial budget
  is ``Ks = floor(f32(56 * 0)) + bias_medium = bias_medium``; with the default
  ``alpha = 1`` the decayed value is ``floor(t * (Ks - Ks) + Ks) = Ks``, so
  K = bias_medium for every row.
"""

from __future__ import annotations

import math

import pytest
import torch

from stem_indexer.operator import contract
from stem_indexer.operator.reference import reference_row_selection

from _helpers import check_all_paths, expected_tensors, make_inputs

pytestmark = pytest.mark.selections  # CPU: native and torch selection

NAN, INF = math.nan, math.inf
UNIT = dict(stem_block_size=1, stem_stride=1)


def fixed_k(k: int, **extra) -> dict:
    """Params giving budget K = ``k`` for prompts of 56 blocks (see module doc)."""
    return dict(UNIT, k_block_num_rate_medium=0.0, k_block_num_bias_medium=k, **extra)


def one_row(scores_k, vbias=None, *, q_len=1, prompt=56):
    """One batch, one head, one query block (Df=1, q=1): S[j] = k[j] + vbias[j]."""
    kv = len(scores_k)
    vbias = [0.0] * kv if vbias is None else vbias
    return make_inputs([[[[1.0]]]], [[[[x] for x in scores_k]]], [[vbias]], [q_len], [kv],
                       None if prompt is None else [prompt])


def expect_one_row(row, kmax):
    return expected_tensors([[[row]]], kmax)


# --------------------------------------------------------------------------- #
# Ties
# --------------------------------------------------------------------------- #

# S = [1, 3, 3, 2, 3]; no forced blocks, all five are candidates. Ranked
# (score desc, index asc): 1, 2, 4 (the three 3s, lower index first), 3, 0.
@pytest.mark.parametrize("precision", [1, 2], ids=["fp32-rank", "bf16-rank"])
@pytest.mark.parametrize("k, row", [
    pytest.param(1, [1], id="K1-picks-first-of-three-ties"),
    pytest.param(2, [1, 2], id="K2-two-lowest-tied"),
    pytest.param(3, [1, 2, 4], id="K3-all-tied"),
    pytest.param(4, [1, 2, 3, 4], id="K4-next-score"),
])
def test_tie_goes_to_lower_block_index(k, row, precision, device):
    inp = one_row([1, 3, 3, 2, 3])
    check_all_paths(device, inp, expect_one_row(row, 5),
                    **fixed_k(k, initial_blocks=0, window_size=0, topk_score_precision=precision))


# Scores distinct in float32 but equal after bfloat16 rounding (round to
# nearest even, 8 significant bits: the spacing of bf16 at 1.0 is 2^-7).
# K = 1, no forced blocks.
@pytest.mark.parametrize("vb, fp32_row, bf16_row", [
    # S = [1, 1 + 2^-10, 0.5]. fp32: block 1 is highest. bf16(1 + 2^-10) = 1
    # (below half a spacing), tie with block 0 -> the lower index, 0.
    pytest.param([0.0, 2.0**-10, 0.0], [1], [0], id="below-half-ulp"),
    # S = [1, 1 + 2^-8, 0.5]: exactly half a spacing; ties-to-even rounds to
    # 1.0 (even mantissa), tie with block 0 -> 0. (Round-half-up would give 1.)
    pytest.param([0.0, 2.0**-8, 0.0], [1], [0], id="half-ulp-rounds-down-to-even"),
    # S = [1 + 2^-7, 1 + 3*2^-8, 0.5]: 1 + 3*2^-8 is halfway between 1 + 2^-7
    # (odd mantissa 1) and 1 + 2^-6 (even mantissa 2); ties-to-even gives
    # 1 + 2^-6 > 1 + 2^-7, so block 1 wins under both precisions.
    # (Truncating to bf16 would tie and pick 0.)
    pytest.param([2.0**-7, 3 * 2.0**-8, 0.0], [1], [1], id="half-ulp-rounds-up-to-even"),
    # S = [1 + 2^-10, 1.0, 0.5]: fp32 picks 0 (higher); bf16 ties -> still 0.
    pytest.param([2.0**-10, 0.0, 0.0], [0], [0], id="bf16-tie-lower-index-also-fp32-max"),
])
def test_bf16_ranking_rounds_scores_to_nearest_even(vb, fp32_row, bf16_row, device):
    inp = one_row([1.0, 1.0, 0.5], vb)
    base = fixed_k(1, initial_blocks=0, window_size=0)
    check_all_paths(device, inp, expect_one_row(fp32_row, 3), **base, topk_score_precision=1)
    check_all_paths(device, inp, expect_one_row(bf16_row, 3), **base, topk_score_precision=2)


def test_plus_zero_equals_minus_zero_in_the_ranking(device):
    """S = [-0.0, +0.0, -1]: a tie, so the lower index (the -0.0 block) wins.

    A -0.0 score needs an underflow: Bs = 512, Ts = 1 gives R = 512 and scale
    2^-18; q = -2^-66, k0 = 2^-67: dot = -2^-133 (an f32 denormal), times
    2^-18 = -2^-151, which rounds to -0.0; + vbias (-0.0) stays -0.0.
    Block 1: dot 0 -> +0.0, + vbias +0.0 = +0.0. Block 2: 0 + (-1) = -1.
    K = 1 (prompt 56 blocks of 512 tokens, rate 0, bias 1), no forced blocks.
    Ranking +0.0 above -0.0 (raw bit order) would pick block 1 instead.
    """
    bs = 512
    inp = make_inputs([[[[-2.0**-66]]]], [[[[2.0**-67], [0.0], [0.0]]]],
                      [[[-0.0, 0.0, -1.0]]], [1], [3 * bs], [56 * bs])
    # Precondition: the float32 score of block 0 really is -0.0 here.
    s = (inp.qflat[0, 0].float() @ inp.kflat[0, 0].float().T)[0] * 2.0**-18 + inp.vbias[0, 0]
    assert s.tolist() == [0.0, 0.0, -1.0] and torch.signbit(s).tolist() == [True, False, True]
    for precision in (1, 2):
        check_all_paths(device, inp, expect_one_row([0], 3), stem_block_size=bs, stem_stride=1,
                        k_block_num_rate_medium=0.0, k_block_num_bias_medium=1,
                        initial_blocks=0, window_size=0, topk_score_precision=precision)


def test_rank_keys_zero_signs_and_nan_unit():
    # Same facts at the helper level: -0.0 == +0.0, NaN == -inf, order by index.
    scores = torch.tensor([[-0.0, 0.0, NAN, -INF, 1.0, -NAN]])
    for precision in (1, 2):
        keys = contract.rank_keys(scores, 10, precision)
        order = contract.block_of_key(keys.sort(descending=True).values).tolist()
        assert order == [[14, 10, 11, 12, 13, 15]]
    assert reference_row_selection([-0.0, 0.0, -1.0], 3, 1, 0, 0) == [0]
    assert reference_row_selection([NAN, -INF, -1.0, NAN, 2.0], 5, 3, 0, 0) == [0, 2, 4]


# --------------------------------------------------------------------------- #
# NaN
# --------------------------------------------------------------------------- #

# S = [NaN, -inf, -1, NaN, 2] (NaN and -inf via vbias). NaN ranks as -inf, so
# the ranking is 4 (2), 2 (-1), then the -inf tie {0, 1, 3} by index: 0, 1, 3.
# (NaN as the largest value would pick 0 and 3 first; NaN below -inf would
# put 1 before 0.)
@pytest.mark.parametrize("precision", [1, 2], ids=["fp32-rank", "bf16-rank"])
@pytest.mark.parametrize("k, row", [
    pytest.param(2, [2, 4], id="K2"),
    pytest.param(3, [0, 2, 4], id="K3-nan-ties-minus-inf-lower-index"),
    pytest.param(4, [0, 1, 2, 4], id="K4"),
    pytest.param(5, [0, 1, 2, 3, 4], id="K5-all"),
])
def test_nan_score_ranks_as_minus_inf(k, row, precision, device):
    inp = one_row([0, 0, -1, 0, 2], [NAN, -INF, 0.0, NAN, 0.0])
    check_all_paths(device, inp, expect_one_row(row, 5),
                    **fixed_k(k, initial_blocks=0, window_size=0, topk_score_precision=precision))


def test_nan_in_kflat_ranks_as_minus_inf(device):
    # k = [NaN, 1, -2, 3], vbias 0 -> S = [NaN, 1, -2, 3]; K = 3:
    # ranking 3 (3), 1 (1), 2 (-2), 0 (NaN = -inf) -> {1, 2, 3}.
    inp = one_row([NAN, 1, -2, 3])
    check_all_paths(device, inp, expect_one_row([1, 2, 3], 4),
                    **fixed_k(3, initial_blocks=0, window_size=0))


# --------------------------------------------------------------------------- #
# Causal alignment, early rows, non-causal
# --------------------------------------------------------------------------- #


def test_causal_q_longer_than_kv_early_rows_see_nothing(device):
    """q = 5 blocks, kv = 3 blocks, causal, right-down aligned:
    s2 = clamp(Kb - Qb + i + 1, 0, Kb) = clamp(i - 1, 0, 3) = [0, 0, 1, 2, 3].
    Default budget: P = Kb = 3 < 56 -> K = 3 >= every candidate count, so every
    visible block is kept (sink 1 / window 1 only change who is forced)."""
    inp = make_inputs([[[[1.0]] * 5]], [[[[3.0], [1.0], [2.0]]]], [[[0.0, 0.0, 0.0]]], [5], [3])
    rows = [[], [], [0], [0, 1], [0, 1, 2]]
    check_all_paths(device, inp, expected_tensors([[rows]], 3), **UNIT, initial_blocks=1,
                    window_size=1)


def test_non_causal_q_longer_than_kv_every_row_sees_all(device):
    # Non-causal: s2 = Kb = 3 for all five rows; K = 3 (P = 3) -> keep all.
    inp = make_inputs([[[[1.0]] * 5]], [[[[3.0], [1.0], [2.0]]]], [[[0.0, 0.0, 0.0]]], [5], [3])
    rows = [[0, 1, 2]] * 5
    check_all_paths(device, inp, expected_tensors([[rows]], 3), **UNIT, causal=False,
                    initial_blocks=1, window_size=1)


# q = 4 blocks, kv = 8 blocks, S = k = [0, 5, 1, 7, 2, 9, 3, 4], sink 1,
# window 1, K = 1.
CAUSAL_K = [0, 5, 1, 7, 2, 9, 3, 4]


def test_causal_rows_see_growing_prefix(device):
    """s2 = clamp(8 - 4 + i + 1, 0, 8) = i + 5 = [5, 6, 7, 8].
    i=0: visible 0..4, forced {0, 4}, candidates 1..3 (5, 1, 7) -> 3: [0, 3, 4]
    i=1: visible 0..5, forced {0, 5}, candidates 1..4 (5, 1, 7, 2) -> 3: [0, 3, 5]
    i=2: visible 0..6, forced {0, 6}, candidates 1..5 (.., 9 at 5) -> 5: [0, 5, 6]
    i=3: visible 0..7, forced {0, 7}, candidates 1..6 -> 5: [0, 5, 7]
    Block 5 (the best score, 9) is in the future of rows 0 and 1.
    K = 1 for all rows: pos = i + 4 >= Ks = 1 but alpha = 1 keeps K = Ks."""
    inp = make_inputs([[[[1.0]] * 4]], [[[[x] for x in CAUSAL_K]]], [[[0.0] * 8]], [4], [8],
                      [56])
    rows = [[0, 3, 4], [0, 3, 5], [0, 5, 6], [0, 5, 7]]
    check_all_paths(device, inp, expected_tensors([[rows]], 8), **fixed_k(1, initial_blocks=1,
                                                                   window_size=1))


def test_non_causal_rows_see_everything(device):
    # Same inputs, causal=False: s2 = 8 for all rows, forced {0, 7}, candidates
    # 1..6 -> block 5 (score 9) for every row: [0, 5, 7].
    inp = make_inputs([[[[1.0]] * 4]], [[[[x] for x in CAUSAL_K]]], [[[0.0] * 8]], [4], [8],
                      [56])
    rows = [[0, 5, 7]] * 4
    check_all_paths(device, inp, expected_tensors([[rows]], 8),
                    **fixed_k(1, initial_blocks=1, window_size=1, causal=False))


def test_tail_blocks_and_score_scale_one_over_r_squared(device):
    """Bs = 2, Ts = 1: R = 2, scale 1/4. q = 3 tokens -> Qb = 2 (tail block),
    kv = 7 tokens -> Kb = 4 (tail block); Qmax = 3, Kmax = 5 (padding).
    Causal: s2 = clamp(4 - 2 + i + 1, 0, 4) = [3, 4]; sink 0, window 1, K = 1
    (prompt 112 tokens -> P = 56, rate 0, bias 1).
    q0 = [4, 0], q1 = [0, 4]; k = [1,0], [2,2], [0,3], [5,5]; vbias [1.5, 0, 0, 0].
    Row 0: S = [4/4 + 1.5, 8/4, 0, 20/4] = [2.5, 2, 0, 5]; forced {2};
      candidates {0, 1}: 2.5 > 2 -> [0, 2]. (Scale 1 would give 5.5 < 8 -> block
      1; scale 1/R = 1/2 would give 3.5 < 4 -> block 1.)
    Row 1: S = [0 + 1.5, 8/4, 12/4, 20/4] = [1.5, 2, 3, 5]; forced {3};
      candidates {0, 1, 2} -> 2: [2, 3].
    Row 2 is past Qb: empty."""
    garbage = [NAN, NAN]
    inp = make_inputs([[[[4.0, 0.0], [0.0, 4.0], garbage]]],
                      [[[[1.0, 0.0], [2.0, 2.0], [0.0, 3.0], [5.0, 5.0], garbage]]],
                      [[[1.5, 0.0, 0.0, 0.0, NAN]]], [3], [7], [112])
    rows = [[0, 2], [2, 3], []]
    check_all_paths(device, inp, expected_tensors([[rows]], 5), stem_block_size=2, stem_stride=1,
                    k_block_num_rate_medium=0.0, k_block_num_bias_medium=1,
                    initial_blocks=0, window_size=1)


# --------------------------------------------------------------------------- #
# Forced sink/window blocks
# --------------------------------------------------------------------------- #


def test_forced_sink_window_overlap_and_clipping(device):
    """Five batches, one query block each (so s2 = Kb, causal or not), sink 4,
    window 4, K = 1, S = k = [0, 0, 0, 0, 1, 2, 0, 0, 0, 0] (truncated to Kb).
    b0 kv 4:  sink {0..3}, window {0..3}: full overlap, no candidate -> 0..3
    b1 kv 7:  sink {0..3}, window {3..6}: partial overlap -> 0..6
    b2 kv 10: sink {0..3}, window {6..9}: no overlap, candidates {4, 5},
              K = 1 -> 5 (score 2 > 1): [0, 1, 2, 3, 5, 6, 7, 8, 9]
    b3 kv 2:  s2 = 2 < initial_blocks: sink clipped to {0, 1} -> [0, 1]
    b4 kv 9:  sink {0..3}, window {5..8}, candidates {4} and K = 1:
              s2 = forced + budget exactly -> all nine blocks
    (b2 is "one past": s2 = forced + budget + 1 drops one block.)"""
    kv = [4, 7, 10, 2, 9]
    k = [0, 0, 0, 0, 1, 2, 0, 0, 0, 0]
    inp = make_inputs([[[[1.0]]]] * 5, [[[[x] for x in k]]] * 5, [[[0.0] * 10]] * 5,
                      [1] * 5, kv, [56] * 5)
    rows = [[[[0, 1, 2, 3]]], [[list(range(7))]], [[[0, 1, 2, 3, 5, 6, 7, 8, 9]]],
            [[[0, 1]]], [[list(range(9))]]]
    check_all_paths(device, inp, expected_tensors(rows, 10), **fixed_k(1))


def test_forced_blocks_kept_whatever_their_score(device):
    """Sink 1 and window 1 with vbias -1e30 (and NaN) on the forced blocks:
    kv 8, S = [-1e30, 1, 7, 3, 8, 9, 2, NaN], K = 3. Forced {0, 7};
    candidates 1..6 scores 1, 7, 3, 8, 9, 2 -> ranked 5, 4, 2: the output is
    ascending [0, 2, 4, 5, 7], not in rank order."""
    inp = one_row([0, 1, 7, 3, 8, 9, 2, 0], [-1e30, 0, 0, 0, 0, 0, 0, NAN])
    check_all_paths(device, inp, expect_one_row([0, 2, 4, 5, 7], 8),
                    **fixed_k(3, initial_blocks=1, window_size=1))


# kv 6, S = k = [4, 1, 6, 2, 5, 3], K = 2.
@pytest.mark.parametrize("init, window, k, row", [
    # no forced blocks: top 2 of all = 2 (6), 4 (5)
    pytest.param(0, 0, 2, [2, 4], id="sink0-window0"),
    # sink {0, 1}; candidates 2..5 (6, 2, 5, 3) -> 2, 4
    pytest.param(2, 0, 2, [0, 1, 2, 4], id="sink2-window0"),
    # window {4, 5}; candidates 0..3 (4, 1, 6, 2) -> 0, 2
    pytest.param(0, 2, 2, [0, 2, 4, 5], id="sink0-window2"),
    # K = 0 and nothing forced: a visible row that selects nothing
    pytest.param(0, 0, 0, [], id="sink0-window0-K0-empty"),
    # K = 0: only the forced blocks
    pytest.param(1, 1, 0, [0, 5], id="sink1-window1-K0-forced-only"),
    # sink/window larger than the row: everything forced
    pytest.param(9, 9, 0, [0, 1, 2, 3, 4, 5], id="sink9-window9-all-forced"),
    # window only larger than the row
    pytest.param(0, 7, 0, [0, 1, 2, 3, 4, 5], id="sink0-window7-all-forced"),
])
def test_zero_sink_or_window(init, window, k, row, device):
    inp = one_row([4, 1, 6, 2, 5, 3])
    check_all_paths(device, inp, expect_one_row(row, 6),
                    **fixed_k(k, initial_blocks=init, window_size=window))


@pytest.mark.parametrize("k, row", [
    # kv 6, sink 1, window 1: candidates 1..4 with S = 5, 1, 7, 2.
    pytest.param(10, [0, 1, 2, 3, 4, 5], id="K10-more-than-4-candidates"),
    pytest.param(4, [0, 1, 2, 3, 4, 5], id="K4-equals-candidates"),
    # K = 3 < 4 candidates: 3 (7), 1 (5), 4 (2) kept; block 2 (1) dropped
    pytest.param(3, [0, 1, 3, 4, 5], id="K3-one-fewer-drops-lowest"),
])
def test_budget_limited_by_candidates(k, row, device):
    inp = one_row([0, 5, 1, 7, 2, 0])
    check_all_paths(device, inp, expect_one_row(row, 6),
                    **fixed_k(k, initial_blocks=1, window_size=1))


# --------------------------------------------------------------------------- #
# Empty rows and batches, -1 padding
# --------------------------------------------------------------------------- #


def test_rows_past_qb_and_empty_batches_are_all_minus_one(device):
    """Bs = Ts = 1, Qmax = Kmax = 3, causal, default sink/window 4, default
    budget (P = Kb, so every visible block is kept).
    b0 q 2, kv 3: Qb 2, Kb 3, s2 = i + 2: row 0 -> [0, 1], row 1 -> [0, 1, 2],
                  row 2 (i >= Qb) -> empty.
    b1 q 0, kv 3; b2 q 3, kv 0; b3 q 0, kv 0: Qb = 0 or Kb = 0 -> all empty.
    The inputs of the empty batches are NaN: never read."""
    q = [[[[1.0]] * 3], [[[NAN]] * 3], [[[NAN]] * 3], [[[NAN]] * 3]]
    k = [[[[1.0], [2.0], [3.0]]], [[[NAN]] * 3], [[[NAN]] * 3], [[[NAN]] * 3]]
    v = [[[0.0] * 3], [[NAN] * 3], [[NAN] * 3], [[NAN] * 3]]
    inp = make_inputs(q, k, v, [2, 0, 3, 0], [3, 3, 0, 0])
    rows = [[[[0, 1], [0, 1, 2], []]], [[[], [], []]], [[[], [], []]], [[[], [], []]]]
    check_all_paths(device, inp, expected_tensors(rows, 3), **UNIT)
    check_all_paths(device, inp, expected_tensors(
        [[[[0, 1, 2], [0, 1, 2], []]], [[[], [], []]], [[[], [], []]], [[[], [], []]]], 3),
        **UNIT, causal=False)


def test_kflat_with_zero_key_blocks(device):
    """Kmax = 0 (only qflat must have no zero dim): kv lengths are 0, so every
    row is empty and sparse_indices has shape (B, Nq, Qmax, 0)."""
    inp = make_inputs([[[[1.0]], [[2.0]]]], [[[[0.0]]]], [[[0.0]]], [1], [0])
    inp.kflat, inp.vbias = inp.kflat[:, :, :0], inp.vbias[:, :, :0]
    check_all_paths(device, inp, expected_tensors([[[[]], [[]]]], 0), **UNIT)


# --------------------------------------------------------------------------- #
# vbias and GQA
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("vb, row", [
    # S = k = [2, 3, 1, 0] -> 1
    pytest.param([0.0, 0.0, 0.0, 0.0], [1], id="no-bias-picks-1"),
    # S = [2, 3, 3.5, 0] -> 2
    pytest.param([0.0, 0.0, 2.5, 0.0], [2], id="bias-lifts-2"),
    # S = [2.25, 2.75, 1, 0] -> 1 still (bias too small to reorder)
    pytest.param([0.25, -0.25, 0.0, 0.0], [1], id="small-bias-no-change"),
    # S = [2 + 1.5, 3, 1, 0] -> 0
    pytest.param([1.5, 0.0, 0.0, 0.0], [0], id="bias-lifts-0"),
])
def test_vbias_changes_the_selection(vb, row, device):
    inp = one_row([2, 3, 1, 0], vb)
    check_all_paths(device, inp, expect_one_row(row, 4),
                    **fixed_k(1, initial_blocks=0, window_size=0))


def test_gqa_head_h_uses_kv_head_h_div_g(device):
    """Nq = 4, Nk = 2 (G = 2): heads 0, 1 use kv head 0; heads 2, 3 use kv head 1.
    kflat kv0 = [1, 3, 2, 0], kv1 = [0, 2, 3, 1]; qflat = +1, -1, +1, -1.
    h0 (kv0, +1): argmax [1, 3, 2, 0] = 1        h1 (kv0, -1): argmax [-1, -3, -2, 0] = 3
    h2 (kv1, +1): argmax [0, 2, 3, 1] = 2        h3 (kv1, -1): argmax [0, -2, -3, -1] = 0
    (The wrong mapping h % Nk would give h1 -> 0 and h2 -> 1.) K = 1, no forced.
    A vbias on kv head 1 only (+10 on block 1) must move heads 2 and 3 only."""
    q = [[[[1.0]], [[-1.0]], [[1.0]], [[-1.0]]]]
    k = [[[[1.0], [3.0], [2.0], [0.0]], [[0.0], [2.0], [3.0], [1.0]]]]
    params = fixed_k(1, initial_blocks=0, window_size=0)
    inp = make_inputs(q, k, [[[0.0] * 4, [0.0] * 4]], [1], [4], [56])
    check_all_paths(device, inp, expected_tensors([[[[1]], [[3]], [[2]], [[0]]]], 4), **params)
    inp = make_inputs(q, k, [[[0.0] * 4, [0.0, 10.0, 0.0, 0.0]]], [1], [4], [56])
    # h2: [0, 12, 3, 1] -> 1; h3: [0, 8, -3, -1] -> 1; heads 0, 1 unchanged.
    check_all_paths(device, inp, expected_tensors([[[[1]], [[3]], [[1]], [[1]]]], 4), **params)


def test_gqa_heads_of_one_group_share_kflat_but_not_queries(device):
    """Nq = 3, Nk = 1 (G = 3): all heads use kv head 0, each with its own query.
    Df = 2, k = [[1, 0], [0, 1], [1, 1], [-1, -1]]; q0 = [1, 0], q1 = [0, 1],
    q2 = [-1, -1]. Scores: h0 [1, 0, 1, -1] -> tie 0/2 -> 0;
    h1 [0, 1, 1, -1] -> tie 1/2 -> 1; h2 [-1, -1, -2, 2] -> 3. K = 1."""
    q = [[[[1.0, 0.0]], [[0.0, 1.0]], [[-1.0, -1.0]]]]
    k = [[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, -1.0]]]]
    inp = make_inputs(q, k, [[[0.0] * 4]], [1], [4], [56])
    check_all_paths(device, inp, expected_tensors([[[[0]], [[1]], [[3]]]], 4),
                    **fixed_k(1, initial_blocks=0, window_size=0))


# --------------------------------------------------------------------------- #
# Budget decay inside a call (alpha < 1)
# --------------------------------------------------------------------------- #


def test_position_decay_shrinks_the_budget_of_later_rows(device):
    """Bs = Ts = 1, q = kv = 8, causal, no forced blocks, prompt 56 tokens
    (P = 56), rate 0, bias 4 -> Ks = 4; decay = 56 - 4 = 52 > 1; alpha = 0.5.
    pos = i + Kb - Qb = i. For pos < 4: K = 4. For pos >= 4:
    ks = 4, ke = 2, d = -2, t = (pos - 4)/51 <= 3/51, t*d + ks in (3.88, 4]
    -> K = 4 at pos 4 (t = 0) and K = 3 at pos 5, 6, 7.
    S = k = [8, 7, 6, 5, 4, 3, 2, 1] (descending): each row keeps its K lowest
    visible blocks (s2 = i + 1)."""
    inp = make_inputs([[[[1.0]] * 8]], [[[[8.0 - j] for j in range(8)]]], [[[0.0] * 8]],
                      [8], [8], [56])
    rows = [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2], [0, 1, 2],
            [0, 1, 2]]
    check_all_paths(device, inp, expected_tensors([[rows]], 8),
                    **fixed_k(4, initial_blocks=0, window_size=0, alpha=0.5))
