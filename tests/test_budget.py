"""The top-k budget (Token Position-Decay), docs/CONTRACT.md section 3 "Budget".

Three layers:

* hand-computed values at the branch edges, the cap, the clamp at 1, the
  no-decay rule, and float32-rounding-sensitive points (where plain float64
  arithmetic gives another integer, also checked here);
* the vectorised ``contract.prompt_budget`` + ``contract.row_budget`` (what
  the backends use) against the scalar golden ``reference.reference_budget``,
  exhaustively for small prompts and on seeded random parameters (special
  values mixed in);
* end to end: a row's ``sparse_seq_len`` is forced + min(K, candidates).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import stem_indexer
from stem_indexer.operator import contract
from stem_indexer.operator.contract import IndexerParams
from stem_indexer.operator.reference import reference_budget

from _helpers import i32

RATE_NAMES = ("k_block_num_rate_medium", "k_block_num_bias_medium",
              "k_block_num_rate_large", "k_block_num_bias_large")


def f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def contract_budgets(p: int, positions: list[int], alpha: float = 1.0, **rates) -> list[int]:
    """The vectorised contract's K at each position of a prompt of ``p`` blocks."""
    params = IndexerParams(alpha=alpha, **rates)
    pt = torch.tensor([p] * len(positions))
    ks = contract.prompt_budget(pt, params)
    return contract.row_budget(torch.tensor(positions), pt, ks, alpha).tolist()


def contract_budget(p: int, pos: int, alpha: float = 1.0, **rates) -> int:
    return contract_budgets(p, [pos], alpha, **rates)[0]


def both_budgets(p, pos, alpha=1.0, **rates):
    return (contract_budget(p, pos, alpha, **rates),
            reference_budget(p, pos, alpha=alpha, **rates))


def budget_float64(p, pos, alpha=1.0, rm=0.2, bm=30, rl=0.1, bl=30):
    """The same formula in plain float64, no float32 roundings: NOT the
    contract; used only to show that a pinned case is rounding-sensitive."""
    ks = p if p < 56 else math.floor(p * (rm if p < 160 else rl)) + (bm if p < 160 else bl)
    decay = p - ks
    if pos < ks or decay <= 1:
        k = ks
    else:
        k = min(max(math.floor((pos - ks) / (decay - 1) * (ks * alpha - ks) + ks), 1), ks)
    return min(max(k, 0), 256)


# --------------------------------------------------------------------------- #
# Hand-computed values
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("p, ks", [
    pytest.param(0, 0, id="P0"),
    pytest.param(1, 1, id="P1"),
    pytest.param(55, 55, id="P55-small-branch-Ks=P"),
    # floor(f32(56) * f32(0.2)) = floor(11.2000...) = 11; + 30
    pytest.param(56, 41, id="P56-medium-floor(11.2)+30"),
    # f32(159) * f32(0.2) = 159 * 0.20000000298 = 31.8000004..., f32 -> 31.8; floor 31; + 30
    pytest.param(159, 61, id="P159-medium-floor(31.8)+30"),
    # f32(160) * f32(0.1) = 16.0000002..., f32 -> 16.0; floor 16; + 30
    pytest.param(160, 46, id="P160-large-floor(16.0)+30"),
    # 2260 * f32(0.1) = 226.0000034 -> f32 226.0 -> 256: exactly the cap
    pytest.param(2260, 256, id="P2260-Ks256-at-cap"),
    # 2270 -> 227 + 30 = 257 -> capped to 256
    pytest.param(2270, 256, id="P2270-Ks257-capped"),
    # 1M tokens / 128 = 8192 blocks: 819 + 30 = 849 -> capped
    pytest.param(8192, 256, id="P8192-1M-tokens-capped"),
])
def test_initial_budget_at_branch_edges(p, ks):
    # pos = 0 < Ks: no decay, K = min(Ks, 256) (for P = 0, Ks = 0 and K = 0).
    assert both_budgets(p, 0) == (ks, ks)
    assert both_budgets(p, 0, alpha=0.01) == (ks, ks)


def test_branch_edge_budgets_at_the_last_position():
    # alpha = 1: K = Ks at every position (t*(ks-ks)+ks = ks).
    for p, k in ((55, 55), (56, 41), (159, 61), (160, 46)):
        for pos in range(p):
            assert both_budgets(p, pos) == (k, k), (p, pos)


