"""Downstream of the indexer: block-sparse attention, and Stem attention in one call.

``block_sparse_attention`` computes, for every (batch b, query head h, query
block i), softmax attention of the block's query tokens restricted to the key
blocks listed in ``sparse_indices[b, h, i, :sparse_seq_len[b, h, i]]``, with
the token-level mask inside them:

* key ``j`` must be a valid key (``j < kv_len``);
* with ``causal``, right-down aligned: query token ``t`` of a sequence with
  ``q_len`` queries and ``kv_len`` keys sees key ``j`` iff
  ``j <= t + kv_len - q_len``.

Query tokens with no visible key among their listed blocks, and query
positions at or past ``q_len`` (padding), get an all-zero output. Padded
positions never influence a valid output, whatever they hold (NaN included).

Backends (``backend=``):

* ``"native"``: the C kernel of ``ops/sparse_attention.py`` (CPU tensors;
  float32 and bfloat16 only: other devices and dtypes are refused, naming
  them): blocked matrix products on the listed K/V blocks where they lie,
  online softmax, no score matrix in memory;
* ``"flex"``: compiled FlexAttention with ``ops.flex_attention.block_mask``
  (CUDA; on CPU through inductor's C++ template);
* ``"gather"``: torch operations on gathered blocks (``ops/gather_attention.py``),
  any device and float64;
* ``"auto"`` (default): ``"native"`` on CPU where it is built (float32 and
  bfloat16), ``"flex"`` on CUDA, else ``"gather"`` (float16 and float64 on CPU).

Both functions are inference-only: called with autograd recording on a tensor
that requires grad, they raise (use ``torch.no_grad()`` or
``torch.inference_mode()``), on every path alike.

``stem_attention`` runs the whole Stem pipeline: ``prepare.stem_inputs`` ->
indexer metadata -> indexer -> ``block_sparse_attention``, and takes dense
attention where sparsity cannot help (see its docstring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import contract
from ._renamed import take_renamed
from .api import run_indexer, stem_indexer_metadata
from .contract import IndexerParams, ceil_div, check_bool, check_int, fail
from .ops import flex_attention as flex
from .ops.gather_attention import gather_attention
from .prepare import (DEFAULT_OAM_LAMBDA, Lengths, check_lens_values, check_oam_lambda,
                      check_qkv, is_finite, lens_argument, seq_lens_tensor, stem_inputs)

__all__ = ["block_sparse_attention", "dense_attention", "stem_attention", "StemInfo"]

BACKENDS = ("auto", "native", "flex", "gather")
# No model has this many attention heads; more, and more than tokens, is a
# tensor in another layout.
MAX_HEADS = 1024
_CPU = torch.device("cpu")


# --------------------------------------------------------------------------- #
# Checks
# --------------------------------------------------------------------------- #


def _check_scale(who: str, name: str, scale, dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not is_finite(scale):
        fail(who, name, "must be a finite number or None", scale)
    return float(scale)


def _check_backend(who: str, backend) -> None:
    if backend not in BACKENDS:
        fail(who, "backend", f"must be one of {', '.join(map(repr, BACKENDS))}", repr(backend))


def check_backend_fits(who: str, backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """A backend asked for by name runs on q's device and dtype: the native
    kernel reads CPU memory (a CUDA tensor's pointer would crash it) and
    multiplies float32 or bfloat16 only. (Static: fine while tracing.)"""
    if backend != "native":
        return
    if torch.device(device).type != "cpu":
        fail(who, "backend", f"'native' runs on CPU tensors only (q is on {device}); use "
             "'auto', 'flex' or 'gather'", "'native'")
    from .ops.sparse_attention import DTYPES
    if dtype not in DTYPES:
        fail(who, "backend", f"'native' runs on float32 and bfloat16 only (q is {dtype}); use "
             "'auto' or 'gather'", "'native'")


def _check_inference(who: str, *tensors: torch.Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        fail(who, "q, k, v", "must not require grad: this function is inference-only (call it "
             "under torch.no_grad() or torch.inference_mode())", "requires_grad=True")


def _check_selection(who, sparse_indices, sparse_seq_len, batch, hq, qmax, device) -> None:
    """The selection's types, shapes and device (static: fine while tracing)."""
    for name, t, nd in (("sparse_indices", sparse_indices, 4),
                        ("sparse_seq_len", sparse_seq_len, 3)):
        if not isinstance(t, torch.Tensor):
            fail(who, name, "must be a torch.Tensor", type(t).__name__)
        if t.dim() != nd:
            fail(who, name, f"must be {nd}-D", f"shape {tuple(t.shape)}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            fail(who, name, "must have an integer dtype", t.dtype)
        if t.device != device:
            fail(who, name, f"must be on q's device ({device})", t.device)
    if tuple(sparse_indices.shape[:3]) != (batch, hq, qmax):
        fail(who, "sparse_indices", f"must have shape (B, Hq, ceil(Sq/block_size), W) with "
             f"(B, Hq, ceil(Sq/block_size)) = {(batch, hq, qmax)}", tuple(sparse_indices.shape))
    if tuple(sparse_seq_len.shape) != (batch, hq, qmax):
        fail(who, "sparse_seq_len", f"must have shape {(batch, hq, qmax)}",
             tuple(sparse_seq_len.shape))


def _selection_values(who, sparse_indices, sparse_seq_len, kmax):
    """The selection's values checked (on its device); lists sorted ascending.

    Returns (indices int64 [B,Hq,Qmax,W], lengths int64 [B,Hq,Qmax]) with W
    the longest list and entries past each row's length -1.
    """
    device = sparse_indices.device
    width = sparse_indices.shape[3]
    lengths = sparse_seq_len.detach().to(torch.int64)
    _first_bad(who, "sparse_seq_len", (lengths < 0) | (lengths > width), lengths,
               f"must be in [0, {width}] (sparse_indices' last dim)")
    width = int(lengths.max()) if lengths.numel() else 0
    idx = sparse_indices[..., :width].detach().to(torch.int64)
    listed = torch.arange(width, device=device) < lengths[..., None]
    _first_bad(who, "sparse_indices", listed & ((idx < 0) | (idx >= kmax)), idx,
               f"must be a key block in [0, {kmax})")
    idx = torch.where(listed, idx, kmax)
    if not bool((idx[..., 1:] >= idx[..., :-1]).all()):  # the indexer's lists are sorted
        idx = idx.sort(dim=-1).values
    dup = torch.zeros_like(listed)
    dup[..., 1:] = listed[..., 1:] & (idx[..., 1:] == idx[..., :-1])
    _first_bad(who, "sparse_indices", dup, idx, "must not list a key block twice")
    return torch.where(listed, idx, -1), lengths


def _first_bad(who: str, name: str, bad: torch.Tensor, values: torch.Tensor, rule: str) -> None:
    if bool(bad.any()):
        at = bad.nonzero()[0].tolist()
        fail(who, f"{name}[{', '.join(map(str, at))}]", rule, int(values[tuple(at)]))


# --------------------------------------------------------------------------- #
# Dense attention (fallback, and the meaning of "exact")
# --------------------------------------------------------------------------- #


def _sdpa(q, k, v, *, attn_mask=None, is_causal=False, scale):
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                          scale=scale, enable_gqa=gqa)


def _dense_one(q, k, v, causal: bool, scale: float):
    """Dense attention of q [B,Hq,ql,D] on k/v [B,Hkv,kl,D], right-down causal."""
    ql, kl = q.shape[2], k.shape[2]
    off = kl - ql
    if not causal or off >= kl - 1:  # decode-like: every query sees every key
        return _sdpa(q, k, v, scale=scale)
    if off == 0:
        return _sdpa(q, k, v, is_causal=True, scale=scale)
    t = torch.arange(ql, device=q.device)[:, None]
    j = torch.arange(kl, device=q.device)[None, :]
    out = _sdpa(q, k, v, attn_mask=j <= t + off, scale=scale)
    if off < 0:  # the first -off queries see no key
        out[:, :, : min(-off, ql)] = 0
    return out


def _dense(q, k, v, causal: bool, scale: float, qlen: torch.Tensor, kvlen: torch.Tensor):
    batch, _, sq, _ = q.shape
    if bool((qlen == sq).all()) and bool((kvlen == k.shape[2]).all()):
        return _dense_one(q, k, v, causal, scale).to(q.dtype)
    out = torch.zeros_like(q)
    for b, (ql, kl) in enumerate(zip(qlen.tolist(), kvlen.tolist())):
        if ql and kl:
            out[b:b + 1, :, :ql] = _dense_one(q[b:b + 1, :, :ql], k[b:b + 1, :, :kl],
                                              v[b:b + 1, :, :kl], causal, scale)
    return out


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    scale: float | None = None, q_lens: Lengths = None,
                    kv_lens: Lengths = None) -> torch.Tensor:
    """Dense softmax attention with the same masks and conventions as
    ``block_sparse_attention`` (right-down causal, valid tokens ``[0, len)``,
    zeros for queries with no visible key and for padded query positions).

    q [B,Hq,Sq,D], k/v [B,Hkv,Skv,D] -> [B,Hq,Sq,D] in q's dtype.
    """
    who = "dense_attention"
    batch, hq, hkv, sq, skv, dim = check_qkv(q, k, v, who, same_dtype=True)
    check_bool(who, "causal", causal)
    scale = _check_scale(who, "scale", scale, dim)
    qlen = seq_lens_tensor(q_lens, batch, sq, "q_lens", _CPU, who)
    kvlen = seq_lens_tensor(kv_lens, batch, skv, "kv_lens", _CPU, who)
    return _dense(q, k, v, causal, scale, qlen, kvlen)


