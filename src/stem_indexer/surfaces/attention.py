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
* ``"triton"``: the paged entry point's Triton kernel
  (``ops/triton/paged_attention.py``) on the tensors cut into one page per
  block (CUDA, or CPU under the Triton interpreter; causal, no log-sum-exp,
  and every batch's ``kv_len - q_len`` a whole number of blocks): the
  candidate to replace FlexAttention on CUDA, timed beside it by
  ``benchmarks/gpu/gpu_check.sh --all``;
* ``"auto"`` (default): ``"native"`` on CPU where it is built (float32 and
  bfloat16), ``"flex"`` on CUDA, else ``"gather"`` (float16 and float64 on CPU).

Both functions are inference-only: called with autograd recording on a tensor
that requires grad, they raise (use ``torch.no_grad()`` or
``torch.inference_mode()``), on every path alike.

``stem_attention`` runs the whole Stem pipeline: ``prepare.stem_inputs`` ->
indexer metadata -> indexer -> ``block_sparse_attention``, and takes dense
attention where sparsity cannot help (see its docstring).

This module is the public API; each part has its own home: the argument
checks in ``checks.py``, dense attention in ``dense.py``, the choice of path
and the pipeline's body in ``plan.py`` (``stem_plan`` / ``stem_run``, which
``stem_attention`` runs on), the choice of kernel in ``dispatch.py``, the
two functions' custom ops in ``attention_ops.py``, and the rules "dense when the budget keeps
every block" (``contract.dense_is_exact``) and "dense when it keeps more than
``dense_above`` of the pairs" (``contract.budget_pairs``) beside the budget.
"""

from __future__ import annotations

import torch

from ..operator.contract import (DEFAULT_EXACT_TAIL, PARAM_NAMES, ceil_div, check_bool, check_int,
                                 fail)
from ..pipeline import attention_ops as _attention_ops  # noqa: F401  (registers the two ops)
from ..pipeline.checks import (_check_backend, _check_inference, _check_layout, _check_scale,
                               _check_selection, _check_softcap, check_backend_fits,
                               check_call_options)
from ..pipeline.dense import dense_attention
from ..pipeline.dispatch import StemInfo
from ..pipeline.prepare import DEFAULT_OAM_LAMBDA, Lengths, check_qkv, lens_argument
from ..pipeline.probe import MISS_CHECK_BLOCKS, MISS_CHECK_QUERIES, check_miss

__all__ = ["block_sparse_attention", "dense_attention", "stem_attention", "StemInfo"]


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    sparse_indices: torch.Tensor, sparse_seq_len: torch.Tensor, *,
    stem_block_size: int | None = None, causal: bool = True, scale: float | None = None,
    softcap: float | None = None, q_lens: Lengths = None, kv_lens: Lengths = None,
    backend: str = "auto", return_lse: bool = False,
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
        causal: token-level causal mask, right-down aligned: query t sees key
            j iff ``j <= t + kv_len - q_len``.
        scale: softmax scale, default ``1/sqrt(D)``.
        softcap: logit soft-capping (Gemma 2): scaled scores become
            ``softcap * tanh(score / softcap)`` before the softmax.
        q_lens, kv_lens: valid tokens per batch (positions ``[0, len)``).
        backend: ``"auto"``, ``"native"``, ``"flex"``, ``"gather"`` or ``"triton"`` (see the
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
    block_size = stem_block_size
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


def stem_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    causal: bool = True, scale: float | None = None, softcap: float | None = None,
    q_lens: Lengths = None, kv_lens: Lengths = None, num_prompt_tokens: Lengths = None,
    preset: str = "default", oam: bool = True, oam_lambda: float = DEFAULT_OAM_LAMBDA,
    indexer_scale: float | None = None, min_q_blocks: int = 2, dense_above: float | None = None,
    exact_tail: int = DEFAULT_EXACT_TAIL, miss_check: float = 0.0,
    miss_check_queries: int = MISS_CHECK_QUERIES, miss_check_blocks: int = MISS_CHECK_BLOCKS,
    miss_check_from: int = 0, backend: str = "auto", return_lse: bool = False,
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
        dense_above: dense attention is used when the budget keeps more than
            this share of the causally visible (query block, key block) pairs
            (``contract.budget_pairs``, counted from the budget before any
            score): there, scoring every block costs more than the dropped
            pairs save, and dense attention is exact. ``1.0``: never for this
            reason. Default (None): ``contract.default_dense_above`` for q's
            device and dtype, the measured break-even (``contract.DENSE_ABOVE``;
            ``benchmarks/WINDOW.md``, "Where Stem steps aside").
        exact_tail: the prompt's last ``exact_tail`` tokens (a retrieval
            prompt's question) attend exactly: the query blocks holding them
            list every key block their tokens can see, whatever the budget
            (``contract.tail_rows``; the prompt is ``num_prompt_tokens``, so
            only the chunk that holds its end is widened). Default 128
            (``contract.DEFAULT_EXACT_TAIL``): with 128-token blocks, one or
            two rows per head; 0: every row is the indexer's selection.
            ``benchmarks/QUALITY.md`` ("An exact question block") measures it.
        miss_check, miss_check_queries, miss_check_blocks, miss_check_from:
            the selection checked against exact attention (0: off, the
            default): in each causal prefill (``q_len == kv_len``) whose
            lists keep more than ``miss_check`` less of a sample's attention
            than as many heaviest blocks (``plan.widen_missed``), the query
            blocks from token ``miss_check_from`` (0) on attend every block
            they can see (``info`` reason ``"miss check"`` when every batch
            did, from 0). Not inside a CUDA graph capture.
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
    says ``"dense"``. It is also used, exact rather than sparse, when the
    budget keeps more than ``dense_above`` of the visible pairs (``info``:
    ``"dense"``, reason ``"budget keeps most blocks"``).

    The indexer aligns causality on blocks (its last query block sees its
    last key block). When ``kv_len - q_len`` is not a multiple of the block
    size, a query block's last tokens may be allowed, token-wise, a few keys
    of the block after its last visible one; that block is never listed, so
    those keys are not attended (the sparse path is then not the dense result
    even when every listed row is complete).
    """
    who = "stem_attention"
    check_miss(who, miss_check, miss_check_queries, miss_check_blocks, miss_check_from)
    params, indexer_scale, scale, softcap, dense_above, lengths = _stem_arguments(
        who, q, k, v, causal=causal, scale=scale, softcap=softcap, q_lens=q_lens,
        kv_lens=kv_lens, num_prompt_tokens=num_prompt_tokens, preset=preset, oam=oam,
        oam_lambda=oam_lambda, indexer_scale=indexer_scale, min_q_blocks=min_q_blocks,
        dense_above=dense_above, exact_tail=exact_tail, backend=backend,
        return_lse=return_lse, return_info=return_info, **indexer_params)
    out, lse, info = torch.ops.stem_indexer.stem_attention(
        q, k, v, *lengths, *(getattr(params, f) for f in PARAM_NAMES),
        scale, softcap, oam, float(oam_lambda), indexer_scale, min_q_blocks, backend,
        return_lse, float(dense_above), exact_tail, float(miss_check), miss_check_queries,
        miss_check_blocks, miss_check_from)
    extra = ((lse,) if return_lse else ()) + ((StemInfo.decode(info),) if return_info else ())
    return (out, *extra) if extra else out


def _stem_arguments(who, q, k, v, *, causal, scale, softcap, q_lens, kv_lens,
                    num_prompt_tokens, oam, oam_lambda, indexer_scale, dense_above, backend,
                    return_lse, return_info, **options):
    """``stem_attention``'s arguments checked (every path alike, so that a
    call that would run dense checks as a sparse one would): ``(params,
    indexer_scale, scale, softcap, dense_above, (qlen, kvlen, prompt))``."""
    batch, hq, hkv, sq, skv, dim = check_qkv(q, k, v, who, same_dtype=True)
    _check_layout(who, q, k, "[B, H, S, D]")
    params, indexer_scale, scale, softcap, dense_above = check_call_options(
        who, q.device, q.dtype, dim, scale=scale, softcap=softcap, dense_above=dense_above,
        causal=causal, oam=oam, oam_lambda=oam_lambda, indexer_scale=indexer_scale,
        backend=backend, **options)
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
    return params, indexer_scale, scale, softcap, dense_above, (qlen, kvlen, prompt)
