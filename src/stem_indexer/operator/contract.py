"""The one home of the StemIndexer semantics' small parts.

Everything a backend needs to know about *which* blocks a row may pick and *how
many* lives here: the visible range (causal, right-down aligned), the forced
sink/window blocks, the position-decayed top-k budget (TPD), the ranking key
(tie-break to the lower block index) and the input checks. Backends call these
functions; they never re-derive them. ``reference.py`` is the one deliberate
exception: it re-states docs/CONTRACT.md section 3 row by row, so that tests have
an independent oracle to compare against.

Section numbers refer to docs/CONTRACT.md, the operator contract.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

__all__ = [
    "StemIndexerInputError",
    "BRANCH_MEDIUM",
    "BRANCH_LARGE",
    "TOPK_CAP",
    "IndexerParams",
    "PRESETS",
    "ceil_div",
    "score_scale",
    "visible_blocks",
    "candidate_range",
    "prompt_budget",
    "row_budget",
    "reach_blocks",
    "tail_rows",
    "DEFAULT_EXACT_TAIL",
    "check_exact_tail",
    "dense_is_exact",
    "budget_pairs",
    "DENSE_ABOVE",
    "default_dense_above",
    "check_dense_above",
    "rank_keys",
    "check_indexer_inputs",
    "check_metadata_inputs",
    "check_lengths",
]

# docs/CONTRACT.md section 3: the budget branch edges (in prompt blocks) and the cap on K.
BRANCH_MEDIUM = 56
BRANCH_LARGE = 160
TOPK_CAP = 256
MAX_BATCH = 65536


class StemIndexerInputError(ValueError):
    """Raised for any input that breaks the contract (docs/CONTRACT.md section 4).

    The message always names the offending argument and the rule it breaks.
    """


def fail(who: str, arg: str, rule: str, got: object) -> None:
    """Raise the package's input error: ``"<who>: <arg> <rule>; got <got>"``.

    ``who`` is the public function the user called, so that every message
    names the call, the argument and the rule, whichever helper checks it.
    """
    raise StemIndexerInputError(f"{who}: {arg} {rule}; got {got}")


def _fail(arg: str, rule: str, got: object) -> None:
    fail("stem_indexer", arg, rule, got)


def check_int(who: str, name: str, value, lo: int) -> None:
    """``value`` is an int (not a bool) and at least ``lo``."""
    if isinstance(value, bool) or not isinstance(value, int):
        fail(who, name, "must be an int", type(value).__name__)
    if value < lo:
        fail(who, name, f"must be >= {lo}", value)


def check_bool(who: str, name: str, value) -> None:
    if not isinstance(value, bool):
        fail(who, name, "must be True or False", repr(value))


def ceil_div(a, b):
    """ceil(a / b) for non-negative ints or integer tensors (no intermediate
    overflow, even for int64 tensors and a divisor near 2**63)."""
    return -(-a // b)


# --------------------------------------------------------------------------- #
# Parameters
# --------------------------------------------------------------------------- #


def is_finite(x) -> bool:
    """``math.isfinite`` for a number that may be symbolic: under
    ``torch.compile(dynamic=True)`` Python floats (defaults and constants
    too) are traced as symbols, which ``math.isfinite`` refuses; comparisons
    are traced (and guarded on)."""
    return x == x and -math.inf < x < math.inf


@dataclass(frozen=True)
class IndexerParams:
    """The scalar attributes of ``npu_stem_indexer`` (schema defaults)."""

    causal: bool = True
    stem_block_size: int = 128
    stem_stride: int = 16
    alpha: float = 1.0
    initial_blocks: int = 4
    window_size: int = 4
    k_block_num_rate_medium: float = 0.2
    k_block_num_bias_medium: int = 30
    k_block_num_rate_large: float = 0.1
    k_block_num_bias_large: int = 30
    topk_score_precision: int = 1

    @property
    def ratio(self) -> int:
        """R = Bs / Ts: tokens folded into each representative vector."""
        return self.stem_block_size // self.stem_stride

    def check(self, who: str = "stem_indexer") -> None:
        """docs/CONTRACT.md section 4 rules on the scalar attributes; errors name ``who``."""
        check_bool(who, "causal", self.causal)
        check_int(who, "stem_block_size", self.stem_block_size, 1)
        check_int(who, "stem_stride", self.stem_stride, 1)
        if self.stem_block_size % self.stem_stride:
            fail(who, "stem_block_size", f"must be a multiple of stem_stride "
                 f"({self.stem_stride})", self.stem_block_size)
        if (isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float))
                or not (is_finite(self.alpha) and 0.0 < self.alpha <= 1.0)):
            fail(who, "alpha", "must be a finite number with 0 < alpha <= 1", self.alpha)
        check_int(who, "initial_blocks", self.initial_blocks, 0)
        check_int(who, "window_size", self.window_size, 0)
        for name in ("k_block_num_rate_medium", "k_block_num_rate_large"):
            v = getattr(self, name)
            if (isinstance(v, bool) or not isinstance(v, (int, float))
                    or not (is_finite(v) and v >= 0.0)):
                fail(who, name, "must be a finite number >= 0", v)
        for name in ("k_block_num_bias_medium", "k_block_num_bias_large"):
            check_int(who, name, getattr(self, name), 0)
        if self.topk_score_precision not in (1, 2) or isinstance(self.topk_score_precision, bool):
            fail(who, "topk_score_precision", "must be 1 (float32 ranking) or 2 (bfloat16 "
                 "ranking)", self.topk_score_precision)

    @classmethod
    def from_kwargs(cls, who: str, preset: str = "default", **kwargs) -> "IndexerParams":
        """A preset's parameters (``PRESETS``) with keyword arguments named as
        the op's attributes taking precedence, checked."""
        if not isinstance(preset, str) or preset not in PRESETS:
            fail(who, "preset", f"must be one of {', '.join(map(repr, PRESETS))}", repr(preset))
        unknown = sorted(set(kwargs) - set(PARAM_NAMES))
        if unknown:
            fail(who, unknown[0], "is not an indexer parameter (those are "
                 f"{', '.join(PARAM_NAMES)})", repr(kwargs[unknown[0]]))
        params = cls(**{**PRESETS[preset], **kwargs})
        params.check(who)
        return params