# --------------------------------------------------------------------------- #
# Block-sparse attention
# --------------------------------------------------------------------------- #


def _native():
    """The native kernel's module, or None where it is not built."""
    from .ops import sparse_attention
    return sparse_attention if sparse_attention.available() else None


def _backend(backend: str, q: torch.Tensor) -> str:
    if backend != "auto":
        return backend
    if q.device.type == "cpu" and _native() is not None and q.dtype in _native().DTYPES:
        return "native"
    if q.device.type == "cpu" and _native() is None:  # reported: status() and one warning
        from .ops import sparse_attention
        sparse_attention.report_fallback()
    if q.device.type == "cuda" and flex.available():
        return "flex"
    return "gather"


def _padding_zeroed(x: torch.Tensor, lens: torch.Tensor, blocks: int, bs: int) -> torch.Tensor:
    """x [B,H,S,D] padded to ``blocks * bs`` positions, every position at or
    past ``lens[b]`` zero (a copy only where there is padding)."""
    seq = x.shape[2]
    if seq == blocks * bs and bool((lens == seq).all()):
        return x
    out = x.new_zeros(*x.shape[:2], blocks * bs, x.shape[3])
    for b, n in enumerate(lens.tolist()):
        out[b, :, :n] = x[b, :, :n]
    return out