# Each preset's Ks by hand at P = 55, 56, 128 (16K tokens), 159, 160, 256 (32K):
# below 56 blocks every preset keeps every block; floor(f32(P) * f32(rate)) + bias
# after, f32(0.1) rounding up by 1.5e-9 (256 * f32(0.1) = 25.6000004 -> 25).
@pytest.mark.parametrize("preset, want", [
    ("default", (55, 41, 55, 61, 46, 55)),    # 0.2 P + 30, then 0.1 P + 30
    ("serving", (55, 40, 40, 40, 46, 55)),    # 40 flat, then 0.1 P + 30
    ("balanced", (55, 21, 28, 31, 32, 41)),   # 0.1 P + 16: floor(5.6), floor(12.8), ...
    ("tight", (55, 11, 16, 17, 18, 24)),      # P / 16 + 8: floor(3.5), 8, floor(9.94), ...
])
def test_every_preset_budget_by_hand(preset, want):
    got = [both_budgets(p, 0, **stem_indexer.PRESETS[preset])
           for p in (55, 56, 128, 159, 160, 256)]
    assert got == [(k, k) for k in want]


def test_every_preset_has_its_budget_by_hand():
    assert set(stem_indexer.PRESETS) == {"default", "serving", "balanced", "tight"}


def test_clamp_at_one_with_alpha_0_01():
    """P = 400: Ks = floor(f32(400) * f32(0.1)) + 30 = floor(40.0000006 -> f32 40.0)
    + 30 = 70; decay = 330.
    pos 70: t = 0 -> K = 70.
    pos 399 (last): t = 329/329 = 1; ke = f32(70 * f32(0.01)) = 0.7;
      t*d + ks = 0.7 -> floor 0 -> clamped to 1.
    pos 300: t = f32(230/329) = 0.69908816; d = 0.7 - 70 = -69.3;
      t*d + ks = 70 - 48.4468 = 21.553 -> 21."""
    assert both_budgets(400, 69, alpha=0.01) == (70, 70)
    assert both_budgets(400, 70, alpha=0.01) == (70, 70)
    assert both_budgets(400, 399, alpha=0.01) == (1, 1)
    assert both_budgets(400, 300, alpha=0.01) == (21, 21)


def test_alpha_half_decay():
    """P = 400, Ks = 70, alpha = 0.5: ke = 35, d = -35. pos 399: t = 1 -> 35.
    pos 235: t = 165/329 = 0.50152,
    t*d + ks = 70 - 17.553 = 52.447 -> 52."""
    assert both_budgets(400, 399, alpha=0.5) == (35, 35)
    assert both_budgets(400, 235, alpha=0.5) == (52, 52)


def test_no_decay_when_decay_at_most_one():
    """P = 60 (medium), rate 0: Ks = bias.
    bias 59: decay = 1 -> no decay, K = 59 even at the last position with alpha 0.01.
    bias 58: decay = 2 -> decays: pos 58 -> t = 0 -> 58; pos 59 -> t = 1 ->
      floor(f32(58 * f32(0.01))) = floor(0.58) = 0 -> clamped to 1.
    bias 60: Ks = P, decay 0 -> K = 60. bias 100: Ks > P, decay < 0 -> K = 100."""
    rates = dict(k_block_num_rate_medium=0.0)
    assert both_budgets(60, 59, 0.01, k_block_num_bias_medium=59, **rates) == (59, 59)
    assert both_budgets(60, 58, 0.01, k_block_num_bias_medium=58, **rates) == (58, 58)
    assert both_budgets(60, 59, 0.01, k_block_num_bias_medium=58, **rates) == (1, 1)
    assert both_budgets(60, 59, 0.01, k_block_num_bias_medium=60, **rates) == (60, 60)
    assert both_budgets(60, 59, 0.01, k_block_num_bias_medium=100, **rates) == (100, 100)
    # small branch: Ks = P, decay = 0, whatever alpha
    assert both_budgets(40, 39, 0.01) == (40, 40)


def test_negative_position_is_before_decay():
    # Non-causal rows with Qb > Kb have pos = i + Kb - Qb < 0: pos < Ks -> K = Ks.
    assert both_budgets(400, -5, alpha=0.01) == (70, 70)


def test_zero_budget():
    # rate 0 and bias 0: Ks = 0 for 56 <= P < 160; decayed K = min(max(0, 1), 0) = 0.
    rates = dict(k_block_num_rate_medium=0.0, k_block_num_bias_medium=0)
    assert both_budgets(100, 0, **rates) == (0, 0)
    assert both_budgets(100, 99, alpha=0.5, **rates) == (0, 0)


