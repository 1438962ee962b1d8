"""``stem_attention`` and ``block_sparse_attention`` as custom ops
(``torch.ops.stem_indexer.*``): opaque to torch.compile (fullgraph too), since
they read lengths and selections on the host. Their fakes give the real
outputs' shapes, dtypes and (contiguous) layouts. The indexer's own ops are
registered in ``ops/library.py``."""

from __future__ import annotations

import math

import torch

from ..operator import contract
from .checks import _selection_values
from ..operator.contract import IndexerParams, ceil_div
from .dispatch import _backend, _Call, _run, check_triton_lengths
from .plan import Shape, cached_plan, execute
from .prepare import check_lens_values
from .probe import MISS_CHECK_BLOCKS, MISS_CHECK_QUERIES

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
    dense_above: float = 1.0, exact_tail: int = 0, miss_check: float = 0.0,
    miss_check_queries: int = MISS_CHECK_QUERIES, miss_check_blocks: int = MISS_CHECK_BLOCKS,
    miss_check_from: int = 0,
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
    if backend == "triton":
        check_triton_lengths(who, qlen, kvlen, stem_block_size, causal, want_lse)
    # One plan per batch shape and settings: the layers of a forward pass share it.
    shape = Shape(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
                  q.device, q.dtype)
    plan = cached_plan(shape, tuple(qlen.tolist()), tuple(kvlen.tolist()),
                       tuple(prompt.tolist()), params, scale, softcap, oam, oam_lambda,
                       indexer_scale, min_q_blocks, backend, want_lse, dense_above, exact_tail)
    out, lse, lengths, widened = execute(q, k, v, plan, (miss_check, miss_check_queries,
                                                         miss_check_blocks, miss_check_from))
    info = plan.info
    if widened == plan.batch:  # the miss check widened every batch: dense attention
        info = info._replace(path="dense", reason="miss check", kept_pairs=info.visible_pairs)
    elif lengths is not None:  # the sparse path: the pairs its lists keep
        info = info._replace(kept_pairs=int(lengths.sum()))
    return out.contiguous(), _lse_or_nan(lse, q), info.encode()

@_stem_attention_op.register_fake
def _(q, k, v, *args):
    return (q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32),
            torch.empty(5, dtype=torch.int64, device="cpu"))

@torch.library.custom_op("stem_indexer::planned_attention", mutates_args=())
def _planned_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          sparse_indices: torch.Tensor, sparse_seq_len: torch.Tensor,
                          q_lens: torch.Tensor, kv_lens: torch.Tensor,
                          q_lens_device: torch.Tensor, kv_lens_device: torch.Tensor,
                          q_valid: torch.Tensor | None, block_size: int, causal: bool,
                          scale: float, softcap: float | None, kernel: str,
                          want_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_sparse_attention`` for ``plan.stem_run``: the lists are the
    indexer's (or the plan's); the lengths (on the host and on q's device),
    the valid queries and the kernel are the plan's, all checked when it was
    made, so nothing is checked again and nothing is copied from the host."""
    call = _Call(q, k, v, sparse_indices, sparse_seq_len, q_lens, kv_lens, block_size, causal,
                 scale, softcap, (q_lens_device, kv_lens_device, q_valid))
    out, lse = _run(call, kernel, want_lse)
    return out.contiguous(), _lse_or_nan(lse, q)

@_planned_attention_op.register_fake
def _(q, k, v, sparse_indices, sparse_seq_len, q_lens, kv_lens, q_lens_device, kv_lens_device,
      q_valid, block_size, causal, scale, softcap, kernel, want_lse):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)

def _lse_or_nan(lse: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The op's second output: the log-sum-exp, or NaN where none was asked for."""
    if lse is not None:
        return lse.contiguous()
    return torch.full(q.shape[:3], math.nan, dtype=torch.float32, device=q.device)