@dataclass(frozen=True)
class _Call:
    """A checked block-sparse attention problem: q/k/v and the lists on one
    device, the per-batch lengths on the host."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    idx: torch.Tensor
    lengths: torch.Tensor
    qlen: torch.Tensor
    kvlen: torch.Tensor
    bs: int
    causal: bool
    scale: float
    softcap: float | None


def _flex(c: _Call, want_lse: bool):
    qmax, kmax = ceil_div(c.q.shape[2], c.bs), ceil_div(c.k.shape[2], c.bs)
    device = c.q.device
    if want_lse and device.type == "cpu":
        fail("block_sparse_attention", "backend", "'flex' cannot return the log-sum-exp on CPU "
             "(inductor's CPU FlexAttention lacks it); use 'native' or 'gather'", "'flex'")
    mask = flex.block_mask(c.idx, c.lengths, block_size=c.bs, causal=c.causal,
                           q_len=qmax * c.bs, kv_len=kmax * c.bs, q_lens=c.qlen.to(device),
                           kv_lens=c.kvlen.to(device))
    out, lse = flex.flex_attention_forward(_padding_zeroed(c.q, c.qlen, qmax, c.bs),
                                           _padding_zeroed(c.k, c.kvlen, kmax, c.bs),
                                           _padding_zeroed(c.v, c.kvlen, kmax, c.bs), mask,
                                           c.scale, c.softcap, want_lse)
    sq = c.q.shape[2]
    return out[:, :, :sq], None if lse is None else lse[:, :, :sq]


def _run(c: _Call, backend: str, want_lse: bool = False):
    """``(out, lse)`` of a checked call (lse None unless ``want_lse``); padded
    query positions zero (and -inf)."""
    if backend == "native":
        check_backend_fits("block_sparse_attention", backend, c.q.device, c.q.dtype)
        native = _native()
        if native is None:
            fail("block_sparse_attention", "backend", "'native' is not available here "
                 f"({_native_status()})", "'native'")
        out, lse = native.sparse_attention(c.q, c.k, c.v, c.idx, c.lengths, c.qlen, c.kvlen,
                                           c.bs, c.causal, c.scale, c.softcap, lse=True)
    elif backend == "flex":
        out, lse = _flex(c, want_lse)
    else:
        out, lse = gather_attention(c.q, c.k, c.v, c.idx, c.lengths, c.qlen, c.kvlen, c.bs,
                                    c.causal, c.scale, c.softcap)
    lse = lse.float() if want_lse else None
    pad_q = torch.arange(c.q.shape[2])[None, :] >= c.qlen[:, None]
    if bool(pad_q.any()):
        pad_q = pad_q.to(c.q.device)[:, None, :]
        out = out.masked_fill(pad_q[..., None], 0)
        lse = None if lse is None else lse.masked_fill(pad_q, -math.inf)
    return out.to(c.q.dtype), lse


def _check_softcap(who: str, softcap) -> float | None:
    if softcap is None:
        return None
    if (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
            or not (is_finite(softcap) and softcap > 0)):
        fail(who, "softcap", "must be None or a finite number > 0", softcap)
    return float(softcap)


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    sparse_indices: torch.Tensor, sparse_seq_len: torch.Tensor, *,
    stem_block_size: int | None = None, causal: bool = True, scale: float | None = None,
    softcap: float | None = None, q_lens: Lengths = None, kv_lens: Lengths = None,
    backend: str = "auto", return_lse: bool = False, **renamed,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention restricted to the listed key blocks of each query block.

    Args:
        q: [B, Hq, Sq, D]; k, v: [B, Hkv, Skv, D] (query head h uses KV head
            h // (Hq/Hkv)), one floating dtype and device.
        sparse_indices: [B, Hq, ceil(Sq/Bs), W] integer: the key blocks of
            each row (in [0, ceil(Skv/Bs)), any order, no duplicates); entries
            past the row's length are ignored (the indexer writes -1).
        sparse_seq_len: [B, Hq, ceil(Sq/Bs)] integer: listed blocks per row.
        stem_block_size: Bs, tokens per block (the indexer's; required).
            ``block_size``, its old spelling, still works for one release
            (DeprecationWarning).
        causal: token-level causal mask, right-down aligned: query t sees key
            j iff ``j <= t + kv_len - q_len``.
        scale: softmax scale, default ``1/sqrt(D)``.
        softcap: logit soft-capping (Gemma 2): scaled scores become
            ``softcap * tanh(score / softcap)`` before the softmax.
        q_lens, kv_lens: valid tokens per batch (positions ``[0, len)``).
        backend: ``"auto"``, ``"native"``, ``"flex"`` or ``"gather"`` (see the
            module docstring).
        return_lse: also return the log-sum-exp of the attended scores.

    Returns:
        [B, Hq, Sq, D] in q's dtype; with ``return_lse`` also the float32
        log-sum-exp [B, Hq, Sq] (natural log) of the scores each query
        attended, for merging partial results. Query tokens with no visible
        key among their listed blocks, and padded query positions, are zero
        (log-sum-exp -inf).

    The selection is checked on its device (a few host syncs on CUDA).
    """
    who = "block_sparse_attention"
    block_size = take_renamed(who, renamed, {"stem_block_size": stem_block_size},
                              {"stem_block_size": None})["stem_block_size"]
    batch, hq, hkv, sq, skv, dim = check_qkv(q, k, v, who, same_dtype=True)
    if block_size is None:
        fail(who, "stem_block_size", "is required (the indexer's block size)", None)
    check_int(who, "stem_block_size", block_size, 1)
    check_bool(who, "causal", causal)
    check_bool(who, "return_lse", return_lse)
    scale = _check_scale(who, "scale", scale, dim)
    softcap = _check_softcap(who, softcap)
    _check_backend(who, backend)
    check_backend_fits(who, backend, q.device, q.dtype)
    _check_inference(who, q, k, v)
    _check_selection(who, sparse_indices, sparse_seq_len, batch, hq, ceil_div(sq, block_size),
                     q.device)
    qlen = lens_argument(q_lens, batch, sq, "q_lens", who)
    kvlen = lens_argument(kv_lens, batch, skv, "kv_lens", who)
    out, lse = torch.ops.stem_indexer.block_sparse_attention(
        q, k, v, sparse_indices, sparse_seq_len, qlen, kvlen, block_size, causal, scale,
        softcap, backend, return_lse)
    return (out, lse) if return_lse else out