# --------------------------------------------------------------------------- #
# float32-rounding-sensitive cases (found by a search over P, pos and rates;
# float64 arithmetic gives another integer)
# --------------------------------------------------------------------------- #


def test_float32_rounding_of_the_decay_interpolation():
    """P = 91, pos = 83, alpha = 0.7, default rates.
    Ks = floor(f32(91 * f32(0.2))) + 30 = floor(18.2) + 30 = 48; decay = 43.
    In exact arithmetic t*d + ks = 48 + (35/42) * (0.7*48 - 48) = 48 - 12 = 36,
    an integer boundary, so the roundings decide:
      ke = f32(48 * f32(0.7)) = f32(33.59999942779541) = 33.599998474121094
      d  = f32(ke - 48) = -14.400001525878906
      t  = f32(35 / 42) = 0.8333333134651184
      t*d + ks = 36.0000 (one rounding) -> floor 36.
    Float64 throughout gives 35.99999999999999 -> 35."""
    ks32 = f32(48.0)
    ke = f32(ks32 * f32(0.7))
    assert ke == 33.599998474121094
    d = f32(ke - ks32)
    t = f32(f32(35.0) / f32(42.0))
    assert (d, t) == (-14.400001525878906, 0.8333333134651184)
    assert f32(t * d + ks32) == 36.0
    assert both_budgets(91, 83, alpha=0.7) == (36, 36)
    assert budget_float64(91, 83, alpha=0.7) == 35  # the sensitivity is real


@pytest.mark.parametrize("p, rates, ks, ks_float64", [
    # f32(0.29) = 0.28999999165534973; 100 * that = 28.999999165..., rounded to
    # f32 -> 29.0 exactly -> floor 29. Float64: 100 * 0.29 = 28.999999999999996 -> 28.
    pytest.param(100, dict(k_block_num_rate_medium=0.29, k_block_num_bias_medium=0), 29, 28,
                 id="medium-rate0.29-P100-f32-rounds-up"),
    # f32(0.65) = 0.6499999761581421; 180 * that = 116.99999570846558 -> f32
    # 116.99999237060547 -> 116 + 30. Float64: 180 * 0.65 = 117.0 -> 147.
    pytest.param(180, dict(k_block_num_rate_large=0.65, k_block_num_bias_large=30), 146, 147,
                 id="large-rate0.65-P180-f32-rounds-down"),
])
def test_float32_rounding_of_the_initial_budget(p, rates, ks, ks_float64):
    assert both_budgets(p, 0, **rates) == (ks, ks)
    short = {"k_block_num_rate_medium": "rm", "k_block_num_bias_medium": "bm",
             "k_block_num_rate_large": "rl", "k_block_num_bias_large": "bl"}
    assert budget_float64(p, 0, **{short[k]: v for k, v in rates.items()}) == ks_float64


def test_float64_differs_somewhere_for_default_rates_exhaustive_range():
    """Sanity of the exhaustive test below: within P <= 400 and alpha 0.7 there
    are positions where float64 arithmetic would give another K, so the
    exhaustive comparison really exercises the float32 roundings."""
    diffs = [(p, pos) for p in range(56, 401) for pos in range(p)
             if budget_float64(p, pos, 0.7) != reference_budget(p, pos, alpha=0.7)]
    assert (91, 83) in diffs and len(diffs) >= 5


# --------------------------------------------------------------------------- #
# contract (vectorised) == reference (scalar)
# --------------------------------------------------------------------------- #


def _all_pairs(p_max: int):
    ps, poss = [], []
    for p in range(p_max + 1):
        for pos in range(-2, p):
            ps.append(p)
            poss.append(pos)
    return ps, poss


@pytest.mark.parametrize("alpha", [1.0, 0.7, 0.5, 0.01])
def test_contract_budget_equals_reference_exhaustive(alpha):
    ps, poss = _all_pairs(400)
    params = IndexerParams(alpha=alpha)
    p = torch.tensor(ps)
    got = contract.row_budget(torch.tensor(poss), p, contract.prompt_budget(p, params), alpha)
    want = [reference_budget(a, b, alpha=alpha) for a, b in zip(ps, poss)]
    assert got.tolist() == want