# The attributes' names, in the op schema's order.
PARAM_NAMES = tuple(f.name for f in dataclasses.fields(IndexerParams))
#: The attributes that set a row's budget and nothing else: an engine may
#: vary them per layer over one plan of a step's rows and one indexer cache.
BUDGET_FIELDS = ("alpha", "k_block_num_rate_medium", "k_block_num_bias_medium",
                 "k_block_num_rate_large", "k_block_num_bias_large")

# Named budgets, as overrides of the schema defaults. ``default`` is the
# operator's (the paper's and the NPU's): Ks = P below 56 prompt blocks,
# 0.2 P + 30 below 160, 0.1 P + 30 beyond. ``serving`` is ``default`` with
# a flat Ks = 40 below 160 blocks (7K to 20K tokens), the vLLM backend's
# default: ``default``'s medium regime keeps more blocks the longer the
# prompt (55 of 128 at 16K); through vLLM on SmolLM2 a flat 40 stays at
# dense's accuracy from 8K to 19K tokens and is faster from 12K on
# (benchmarks/FRONTIER.md, "A flat budget below 20K"). The
# others keep fewer blocks at every length from 56 blocks on: ``balanced``
# Ks = P/10 + 16, ``tight`` Ks = P/16 + 8. Their measured density, speed
# and accuracy are in benchmarks/QUALITY.md and benchmarks/ATTENTION.md.
PRESETS: dict[str, dict] = {
    "default": {},
    "serving": dict(k_block_num_rate_medium=0.0, k_block_num_bias_medium=40),
    "balanced": dict(k_block_num_rate_medium=0.1, k_block_num_bias_medium=16,
                     k_block_num_rate_large=0.1, k_block_num_bias_large=16),
    "tight": dict(k_block_num_rate_medium=0.0625, k_block_num_bias_medium=8,
                  k_block_num_rate_large=0.0625, k_block_num_bias_large=8),
}