def _native_status() -> str:
    from .ops import sparse_attention
    return sparse_attention.status()


# --------------------------------------------------------------------------- #
# Stem attention
# --------------------------------------------------------------------------- #


class StemInfo(NamedTuple):
    """What one ``stem_attention`` call did (``return_info=True``).

    ``path`` is ``"sparse"`` (the indexer chose the blocks) or ``"dense"``,
    with ``reason``: ``"decode"`` (fewer than ``min_q_blocks`` query blocks)
    or ``"budget keeps every block"`` (short sequences). ``backend`` is the
    kernel that ran (``"native"``, ``"flex"``, ``"gather"`` or ``"sdpa"``).
    ``density`` = ``kept_pairs / visible_pairs``: attended (query block, key
    block) pairs over the causally visible ones, all batches and heads.
    """

    path: str
    reason: str
    backend: str
    kept_pairs: int
    visible_pairs: int

    @property
    def density(self) -> float:
        return self.kept_pairs / self.visible_pairs if self.visible_pairs else 1.0

    def encode(self) -> torch.Tensor:
        """As an int64 tensor, the form a custom op can return."""
        return torch.tensor([_PATHS.index(self.path), _REASONS.index(self.reason),
                             _KERNELS.index(self.backend), self.kept_pairs, self.visible_pairs])

    @classmethod
    def decode(cls, code: torch.Tensor) -> "StemInfo":
        path, reason, backend, kept, visible = code.tolist()
        return cls(_PATHS[path], _REASONS[reason], _KERNELS[backend], kept, visible)