# Special values the random parameters mix in (a third of the draws each):
# the branch edges, zero and one, subnormals and values past float32's range.
P_SPECIAL = (0, 1, 55, 56, 159, 160, 2**31 - 1)
RATE_SPECIAL = (0.0, 0.1, 0.2, 1.0, 0.29, 0.65, 2.0, 5e-324, 1e-40, 1e38, 3.5e38, 1e300)
BIAS_SPECIAL = (0, 1, 255, 256, 2**31, 2**62, 2**63 - 1)
ALPHA_SPECIAL = (1.0, 0.5, 0.01, 5e-324, 1e-30, 0.7)


def _random_budget_params(rng: random.Random) -> tuple[int, float, dict]:
    """(P, alpha, rates and biases), each drawn from its special values or a range."""
    def one_of(*draws):
        return rng.choice(draws)()

    p = one_of(lambda: rng.choice(P_SPECIAL), lambda: rng.randint(0, 400),
               lambda: rng.randint(0, 2**31 - 1))
    alpha = one_of(lambda: rng.choice(ALPHA_SPECIAL), lambda: 1.0 - rng.random())  # (0, 1]
    rates = {}
    for branch in ("medium", "large"):
        rates[f"k_block_num_rate_{branch}"] = one_of(
            lambda: rng.choice(RATE_SPECIAL), lambda: rng.uniform(0.0, 2.0),
            lambda: rng.uniform(0.0, 1e6))
        rates[f"k_block_num_bias_{branch}"] = one_of(
            lambda: rng.choice(BIAS_SPECIAL), lambda: rng.randint(0, 300))
    return p, alpha, rates


def test_contract_budget_equals_reference_random():
    """2,000 seeded random parameter sets, each at positions -1, 0, P - 1 and
    one drawn in [0, P): the vectorised contract equals the scalar reference."""
    rng = random.Random(2024)
    for _ in range(2000):
        p, alpha, rates = _random_budget_params(rng)
        positions = sorted({-1, 0, p - 1, rng.randrange(max(p, 1))})
        got = contract_budgets(p, positions, alpha, **rates)
        want = [reference_budget(p, pos, alpha=alpha, **rates) for pos in positions]
        assert got == want, (p, positions, alpha, rates)
        assert all(0 <= k <= 256 for k in got), (p, positions, alpha, rates)


# --------------------------------------------------------------------------- #
# End to end: seq_len = forced + min(K, |C|)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("prompt_blocks, k, seq_len", [
    # kv = 55 blocks (tail: 55*128 - 3 tokens), one query block: s2 = 55,
    # pos = 54, sink 4 + window 4 -> 8 forced, 47 candidates.
    pytest.param(55, 55, 8 + 47, id="P55-K55-all-candidates"),
    pytest.param(56, 41, 8 + 41, id="P56-K41"),
    pytest.param(159, 61, 8 + 47, id="P159-K61-all-candidates"),
    pytest.param(160, 46, 8 + 46, id="P160-K46"),
])
def test_seq_len_is_forced_plus_budget_at_branch_edges(prompt_blocks, k, seq_len):
    bs, kv_blocks = 128, 55
    gen = torch.Generator().manual_seed(prompt_blocks)
    qflat = torch.randn(1, 2, 1, 16, generator=gen).to(torch.bfloat16)
    kflat = torch.randn(1, 1, kv_blocks, 16, generator=gen).to(torch.bfloat16)
    vbias = torch.randn(1, 1, kv_blocks, generator=gen)
    kv_tokens = kv_blocks * bs - 3
    # prompt not a multiple of Bs: ceil((P*128 - 5) / 128) = P
    prompt = i32([prompt_blocks * bs - 5]) if prompt_blocks > 55 else i32([kv_tokens])
    assert reference_budget(prompt_blocks, kv_blocks - 1) == k
    args = (qflat, kflat, vbias, i32([100]), i32([kv_tokens]))
    idx, seq = stem_indexer.stem_indexer(*args, num_prompt_tokens=prompt)
    assert seq.tolist() == [[[seq_len], [seq_len]]]  # (B=1, Nq=2, Qmax=1)
    ref = stem_indexer.stem_indexer_reference(*args, num_prompt_tokens=prompt)
    assert torch.equal(seq, ref[1])
    for h in range(2):
        row = idx[0, h, 0, :seq_len].tolist()
        assert row == sorted(set(row)) and set(range(4)) | set(range(51, 55)) <= set(row)
        assert (idx[0, h, 0, seq_len:] == -1).all()