def score_scale(params: IndexerParams) -> float:
    """The float32 factor 1/R^2 applied to each block dot product."""
    r = params.ratio
    return float(torch.tensor(1.0 / (r * r), dtype=torch.float32))


# --------------------------------------------------------------------------- #
# Visibility, forced blocks, candidates (docs/CONTRACT.md section 3)
# --------------------------------------------------------------------------- #


def visible_blocks(i: torch.Tensor, qb, kb, causal: bool) -> torch.Tensor:
    """s2_valid for query blocks ``i`` of batches with qb query / kb key blocks.

    ``qb`` and ``kb`` are ints or tensors broadcasting against ``i``. Causal
    rows are aligned right-down: the last query block sees the last key block.
    Key blocks ``0 .. s2_valid-1`` are visible.
    """
    kb = torch.as_tensor(kb, dtype=i.dtype, device=i.device)
    if not causal:
        return torch.broadcast_to(kb, torch.broadcast_shapes(i.shape, kb.shape)).clone()
    return torch.minimum((i + (kb - qb + 1)).clamp(min=0), kb)


def candidate_range(s2: torch.Tensor, initial_blocks: int, window_size: int):
    """Split each row's visible range into forced blocks and top-k candidates.

    Forced = sink [0, sink_end) united with window [max(s2 - window, 0), s2).
    Because both forced pieces are prefix/suffix intervals, the candidates
    (visible minus forced) are always the contiguous range [sink_end, cand_end),
    and the forced set is exactly [0, sink_end) + [cand_end, s2).

    Returns ``(sink_end, cand_end)``, both with ``sink_end <= cand_end <= s2``.
    """
    sink_end = s2.clamp(max=initial_blocks)
    window_start = (s2 - window_size).clamp(min=0)
    cand_end = torch.maximum(window_start, sink_end)
    return sink_end, cand_end


# --------------------------------------------------------------------------- #
# Budget: Token Position-Decay (docs/CONTRACT.md section 3)
# --------------------------------------------------------------------------- #

# Any Ks at or above this is equivalent: then Ks >= P, so the budget is Ks and
# the cap (256) applies. Clamping keeps int64 arithmetic safe for huge rates.
_KS_CLAMP = 1 << 40


def prompt_budget(p: torch.Tensor, params: IndexerParams) -> torch.Tensor:
    """Ks, the initial top-k budget for prompts of ``p`` blocks (int64 tensor)."""
    p = p.to(torch.int64)
    pf = p.to(torch.float32)

    def branch(rate: float, bias: int) -> torch.Tensor:
        # f32(f32(P) * f32(rate)), then floor, then + bias (exact integer add).
        prod = (pf * torch.tensor(rate, dtype=torch.float32)).to(torch.float64)
        prod = prod.clamp(max=float(_KS_CLAMP))
        return (torch.floor(prod).to(torch.int64) + min(bias, _KS_CLAMP)).clamp(max=_KS_CLAMP)

    medium = branch(params.k_block_num_rate_medium, params.k_block_num_bias_medium)
    large = branch(params.k_block_num_rate_large, params.k_block_num_bias_large)
    return torch.where(p < BRANCH_MEDIUM, p, torch.where(p < BRANCH_LARGE, medium, large))


def row_budget(
    pos: torch.Tensor, p: torch.Tensor, ks: torch.Tensor, alpha: float
) -> torch.Tensor:
    """K for rows at right-down aligned positions ``pos`` (broadcasting).

    ``p`` is the prompt length in blocks and ``ks`` its ``prompt_budget``.
    Past position Ks the budget decays linearly from Ks to alpha*Ks over the
    rest of the prompt, with the float32 roundings the contract prescribes.
    """
    pos, p, ks = torch.broadcast_tensors(
        pos.to(torch.int64), p.to(torch.int64), ks.to(torch.int64)
    )
    decay = p - ks
    decays = (pos >= ks) & (decay > 1)

    f32 = torch.float32
    ks32 = ks.to(f32)
    ke32 = ks32 * torch.tensor(alpha, dtype=f32)
    t32 = (pos - ks).to(f32) / (decay - 1).clamp(min=1).to(f32)
    d32 = ke32 - ks32
    # t*d + ks with a single rounding: the float64 product of two float32
    # values is exact, so float64 multiply-add then one cast to float32.
    fma = (t32.double() * d32.double() + ks32.double()).to(f32)
    decayed = torch.floor(fma).to(torch.int64)
    decayed = torch.minimum(decayed.clamp(min=1), ks)

    k = torch.where(decays, decayed, ks)
    return k.clamp(0, TOPK_CAP)