_PATHS = ("sparse", "dense")
_REASONS = ("", "decode", "budget keeps every block")
_KERNELS = ("native", "flex", "gather", "sdpa")


def _visible_pairs(qlen, kvlen, params: IndexerParams) -> int:
    """Visible (query block, key block) pairs per query head, over the batch."""
    bs = params.stem_block_size
    total = 0
    for q_len, kv_len in zip(qlen.tolist(), kvlen.tolist()):
        qb, kb = ceil_div(q_len, bs), ceil_div(kv_len, bs)
        if qb and kb:
            total += int(contract.visible_blocks(torch.arange(qb), qb, kb, params.causal).sum())
    return total


def _dense_is_exact(qlen, kvlen, prompt, params: IndexerParams) -> bool:
    """True when the indexer would keep, in every row, every key block that
    holds a key visible to the row's tokens: block-sparse == dense then."""
    bs = params.stem_block_size
    qb, kb = ceil_div(qlen, bs), ceil_div(kvlen, bs)
    p = ceil_div(prompt, bs)
    ks = contract.prompt_budget(p, params)
    for b in range(qlen.shape[0]):
        n = int(qb[b])
        if n == 0 or int(kb[b]) == 0:
            continue
        i = torch.arange(n)
        s2 = contract.visible_blocks(i, n, int(kb[b]), params.causal)
        sink_end, cand_end = contract.candidate_range(s2, params.initial_blocks,
                                                      params.window_size)
        budget = contract.row_budget(i + int(kb[b]) - n, p[b], ks[b], params.alpha)
        if bool((budget < cand_end - sink_end).any()):
            return False
        if bool((s2 < _reach(i, qlen[b], kvlen[b], bs, params.causal)).any()):
            return False
    return True


def _reach(i, q_len, kv_len, bs: int, causal: bool) -> torch.Tensor:
    """Key blocks holding a key visible to some token of query blocks ``i``."""
    if not causal:
        return torch.full_like(i, int(ceil_div(kv_len, bs)))
    last_q = torch.minimum((i + 1) * bs, q_len) - 1
    return ceil_div(torch.minimum(kv_len, last_q + kv_len - q_len + 1).clamp(min=0), bs)


def _dense_lists(qlen, kvlen, bs: int, causal: bool, hq: int, qmax: int, kmax: int, device):
    """Lists of every key block each row's tokens can see: block-sparse
    attention on them is dense attention (with its log-sum-exp)."""
    i = torch.arange(qmax)
    lengths = torch.stack([torch.where(i < ceil_div(q_len, bs),
                                       _reach(i, q_len, kv_len, bs, causal), 0)
                           for q_len, kv_len in zip(qlen, kvlen)])
    lengths = lengths[:, None].expand(-1, hq, -1).to(device)
    idx = torch.arange(kmax, device=device).expand(*lengths.shape, kmax)
    return torch.where(idx < lengths[..., None], idx, -1), lengths


