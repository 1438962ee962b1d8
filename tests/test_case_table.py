"""The case table covers every point it claims (``covers``) -- checked, not just claimed.

Each test recomputes, from the case definitions alone, the per-row facts that
a coverage claim rests on (visible blocks, forced set, candidates, budget) and
asserts that some case really has such rows. Row facts are restated here from
docs/CONTRACT.md section 3 in scalar Python; the budget comes from the scalar golden
(``reference_budget``). Nothing runs the op; test_cases_*.py do that.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch

from stem_indexer.testing import cases
from stem_indexer.testing.cases import Case
from stem_indexer.operator.contract import IndexerParams
from stem_indexer.operator.reference import reference_budget, stem_indexer_reference

BASE = [c for c in cases.CASES if c.number <= cases.MIRROR_OFFSET]
DEFAULT = [c for c in BASE if not c.large]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Row:
    case: Case
    b: int
    i: int
    qb: int
    kb: int
    p: int  # prompt blocks
    pos: int
    s2: int
    forced: int  # |sink U window|
    cands: int  # candidates
    k: int  # budget K

    @property
    def binds(self) -> bool:
        """Some candidate is dropped."""
        return self.cands > self.k

    @property
    def ks(self) -> int:
        return _ks(self.p, self.case.params)

    @property
    def decays(self) -> bool:
        """In the TPD interpolation region (alpha applies)."""
        return self.pos >= self.ks and self.p - self.ks > 1


def _f32(x: float) -> float:
    """Round to the nearest IEEE float32."""
    return ctypes.c_float(x).value


def _ks(p: int, pr: IndexerParams) -> int:
    """Ks, the branch budget before the 256 cap (docs/CONTRACT.md section 3, in float32)."""
    if p < 56:
        return p
    if p < 160:
        return math.floor(_f32(_f32(p) * _f32(pr.k_block_num_rate_medium))) + \
            pr.k_block_num_bias_medium
    return math.floor(_f32(_f32(p) * _f32(pr.k_block_num_rate_large))) + pr.k_block_num_bias_large


def _budget_kw(p: IndexerParams) -> dict:
    return dict(alpha=p.alpha, k_block_num_rate_medium=p.k_block_num_rate_medium,
                k_block_num_bias_medium=p.k_block_num_bias_medium,
                k_block_num_rate_large=p.k_block_num_rate_large,
                k_block_num_bias_large=p.k_block_num_bias_large)


@lru_cache(maxsize=None)
def rows_of(case: Case) -> tuple[Row, ...]:
    """Every live row (query block < Qb) of every batch, heads aside."""
    p = case.params
    bs = p.stem_block_size
    prompts = case.prompt_lens or case.kv_lens
    out = []
    for b, (q, kv, pr) in enumerate(zip(case.q_lens, case.kv_lens, prompts)):
        qb, kb, pb = _cdiv(q, bs), _cdiv(kv, bs), _cdiv(pr, bs)
        if qb == 0 or kb == 0:
            continue
        for i in range(qb):
            s2 = min(max(kb - qb + i + 1, 0), kb) if p.causal else kb
            forced = len(set(range(min(p.initial_blocks, s2)))
                         | set(range(max(s2 - p.window_size, 0), s2)))
            k = reference_budget(pb, i + kb - qb, **_budget_kw(p))
            out.append(Row(case, b, i, qb, kb, pb, i + kb - qb, s2, forced, s2 - forced, k))
    return tuple(out)


def all_rows(selection=DEFAULT):
    for c in selection:
        yield from rows_of(c)


def _default_forced(c: Case) -> bool:
    return c.params.initial_blocks == 4 and c.params.window_size == 4


def _need(found, what: str):
    assert found, f"no case covers: {what}"


# --------------------------------------------------------------------------- #
# The table itself
# --------------------------------------------------------------------------- #


def test_numbering_and_mirrors():
    numbers = [c.number for c in BASE]
    assert len(numbers) == len(set(numbers))
    assert all(1 <= n <= cases.MIRROR_OFFSET for n in numbers)
    assert [c.number for c in cases.CASES if c.number > cases.MIRROR_OFFSET] == \
        [n + cases.MIRROR_OFFSET for n in numbers]
    by_number = {c.number: c for c in cases.CASES}
    for c in BASE:
        assert c.covers.strip(), f"{c.id} says nothing about what it covers"
        assert c.params.topk_score_precision == 1
        m = by_number[c.number + cases.MIRROR_OFFSET]
        assert m.params == dataclasses.replace(c.params, topk_score_precision=2)
        assert dataclasses.replace(m, number=c.number, covers=c.covers, params=c.params) == c
        # Same data: the mirror differs only in the ranking precision.
        if not c.large:
            a, b = c.make_inputs(), m.make_inputs()
            assert all((a[k] is None and b[k] is None) or torch.equal(a[k], b[k]) for k in a)


def test_cases_are_valid_inputs():
    """Lengths fit the shapes, prompts cover kv, attributes pass the contract checks."""
    for c in BASE:
        c.params.check()
        bs = c.params.stem_block_size
        assert len(c.q_lens) == len(c.kv_lens) >= 1, c.id
        assert c.q_heads % c.kv_heads == 0, c.id
        assert all(0 <= q <= c.shape_q_blocks * bs for q in c.q_lens), c.id
        assert all(0 <= kv <= c.shape_kv_blocks * bs for kv in c.kv_lens), c.id
        if c.prompt_lens is not None:
            assert len(c.prompt_lens) == c.batch, c.id
            assert all(p >= kv for p, kv in zip(c.prompt_lens, c.kv_lens)), c.id
        assert c.data in ("randn", "integer"), c.id


def test_integer_cases_have_exact_scores():
    """data="integer" claims scores independent of summation order: R must be a power
    of two (exact 1/R^2) and every partial dot product small enough for float32."""
    for c in BASE:
        if c.data != "integer":
            continue
        r = c.params.ratio
        assert r & (r - 1) == 0, f"{c.id}: R={r} makes 1/R^2 inexact"
        assert 9 * c.dim < 2 ** 24, c.id


def test_selection_by_environment():
    assert cases.select_cases("SI_WB_002, 103") == [cases.get_case("SI_WB_002"),
                                                   cases.get_case("SI_WB_103")]
    large = [c for c in cases.CASES if c.large]
    assert large and not any(c.large for c in cases.select_cases(None))
    assert cases.select_cases(large[0].id) == [large[0]]  # named: runs even when large
    with pytest.raises(KeyError):
        cases.get_case("SI_WB_999")


def test_graph_subset_is_representative():
    sub = cases.graph_subset()
    assert 10 <= len(sub) <= 16 and not any(c.large for c in sub)
    assert {c.params.topk_score_precision for c in sub} == {1, 2}
    assert {c.params.causal for c in sub} == {True, False}
    assert any(c.batch > 8 for c in sub), "varlen / many batches"
    assert any(max(c.kv_lens) >= 1 << 20 for c in sub), "long context"
    assert any(c.data == "integer" for c in sub)


# --------------------------------------------------------------------------- #
# The coverage claims, point by point
# --------------------------------------------------------------------------- #


def test_tails_and_empty_batches():
    def live(c, b):
        return c.q_lens[b] > 0 and c.kv_lens[b] > 0

    def has(pred):
        return [c.id for c in DEFAULT for b in range(c.batch)
                if pred(c, b) and any(live(c, o) for o in range(c.batch) if o != b)]

    bs = lambda c: c.params.stem_block_size  # noqa: E731
    _need([c.id for c in DEFAULT for b in range(c.batch)
           if live(c, b) and c.q_lens[b] % bs(c) and c.q_lens[b] > bs(c)], "q tail block")
    _need([c.id for c in DEFAULT for b in range(c.batch)
           if live(c, b) and c.kv_lens[b] % bs(c) and c.kv_lens[b] > bs(c)], "kv tail block")
    _need(has(lambda c, b: c.q_lens[b] == 0 and c.kv_lens[b] > 0), "q=0 next to live batches")
    _need(has(lambda c, b: c.kv_lens[b] == 0 and c.q_lens[b] > 0), "kv=0 next to live batches")
    _need(has(lambda c, b: c.q_lens[b] == 0 and c.kv_lens[b] == 0), "q=kv=0 next to live batches")
    _need([c.id for c in DEFAULT if c.shape_q_blocks > max(_cdiv(q, bs(c)) for q in c.q_lens)
           and c.shape_kv_blocks > max(_cdiv(k, bs(c)) for k in c.kv_lens)],
          "Qmax/Kmax padding")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_sink_window_overlap_classes(causal):
    """Default sink/window (4/4): clipped (s2 < 4), full overlap (4), partial (5-7, with 7),
    touching (8) and disjoint with candidates (> 8)."""
    s2s = {r.s2 for c in DEFAULT if _default_forced(c) and c.params.causal == causal
           for r in rows_of(c)}
    for wanted in (1, 2, 3, 4, 5, 6, 7, 8):
        _need(wanted in s2s, f"s2_valid={wanted} ({'causal' if causal else 'non-causal'})")
    _need(any(s > 8 for s in s2s), "s2_valid > 8 (no overlap, candidates)")


def test_causal_shapes():
    _need([r for r in all_rows() if r.case.params.causal and r.s2 == 0],
          "causal q longer than kv: empty early rows")
    _need([r for r in all_rows() if not r.case.params.causal and r.qb > r.kb],
          "non-causal q longer than kv")
    _need([r for r in all_rows() if r.case.params.causal and 1 <= r.s2 <= 3 and r.kb > 8],
          "early causal query blocks that see only a few of many key blocks")


@pytest.mark.parametrize("alpha", [1.0, 0.5, 0.01])
def test_alpha_with_binding_decaying_budget(alpha):
    rows = [r for r in all_rows() if r.case.params.alpha == alpha and r.p >= 56
            and r.decays and r.binds]
    _need(rows, f"alpha={alpha} on binding rows in the decay region")
    if alpha < 1:
        _need([r for r in rows if r.k < min(r.ks, 256)], f"alpha={alpha}: K decayed below Ks")
    else:
        assert all(r.k == min(r.ks, 256) for r in rows)
    if alpha == 0.01:
        _need([r for r in rows if r.k == 1 and _raw_interpolation(r) < 1],
              "alpha=0.01: K clamped up to 1")


def _raw_interpolation(r: Row) -> int:
    """floor(t*d + ks) before the clamp to [1, Ks] (fused, as the contract says)."""
    ks = r.ks
    ks32 = _f32(ks)
    ke = _f32(ks32 * _f32(r.case.params.alpha))
    t = _f32(_f32(r.pos - ks) / _f32(r.p - ks - 1))
    return math.floor(_f32(t * _f32(ke - ks32) + ks32))


def test_budget_branch_edges():
    by_p = {}
    for r in all_rows():
        if _default_rates(r.case):
            by_p.setdefault(r.p, []).append(r)
    _need(by_p.get(55), "P=55")
    for p in (56, 159, 160):
        _need([r for r in by_p.get(p, []) if r.binds], f"P={p} with a binding budget")
    _need([r for p, rs in by_p.items() if 56 < p < 159 for r in rs if r.binds], "medium branch")
    _need([r for p, rs in by_p.items() if p > 160 for r in rs if r.binds], "large branch")
    _need([(c.id, b) for c in DEFAULT if c.prompt_lens
           for b, (pr, kv) in enumerate(zip(c.prompt_lens, c.kv_lens))
           if pr % c.params.stem_block_size and pr != kv and c.q_lens[b] and kv],
          "num_prompt_tokens not divisible by Bs")


def _default_rates(c: Case) -> bool:
    d = IndexerParams()
    return (c.params.k_block_num_rate_medium, c.params.k_block_num_bias_medium,
            c.params.k_block_num_rate_large, c.params.k_block_num_bias_large) == \
        (d.k_block_num_rate_medium, d.k_block_num_bias_medium,
         d.k_block_num_rate_large, d.k_block_num_bias_large)


def test_forced_plus_budget_exactly_and_one_past():
    rows = [r for r in all_rows() if _default_forced(r.case) and r.k > 0 and r.forced == 8]
    _need([r for r in rows if r.s2 == r.forced + r.k], "s2_valid == forced + budget")
    _need([r for r in rows if r.s2 == r.forced + r.k + 1], "s2_valid == forced + budget + 1")
    for p in (56, 159, 160):
        _need([r for r in rows if r.p == p and r.s2 == r.forced + r.k], f"exact row at P={p}")


def test_budget_cap_and_key_chunks():
    _need([r for r in all_rows() if r.k == 256 and r.cands > 256], "K capped at 256, binding")
    _need([c.id for c in DEFAULT if max(c.kv_lens) > 16384 * c.params.stem_block_size],
          "more key blocks than the fast path's key chunk (16384)")


def test_float32_rounding_sensitive_budgets():
    """Rows whose K depends on the contract's exact float32 arithmetic: the fused
    t*d+ks versus two roundings, and float32 versus float64 math."""
    def unfused(r):
        ks = r.ks
        ks32 = _f32(ks)
        ke = _f32(ks32 * _f32(r.case.params.alpha))
        t = _f32(_f32(r.pos - ks) / _f32(r.p - ks - 1))
        return min(max(math.floor(_f32(_f32(t * _f32(ke - ks32)) + ks32)), 1), ks, 256)

    def ks_float64(r):
        pr, p = r.case.params, r.p
        if p < 56:
            return p
        if p < 160:
            return math.floor(p * pr.k_block_num_rate_medium) + pr.k_block_num_bias_medium
        return math.floor(p * pr.k_block_num_rate_large) + pr.k_block_num_bias_large

    def float64(r):
        ks = r.ks
        t = (r.pos - ks) / (r.p - ks - 1)
        return min(max(math.floor(t * (ks * r.case.params.alpha - ks) + ks), 1), ks, 256)

    binding = [r for r in all_rows() if r.binds]
    _need([r for r in binding if r.decays and unfused(r) != r.k], "fused vs two roundings")
    _need([r for r in binding if r.decays and float64(r) != r.k], "interpolation in float64")
    _need([r for r in binding if ks_float64(r) != r.ks and r.k == r.ks < 256],
          "branch budget f32(P*rate) computed in float64")


def test_gqa_pairs_and_head_shapes():
    pairs = {(c.q_heads, c.kv_heads) for c in DEFAULT}
    for nq in (32, 64):
        for nk in (2, 4, 8):
            _need((nq, nk) in pairs, f"GQA Nq={nq}, Nk={nk}")
    _need([p for p in pairs if p[0] == p[1]], "Nq == Nk")
    _need([p for p in pairs if p[1] == 1 and p[0] > 1], "Nk == 1")
    _need((12, 3) in pairs, "Nq=12, Nk=3")
    _need([p for p in pairs if (p[0] // p[1]) % 2], "odd group size")


def test_batches_decode_and_batch_sizes():
    sizes = {c.batch for c in DEFAULT}
    missing = (set(range(1, 20)) | set(range(23, 32)) | {37, 39}) - sizes
    assert not missing, f"batch sizes not covered: {sorted(missing)}"
    _need([c.id for c in DEFAULT if 1 in c.q_lens], "single-token decode (q_seq_lens=1)")
    _need([c.id for c in DEFAULT if c.q_lens and all(q == 1 for q in c.q_lens)
           and c.batch > 8], "pure decode batch")
    _need([c.id for c in DEFAULT if 1 in c.q_lens
           and any(_cdiv(q, c.params.stem_block_size) >= 2 for q in c.q_lens)],
          "prefill and decode mixed in one batch")
    _need([c.id for c in DEFAULT if c.batch >= 20 and len(set(c.kv_lens)) >= c.batch // 2],
          "many batches with mixed lengths")


@pytest.mark.parametrize("tokens", [1 << 15, 1 << 16, 1 << 17, 1 << 18, 1 << 20],
                         ids=["32K", "64K", "128K", "256K", "1M"])
def test_long_contexts(tokens):
    def prompt(c, b):
        return (c.prompt_lens or c.kv_lens)[b]
    _need([c.id for c in DEFAULT for b in range(c.batch)
           if c.kv_lens[b] == tokens and prompt(c, b) >= tokens and c.q_lens[b] > 0],
          f"kv and prompt at {tokens} tokens")


def test_long_prefills():
    def prefill(c, tokens):
        return c.params.causal and any(q == kv == tokens for q, kv in zip(c.q_lens, c.kv_lens))
    _need([c.id for c in DEFAULT if prefill(c, 1 << 17)], "q=kv=128K causal prefill (default)")
    _need([c.id for c in BASE if c.large and prefill(c, 1 << 20)], "q=kv=1M causal prefill")


def test_score_scales():
    pairs = {(c.params.stem_block_size, c.params.stem_stride) for c in DEFAULT}
    for bs_ts in ((128, 16), (64, 16), (48, 16), (16, 16), (32, 4)):
        _need(bs_ts in pairs, f"Bs/Ts = {bs_ts}")
    _need({c.params.ratio for c in DEFAULT} >= {1, 3, 4, 8, 16}, "R in 1, 3, 4, 8, 16")


def _zero_vbias_changes(case: Case) -> bool:
    inputs = case.make_inputs()
    with_bias = stem_indexer_reference(**inputs, **case.op_kwargs())
    inputs["vbias"] = torch.zeros_like(inputs["vbias"])
    without = stem_indexer_reference(**inputs, **case.op_kwargs())
    return not torch.equal(with_bias[0], without[0])


def test_vbias_changes_the_selection():
    strong = [c for c in DEFAULT if c.data == "randn" and c.vbias_scale >= 5.0]
    _need(strong, "vbias_scale >= 5")
    assert all(_zero_vbias_changes(c) for c in strong), "vbias_scale >= 5 but no effect"
    _need([c.id for c in DEFAULT if c.data == "randn" and c.vbias_scale == 0.0], "vbias = 0")


def _boundary_ties(case: Case) -> int:
    """(row, head) pairs whose K-th and (K+1)-th best candidates score exactly the same
    (in the ranking precision): there the tie-break alone decides the selection."""
    inputs = case.make_inputs()
    p = case.params
    group = case.q_heads // case.kv_heads
    ties = 0
    for r in rows_of(case):
        if not (r.binds and r.k > 0):
            continue
        lo = min(p.initial_blocks, r.s2)
        hi = max(r.s2 - p.window_size, lo)
        for h in range(case.q_heads):
            n = h // group
            s = inputs["kflat"][r.b, n, lo:hi].float() @ inputs["qflat"][r.b, h, r.i].float()
            s = s * _f32(1.0 / p.ratio ** 2) + inputs["vbias"][r.b, n, lo:hi]
            if p.topk_score_precision == 2:
                s = s.to(torch.bfloat16).float()
            v = s.sort(descending=True).values
            ties += bool(v[r.k - 1] == v[r.k])
    return ties


def test_integer_cases_decide_ties():
    """Every integer case has rows where the tie-break to the lower block index
    decides the selection, in several shapes."""
    integer = [c for c in DEFAULT if c.data == "integer"]
    without = [c.id for c in integer if not _boundary_ties(c)]
    assert not without, f"integer cases without a tie at a top-k boundary: {without}"
    shapes = {(c.batch, c.q_heads, c.kv_heads, c.dim, c.params.stem_block_size,
               c.params.causal) for c in integer if c.number > 3}
    assert len(shapes) >= 5, shapes


def test_generalised_attributes():
    ps = [c.params for c in DEFAULT]
    for name, values in (("initial_blocks", (0, 1)), ("window_size", (0, 1))):
        for v in values:
            _need([p for p in ps if getattr(p, name) == v], f"{name}={v}")
        _need([p for p in ps if getattr(p, name) >= 64], f"large {name}")
    _need([p for p in ps if p.initial_blocks != p.window_size and p.initial_blocks > 0
           and p.window_size > 0], "initial_blocks != window_size, both > 0")
    _need([p for p in ps if p.k_block_num_rate_medium == 0 and p.k_block_num_bias_medium == 0
           and p.k_block_num_rate_large == 0 and p.k_block_num_bias_large == 0],
          "rates and biases 0")
    _need([p for p in ps if not _default_rates(Case(0, "", (1,), (1,), params=p))
           and p.k_block_num_rate_medium > 0 and p.k_block_num_bias_large > 0],
          "other non-zero rates and biases")
    dims = {c.dim for c in DEFAULT}
    _need(dims >= {1, 2048} and len(dims - {64}) >= 5, "Df other than 64 (incl. 1 and 2048)")