# --------------------------------------------------------------------------- #
# When the budget keeps every block: dense attention is the sparse result
# --------------------------------------------------------------------------- #


def reach_blocks(i: torch.Tensor, q_len, kv_len, block_size: int, causal: bool) -> torch.Tensor:
    """Key blocks holding a key visible, token-wise (right-down causal), to
    some token of query blocks ``i`` of a sequence of ``q_len`` queries and
    ``kv_len`` keys: blocks ``0 .. reach-1``."""
    if not causal:
        return torch.full_like(i, int(ceil_div(kv_len, block_size)))
    last_q = torch.minimum((i + 1) * block_size, q_len) - 1
    return ceil_div(torch.minimum(kv_len, last_q + kv_len - q_len + 1).clamp(min=0),
                    block_size)


def tail_rows(q_len: int, kv_len: int, prompt: int, tail: int, block_size: int) -> range:
    """The query blocks of a chunk (``q_len`` queries, the last of ``kv_len``
    keys, of a ``prompt``-token prompt) holding one of the prompt's last
    ``tail`` tokens: query token ``t`` is at position ``t + kv_len - q_len``.
    Empty for ``tail`` 0, and for a chunk that ends before the prompt's tail."""
    first = prompt - tail - (kv_len - q_len)
    if tail <= 0 or q_len <= 0 or kv_len <= 0 or first >= q_len:
        return range(0)
    return range(max(first, 0) // block_size, (q_len - 1) // block_size + 1)


# The prompt's last tokens that attend to every key by default, a retrieval
# prompt's question (docs/CONTRACT.md section 7). On Gemma-3-270M's RULER
# passkeys every one the presets lost at 16K and 32K was lost in the
# question's own query block; with 128 exact tokens each preset finds every
# passkey that exact attention finds, for one or two more rows per head and
# layer (benchmarks/QUALITY.md, "An exact question block").
DEFAULT_EXACT_TAIL = 128


def check_exact_tail(who: str, value) -> None:
    """``exact_tail``: an int >= 0, the prompt's last tokens that attend exactly."""
    check_int(who, "exact_tail", value, 0)


def dense_is_exact(q_lens: torch.Tensor, kv_lens: torch.Tensor, prompt: torch.Tensor,
                   params: IndexerParams) -> bool:
    """True when the indexer would keep, in every row, every key block that
    holds a key visible to the row's tokens (the budget covers all
    candidates, and the block-aligned visible range covers the token-level
    one): block-sparse attention on its lists is then dense attention.
    Host int64 lengths per batch; ``prompt`` the prompt lengths in tokens."""
    bs = params.stem_block_size
    qb, kb = ceil_div(q_lens, bs), ceil_div(kv_lens, bs)
    p = ceil_div(prompt, bs)
    ks = prompt_budget(p, params)
    for b in range(q_lens.shape[0]):
        n = int(qb[b])
        if n == 0 or int(kb[b]) == 0:
            continue
        i = torch.arange(n)
        s2 = visible_blocks(i, n, int(kb[b]), params.causal)
        sink_end, cand_end = candidate_range(s2, params.initial_blocks, params.window_size)
        budget = row_budget(i + int(kb[b]) - n, p[b], ks[b], params.alpha)
        if bool((budget < cand_end - sink_end).any()):
            return False
        if bool((s2 < reach_blocks(i, q_lens[b], kv_lens[b], bs, params.causal)).any()):
            return False
    return True


def budget_pairs(q_lens: torch.Tensor, kv_lens: torch.Tensor, prompt: torch.Tensor,
                 params: IndexerParams) -> tuple[int, int]:
    """``(kept, visible)``: the (query block, key block) pairs the indexer
    will keep and the causally visible ones, per query head, summed over the
    batch, from the budget alone (before any score is computed): each row
    keeps its forced blocks (sink and window) and ``min(K, candidates)`` of
    the rest, every head alike. Host int64 lengths per batch; ``prompt`` the
    prompt lengths in tokens (as ``dense_is_exact``)."""
    bs = params.stem_block_size
    qb, kb = ceil_div(q_lens, bs), ceil_div(kv_lens, bs)
    p = ceil_div(prompt, bs)
    ks = prompt_budget(p, params)
    kept = visible = 0
    for b in range(q_lens.shape[0]):
        n, m = int(qb[b]), int(kb[b])
        if n == 0 or m == 0:
            continue
        i = torch.arange(n)
        s2 = visible_blocks(i, n, m, params.causal)
        sink_end, cand_end = candidate_range(s2, params.initial_blocks, params.window_size)
        budget = row_budget(i + m - n, p[b], ks[b], params.alpha)
        picks = torch.minimum(budget, cand_end - sink_end)
        kept += int((sink_end + (s2 - cand_end) + picks).sum())
        visible += int(s2.sum())
    return kept, visible


# Stem steps aside (dense attention) when the budget keeps more than this
# share of the visible block pairs: there, scoring every block costs more
# than the dropped pairs save. Per device type and dtype, from
# benchmarks/WINDOW.md ("Where Stem steps aside"): on CPU, stem_attention
# against dense SDPA at 8K tokens and budgets of 85% to 99.5% of the pairs
# broke even near 95% in float32 (1.06x at 93.5%, 0.96x at 96.2%) and not
# below 99.5% in bfloat16 (1.11x at 98.3%, 1.03x at 99.5%), where 0.98
# leaves a margin. CUDA (measured on an H200 in bfloat16, benchmarks/GPU.md,
# 2026-12-04): a call costs about 10 ms whatever its density (the indexer
# and the block mask) plus the kept pairs, so the break-even share rises with
# the length. At 32K no budget broke even (0.82x at 28.8% of the pairs; the
# default budget keeps 43%), at 64K the default budget (31.7%) ran 1.43x
# faster than SDPA. 0.35 takes the faster path at both lengths; float16 and
# float32 share it, unmeasured. Other dtypes on CPU run the gather backend
# (E 0.55 to 0.59, ATTENTION.md).
DENSE_ABOVE: dict[tuple[str, torch.dtype], float] = {
    ("cpu", torch.float32): 0.95,
    ("cpu", torch.bfloat16): 0.98,
    ("cuda", torch.bfloat16): 0.35,
    ("cuda", torch.float16): 0.35,
    ("cuda", torch.float32): 0.35,
}
_DENSE_ABOVE_OTHER = 0.55


def default_dense_above(device: torch.device | str, dtype: torch.dtype) -> float:
    """The ``dense_above`` that ``stem_attention`` uses for q on ``device`` in ``dtype``."""
    return DENSE_ABOVE.get((torch.device(device).type, dtype), _DENSE_ABOVE_OTHER)


def check_dense_above(who: str, value) -> None:
    """``dense_above`` is None (the default for the device and dtype) or a
    number with ``0 < dense_above <= 1`` (1: never step aside for it)."""
    if value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not (is_finite(value) and 0.0 < value <= 1.0)):
        fail(who, "dense_above", "must be None or a number with 0 < dense_above <= 1",
             repr(value))