def stem_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    causal: bool = True, scale: float | None = None, softcap: float | None = None,
    q_lens: Lengths = None, kv_lens: Lengths = None, num_prompt_tokens: Lengths = None,
    preset: str = "default",
    oam: bool = True, oam_lambda: float = DEFAULT_OAM_LAMBDA, indexer_scale: float | None = None,
    min_q_blocks: int = 2, backend: str = "auto", return_lse: bool = False,
    return_info: bool = False, **indexer_params,
) -> torch.Tensor | tuple:
    """Stem attention in one call: Q/K/V -> indexer -> block-sparse attention.

    Args:
        q: [B, Hq, Sq, D]; k, v: [B, Hkv, Skv, D]; ``Hq % Hkv == 0``.
        causal, scale, softcap, q_lens, kv_lens: as in ``block_sparse_attention``
            (scale defaults to ``1/sqrt(D)``).
        num_prompt_tokens: per-batch prompt length for the budget (>= kv_lens),
            default the KV lengths (chunked prefill passes the full prompt).
        preset: a named budget of ``PRESETS`` (``"default"``, ``"balanced"``,
            ``"tight"``); ``indexer_params`` override its fields.
        oam, oam_lambda: the Output-Aware Metric (``False`` = no value bias).
        indexer_scale: factor folded into ``qflat``. Default ``scale /
            stem_stride``: the indexer's score of a block pair is then the mean
            attention logit of the R*R*Ts token pairs it samples (the indexer
            itself divides by R^2 and sums the Ts groups), so the OAM bias, in
            log-magnitude units, is added to a log attention weight as the
            method intends.
        min_q_blocks: below this many query blocks (``ceil(max q_len / Bs)``),
            e.g. single-token decode, dense attention is used: the indexer
            reads every key to score it, so it cannot save work there.
        backend: ``block_sparse_attention``'s backend.
        return_lse: also return the float32 log-sum-exp [B, Hq, Sq] of the
            scores attended (for merging partial results).
        return_info: also return a ``StemInfo`` (path taken, density).
        **indexer_params: the indexer's parameters by their op names
            (``stem_block_size=128``, ``stem_stride=16``, ``alpha``,
            ``initial_blocks``, ``window_size``, ``k_block_num_rate_medium``,
            ``k_block_num_bias_medium``, ``k_block_num_rate_large``,
            ``k_block_num_bias_large``, ``topk_score_precision``).

    Returns:
        [B, Hq, Sq, D] in q's dtype; with ``return_lse`` and/or
        ``return_info`` a tuple ``(out, lse)``, ``(out, info)`` or
        ``(out, lse, info)``.

    Dense attention (the same masks and zero-output conventions as
    ``dense_attention``) is used when the indexer would keep, in every row,
    every key block the row can see (short sequences: budgets below 56 prompt
    blocks keep all): the result is then the sparse path's, and ``info``
    says ``"dense"``.

    The indexer aligns causality on blocks (its last query block sees its
    last key block). When ``kv_len - q_len`` is not a multiple of the block
    size, a query block's last tokens may be allowed, token-wise, a few keys
    of the block after its last visible one; that block is never listed, so
    those keys are not attended (the sparse path is then not the dense result
    even when every listed row is complete).
    """
    who = "stem_attention"
    batch, hq, hkv, sq, skv, dim = check_qkv(q, k, v, who, same_dtype=True)
    _check_layout(who, q, k, "[B, H, S, D]")
    params, indexer_scale = check_stem_options(
        who, causal=causal, preset=preset, oam=oam, oam_lambda=oam_lambda,
        indexer_scale=indexer_scale, min_q_blocks=min_q_blocks, backend=backend,
        **indexer_params)
    check_backend_fits(who, backend, q.device, q.dtype)
    scale = _check_scale(who, "scale", scale, dim)
    softcap = _check_softcap(who, softcap)
    for name, flag in (("return_lse", return_lse), ("return_info", return_info)):
        check_bool(who, name, flag)
    _check_inference(who, q, k, v)
    if return_info and torch.compiler.is_compiling():
        fail(who, "return_info", "is not available under torch.compile (it reads the "
             "selection on the host); count with the transformers integration's stats instead",
             True)
    qlen = lens_argument(q_lens, batch, sq, "q_lens", who)
    kvlen = lens_argument(kv_lens, batch, skv, "kv_lens", who)
    prompt = (None if num_prompt_tokens is None
              else lens_argument(num_prompt_tokens, batch, 2**31 - 1, "num_prompt_tokens", who))
    out, lse, info = torch.ops.stem_indexer.stem_attention(
        q, k, v, qlen, kvlen, prompt, *(getattr(params, f) for f in contract.PARAM_NAMES),
        scale, softcap, oam, float(oam_lambda), indexer_scale, min_q_blocks, backend,
        return_lse)
    extra = ((lse,) if return_lse else ()) + ((StemInfo.decode(info),) if return_info else ())
    return (out, *extra) if extra else out


def check_stem_options(who: str, *, causal: bool = True, preset: str = "default",
                       oam: bool = True, oam_lambda: float = DEFAULT_OAM_LAMBDA,
                       indexer_scale: float | None = None, min_q_blocks: int = 2,
                       backend: str = "auto",
                       **indexer_params) -> tuple[IndexerParams, float | None]:
    """The checks of ``stem_attention``'s options that need no tensor (the
    indexer's parameters and preset, the OAM, the dense threshold, the
    backend), in one place for every caller that fixes them ahead of the
    call (``integrations.transformers.register``). Returns the indexer's
    parameters and ``indexer_scale`` as a float (or None)."""
    params = IndexerParams.from_kwargs(who, preset=preset, causal=causal, **indexer_params)
    check_bool(who, "oam", oam)
    check_oam_lambda(oam_lambda, who)
    check_int(who, "min_q_blocks", min_q_blocks, 0)
    _check_backend(who, backend)
    if indexer_scale is not None:
        indexer_scale = _check_scale(who, "indexer_scale", indexer_scale, 1)
    return params, indexer_scale


def _check_layout(who: str, q, k, layout: str) -> None:
    """Refuse shapes that can only be another layout's (more heads than any
    model has, and more than tokens)."""
    heads, tokens = (q.shape[1], q.shape[2]) if layout == "[B, H, S, D]" else (q.shape[2],
                                                                               q.shape[1])
    if heads > MAX_HEADS and heads > tokens:
        other = "[B, S, H, D]" if layout == "[B, H, S, D]" else "[B, H, S, D]"
        fail(who, "q", f"is read as {layout}, which gives {heads} heads of {tokens} tokens: is "
             f"it {other}? (stem_attention takes [B, H, S, D], stem_attn_func [B, S, H, D])",
             f"shape {tuple(q.shape)}")


def _stem(q, k, v, qlen, kvlen, prompt, params: IndexerParams, scale, softcap, oam, oam_lambda,
          indexer_scale, min_q_blocks, backend, want_lse):
    """The body of ``stem_attention`` on checked arguments: (out, lse, info)."""
    hq, hkv = q.shape[1], k.shape[1]
    bs, stride = params.stem_block_size, params.stem_stride
    qmax, kmax = ceil_div(q.shape[2], bs), ceil_div(k.shape[2], bs)
    visible = _visible_pairs(qlen, kvlen, params) * hq
    backend = _backend(backend, q)
    reason = ""
    if int(ceil_div(qlen, bs).max()) < min_q_blocks:
        reason = "decode"
    elif _dense_is_exact(qlen, kvlen, prompt, params):
        reason = "budget keeps every block"
    if reason and not (want_lse or softcap):
        out = _dense(q, k, v, params.causal, scale, qlen, kvlen)
        return out, None, StemInfo("dense", reason, "sdpa", visible, visible)
    if reason:  # dense through the block kernels, which give the lse and the softcap
        idx, lengths = _dense_lists(qlen, kvlen, bs, params.causal, hq, qmax, kmax, q.device)
        out, lse = _run(_Call(q, k, v, idx, lengths, qlen, kvlen, bs, params.causal, scale,
                              softcap), backend, want_lse)
        return out, lse, StemInfo("dense", reason, backend, visible, visible)

    inputs = stem_inputs(q, k, v, stem_block_size=bs, stem_stride=stride,
                         q_lens=qlen.to(q.device),
                         kv_lens=kvlen.to(q.device),
                         scale=scale / stride if indexer_scale is None else indexer_scale,
                         oam=oam, oam_lambda=oam_lambda)
    metadata = stem_indexer_metadata(
        inputs.q_seq_lens, inputs.kv_seq_lens, hq, hkv, causal=params.causal,
        stem_block_size=bs, dim_qkflat=inputs.qflat.shape[-1], window_size=params.window_size)
    idx, lengths = run_indexer(
        inputs.qflat, inputs.kflat, inputs.vbias, inputs.q_seq_lens, inputs.kv_seq_lens,
        prompt.to(device=q.device, dtype=torch.int32), metadata, params)
    # The indexer's lists are valid and ascending by contract: no check needed.
    out, lse = _run(_Call(q, k, v, idx, lengths, qlen, kvlen, bs, params.causal, scale,
                          softcap), backend, want_lse)
    return out, lse, StemInfo("sparse", "", backend, int(lengths.sum()), visible)