# --------------------------------------------------------------------------- #
# Ranking (docs/CONTRACT.md section 3, "Selection")
# --------------------------------------------------------------------------- #

_LOW32 = 0xFFFFFFFF
NO_CANDIDATE = torch.iinfo(torch.int64).min


def rank_keys(scores: torch.Tensor, first_block: int, precision: int) -> torch.Tensor:
    """Distinct int64 keys whose descending order is the contract's ranking.

    ``scores[..., c]`` is the float32 score of key block ``first_block + c``.
    The high 32 bits order the score (rounded to bfloat16 first when
    ``precision == 2``); the low 32 bits order equal scores so that the lower
    block index ranks first. +0.0 and -0.0 are equal; NaN ranks as -inf.
    Keys are unique per row, so any top-k, stable or not, picks exactly the
    contract's set.
    """
    blocks = torch.arange(first_block, first_block + scores.shape[-1], device=scores.device)
    return rank_keys_at(scores, blocks, precision)


def rank_keys_at(scores: torch.Tensor, blocks: torch.Tensor, precision: int) -> torch.Tensor:
    """``rank_keys`` for scores of arbitrary key blocks: ``blocks`` (int64,
    broadcasting with ``scores``) names the block of each score."""
    s = scores.float()
    if precision == 2:
        s = s.to(torch.bfloat16).float()
    s = torch.nan_to_num(s + 0.0, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    bits = s.view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as signed int order
    return (ordered.to(torch.int64) << 32) | (_LOW32 - blocks)


def block_of_key(keys: torch.Tensor) -> torch.Tensor:
    """Inverse of the tie-break part of ``rank_keys``: the key block index."""
    return _LOW32 - (keys & _LOW32)


# --------------------------------------------------------------------------- #
# Input checks (docs/CONTRACT.md section 4)
# --------------------------------------------------------------------------- #


def _check_tensor(name: str, t, ndim: int, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(name, "must be a torch.Tensor", type(t).__name__)
    if t.dim() != ndim:
        _fail(name, f"must be {ndim}-D", f"shape {tuple(t.shape)}")
    if t.dtype != dtype:
        _fail(name, f"must have dtype {dtype}", t.dtype)


def _check_heads(q_heads: int, kv_heads: int, q_name: str, kv_name: str) -> None:
    if q_heads < 1:
        _fail(q_name, "must be >= 1", q_heads)
    if kv_heads < 1:
        _fail(kv_name, "must be >= 1", kv_heads)
    if q_heads % kv_heads:
        _fail(q_name, f"must be a multiple of {kv_name} ({kv_heads})", q_heads)


def _check_batch(name: str, batch: int) -> None:
    if not 1 <= batch <= MAX_BATCH:
        _fail(name, f"batch size must be in [1, {MAX_BATCH}] (its dim 0)", batch)


def check_indexer_inputs(
    qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens, metadata,
    params: IndexerParams, *, metadata_required: bool = True,
) -> None:
    """Shape, dtype and attribute checks of the main op.

    Uses only static information (shapes, dtypes, attributes), so it runs in
    the fake kernel too and never reads tensor data. With
    ``metadata_required=False`` a missing metadata is accepted (for callers
    that build it once the other inputs are known to be sound).
    """
    params.check()
    _check_tensor("qflat", qflat, 4, torch.bfloat16)
    _check_tensor("kflat", kflat, 4, torch.bfloat16)
    _check_tensor("vbias", vbias, 3, torch.float32)
    _check_tensor("q_seq_lens", q_seq_lens, 1, torch.int32)
    _check_tensor("kv_seq_lens", kv_seq_lens, 1, torch.int32)
    if num_prompt_tokens is not None:
        _check_tensor("num_prompt_tokens", num_prompt_tokens, 1, torch.int32)
    if metadata is None and metadata_required:
        raise StemIndexerInputError(
            "stem_indexer: metadata is required; build it with "
            "npu_stem_indexer_metadata(q_seq_lens, kv_seq_lens, q_heads, kv_heads, ...) "
            "(stem_indexer.stem_indexer() builds it when omitted)"
        )
    if metadata is not None:
        _check_tensor("metadata", metadata, 1, torch.int32)

    b, nq, qmax, df = qflat.shape
    if any(d == 0 for d in qflat.shape):
        _fail("qflat", "must have no zero-sized dimension", f"shape {tuple(qflat.shape)}")
    _check_batch("qflat", b)
    kb, nk, kmax, kdf = kflat.shape
    if kb != b:
        _fail("kflat", f"batch dim must equal qflat's ({b})", kb)
    if kdf != df:
        _fail("kflat", f"last dim (Df) must equal qflat's ({df})", kdf)
    _check_heads(nq, nk, "qflat heads (dim 1, Nq)", "kflat heads (dim 1, Nk)")
    if tuple(vbias.shape) != (b, nk, kmax):
        _fail("vbias", f"must have shape (B, Nk, Kmax) = {(b, nk, kmax)}", tuple(vbias.shape))
    for name, t in (("q_seq_lens", q_seq_lens), ("kv_seq_lens", kv_seq_lens),
                    ("num_prompt_tokens", num_prompt_tokens)):
        if t is not None and t.shape[0] != b:
            _fail(name, f"must have one entry per batch ({b})", f"shape {tuple(t.shape)}")
    devices = {t.device for t in (qflat, kflat, vbias, q_seq_lens, kv_seq_lens,
                                  num_prompt_tokens, metadata) if t is not None}
    if len(devices) > 1:
        _fail("qflat", "and all other tensors must be on one device",
              sorted(str(d) for d in devices))


def check_metadata_inputs(
    q_seq_lens, kv_seq_lens, q_heads: int, kv_heads: int,
    stem_block_size: int, dim_qkflat: int, window_size: int,
) -> None:
    """Shape, dtype and attribute checks of the metadata op (static only)."""
    _check_tensor("q_seq_lens", q_seq_lens, 1, torch.int32)
    _check_tensor("kv_seq_lens", kv_seq_lens, 1, torch.int32)
    if kv_seq_lens.shape[0] != q_seq_lens.shape[0]:
        _fail("kv_seq_lens", f"must have one entry per batch ({q_seq_lens.shape[0]})",
              f"shape {tuple(kv_seq_lens.shape)}")
    if kv_seq_lens.device != q_seq_lens.device:
        _fail("kv_seq_lens", "must be on the device of q_seq_lens", kv_seq_lens.device)
    _check_batch("q_seq_lens", q_seq_lens.shape[0])
    check_int("stem_indexer", "q_heads", q_heads, 1)
    check_int("stem_indexer", "kv_heads", kv_heads, 1)
    _check_heads(q_heads, kv_heads, "q_heads", "kv_heads")
    check_int("stem_indexer", "stem_block_size", stem_block_size, 1)
    check_int("stem_indexer", "dim_qkflat", dim_qkflat, 1)
    check_int("stem_indexer", "window_size", window_size, 0)


def check_lengths(
    q_lens: torch.Tensor, kv_lens: torch.Tensor, prompt: torch.Tensor | None,
    qmax: int, kmax: int, block_size: int,
) -> None:
    """Value checks on host (CPU) copies of the per-batch lengths."""
    _check_range("q_seq_lens", q_lens, qmax * block_size, "Qmax*stem_block_size")
    _check_range("kv_seq_lens", kv_lens, kmax * block_size, "Kmax*stem_block_size")
    if prompt is not None:
        check_prompt(prompt, kv_lens, "stem_indexer", "kv_seq_lens")


def check_prompt(prompt: torch.Tensor, kv_lens: torch.Tensor, who: str, kv_name: str) -> None:
    """Every prompt length is at least its batch's KV length (host tensors)."""
    bad = (prompt < kv_lens).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        fail(who, f"num_prompt_tokens[{b}]", f"must be >= {kv_name}[{b}] ({int(kv_lens[b])})",
             int(prompt[b]))


_INT32_MAX = 2**31 - 1


def _check_range(name: str, lens: torch.Tensor, hi: int | None, hi_name: str) -> None:
    # Lengths are int32: a bound past int32 limits nothing (and a Python int
    # that large would wrap if compared with an int32 tensor).
    bad = (lens < 0) if hi is None or hi > _INT32_MAX else ((lens < 0) | (lens > hi))
    idx = bad.nonzero()
    if idx.numel():
        b = int(idx[0, 0])
        rule = "must be >= 0" if hi is None else f"must be in [0, {hi_name} = {hi}]"
        _fail(f"{name}[{b}]", rule, int(lens[b]))


def check_nonnegative(name: str, lens: torch.Tensor) -> None:
    """Lengths the metadata op sees must not be negative."""
    _check_range(name, lens, None, "")