# --------------------------------------------------------------------------- #
# The two functions as custom ops: opaque to torch.compile (fullgraph too),
# since they read lengths and selections on the host.
# --------------------------------------------------------------------------- #


@torch.library.custom_op("stem_indexer::block_sparse_attention", mutates_args=())
def _block_sparse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     sparse_indices: torch.Tensor, sparse_seq_len: torch.Tensor,
                     q_lens: torch.Tensor, kv_lens: torch.Tensor, block_size: int, causal: bool,
                     scale: float, softcap: float | None, backend: str,
                     want_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    who = "block_sparse_attention"
    sq, skv = q.shape[2], k.shape[2]
    qlen = check_lens_values(q_lens, sq, "q_lens", who)
    kvlen = check_lens_values(kv_lens, skv, "kv_lens", who)
    idx, lengths = _selection_values(who, sparse_indices, sparse_seq_len,
                                     ceil_div(skv, block_size))
    call = _Call(q, k, v, idx, lengths, qlen, kvlen, block_size, causal, scale, softcap)
    out, lse = _run(call, _backend(backend, q), want_lse)
    return out.contiguous(), _lse_or_nan(lse, q)


# The fakes give the real outputs' layout: contiguous, whatever q's strides
# (empty_like would keep a transposed q's, and inductor checks them).
@_block_sparse_op.register_fake
def _(q, k, v, sparse_indices, sparse_seq_len, q_lens, kv_lens, block_size, causal, scale,
      softcap, backend, want_lse):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("stem_indexer::stem_attention", mutates_args=())
def _stem_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: torch.Tensor,
    kv_lens: torch.Tensor, num_prompt_tokens: torch.Tensor | None, causal: bool,
    stem_block_size: int, stem_stride: int, alpha: float, initial_blocks: int,
    window_size: int, k_block_num_rate_medium: float, k_block_num_bias_medium: int,
    k_block_num_rate_large: float, k_block_num_bias_large: int, topk_score_precision: int,
    scale: float, softcap: float | None, oam: bool, oam_lambda: float,
    indexer_scale: float | None, min_q_blocks: int, backend: str, want_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    who = "stem_attention"
    qlen = check_lens_values(q_lens, q.shape[2], "q_lens", who)
    kvlen = check_lens_values(kv_lens, k.shape[2], "kv_lens", who)
    prompt = kvlen
    if num_prompt_tokens is not None:
        prompt = check_lens_values(num_prompt_tokens, 2**31 - 1, "num_prompt_tokens", who)
        contract.check_prompt(prompt, kvlen, who, "kv_lens")
    params = IndexerParams(causal, stem_block_size, stem_stride, alpha, initial_blocks,
                           window_size, k_block_num_rate_medium, k_block_num_bias_medium,
                           k_block_num_rate_large, k_block_num_bias_large, topk_score_precision)
    out, lse, info = _stem(q, k, v, qlen, kvlen, prompt, params, scale, softcap, oam,
                           oam_lambda, indexer_scale, min_q_blocks, backend, want_lse)
    return out.contiguous(), _lse_or_nan(lse, q), info.encode()


@_stem_attention_op.register_fake
def _(q, k, v, *args):
    return (q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32),
            torch.empty(5, dtype=torch.int64, device="cpu"))


def _lse_or_nan(lse: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The op's second output: the log-sum-exp, or NaN where none was asked for."""
    if lse is not None:
        return lse.contiguous()
    return torch.full(q.shape[:3], math.nan, dtype=torch.float32, device=q.device)
