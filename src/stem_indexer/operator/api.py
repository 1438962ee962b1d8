"""Plainly named Python functions for the two ops, with their contracts."""

from __future__ import annotations

import dataclasses

import torch

from .contract import IndexerParams, check_indexer_inputs
from .ops import library as _library  # noqa: F401  (registers the ops)

__all__ = ["stem_indexer", "stem_indexer_metadata", "run_indexer"]


def stem_indexer_metadata(
    q_seq_lens: torch.Tensor, kv_seq_lens: torch.Tensor, q_heads: int, kv_heads: int, *,
    causal: bool = True, stem_block_size: int = 128, dim_qkflat: int = 2048,
    window_size: int = 4,
) -> torch.Tensor:
    """Build the work plan ``npu_stem_indexer`` requires (``custom::npu_stem_indexer_metadata``).

    Args:
        q_seq_lens: (B,) int32, query tokens per batch.
        kv_seq_lens: (B,) int32, KV tokens per batch.
        q_heads, kv_heads: Nq and Nk of the main call (Nq % Nk == 0).
        causal, stem_block_size, window_size: as in the main call.
        dim_qkflat: Df, the last dim of qflat/kflat in the main call.

    Returns:
        (M,) int32 with ``M = AlignUp(16 + B*kv_heads*(36+72)*16, 4096)``, on
        the device of ``q_seq_lens``. It records what it was built for; the
        main op rejects it for any other lengths, heads, causal, block size,
        Df or window size.
    """
    return torch.ops.custom.npu_stem_indexer_metadata(
        q_seq_lens, kv_seq_lens, q_heads, kv_heads, causal=causal,
        stem_block_size=stem_block_size, dim_qkflat=dim_qkflat, window_size=window_size)


def stem_indexer(
    qflat: torch.Tensor, kflat: torch.Tensor, vbias: torch.Tensor,
    q_seq_lens: torch.Tensor, kv_seq_lens: torch.Tensor, *,
    num_prompt_tokens: torch.Tensor | None = None, metadata: torch.Tensor | None = None,
    causal: bool = True, stem_block_size: int = 128, stem_stride: int = 16,
    alpha: float = 1.0, initial_blocks: int = 4, window_size: int = 4,
    k_block_num_rate_medium: float = 0.2, k_block_num_bias_medium: int = 30,
    k_block_num_rate_large: float = 0.1, k_block_num_bias_large: int = 30,
    topk_score_precision: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select the key blocks each query block attends to (``custom::npu_stem_indexer``).

    For every row (batch b, query head h, query block i < ceil(q_seq_lens[b]/Bs)),
    with KV head n = h // (Nq/Nk) and R = stem_block_size / stem_stride:

    * score ``S[j] = dot(qflat[b,h,i], kflat[b,n,j]) / R^2 + vbias[b,n,j]``
      (bf16 inputs, float32 accumulation);
    * visible key blocks ``0 .. s2-1``; with ``causal`` the last query block
      sees the last key block (right-down alignment), else all of them;
    * the first ``initial_blocks`` (sink) and last ``window_size`` (window)
      visible blocks are always kept;
    * of the other visible blocks, the K highest-scoring are kept, where K
      decays with position (``alpha``) from a budget set by the prompt length
      (``num_prompt_tokens``, default ``kv_seq_lens``) and is at most 256;
      equal scores go to the lower block index; ``topk_score_precision=2``
      ranks scores rounded to bfloat16.

    Args:
        qflat: (B, Nq, Qmax, Df) bfloat16 query block representations.
        kflat: (B, Nk, Kmax, Df) bfloat16 key block representations.
        vbias: (B, Nk, Kmax) float32 per-key-block bias (Output-Aware Metric).
        q_seq_lens, kv_seq_lens: (B,) int32 token counts (not blocks).
        num_prompt_tokens: (B,) int32 or None; must be >= kv_seq_lens.
        metadata: from ``stem_indexer_metadata`` for the same inputs; built
            here when None.

    Returns:
        ``sparse_indices`` (B, Nq, Qmax, Kmax) int32: the kept key blocks of
        each row, ascending, then -1; ``sparse_seq_len`` (B, Nq, Qmax) int32:
        how many are kept. Rows past a batch's query blocks are empty.

    Raises:
        StemIndexerInputError (a ValueError) naming the argument and the rule
        for any input outside the contract.
    """
    params = IndexerParams(
        causal=causal, stem_block_size=stem_block_size, stem_stride=stem_stride, alpha=alpha,
        initial_blocks=initial_blocks, window_size=window_size,
        k_block_num_rate_medium=k_block_num_rate_medium,
        k_block_num_bias_medium=k_block_num_bias_medium,
        k_block_num_rate_large=k_block_num_rate_large,
        k_block_num_bias_large=k_block_num_bias_large,
        topk_score_precision=topk_score_precision)
    params.check()
    if metadata is None:
        # Check the inputs first, so that errors name this call's arguments,
        # not the metadata op's parameters derived from them.
        check_indexer_inputs(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens,
                             None, params, metadata_required=False)
        metadata = stem_indexer_metadata(
            q_seq_lens, kv_seq_lens, qflat.shape[1], kflat.shape[1], causal=causal,
            stem_block_size=stem_block_size, dim_qkflat=qflat.shape[-1],
            window_size=window_size)
    return run_indexer(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens,
                       metadata, params)


def run_indexer(qflat: torch.Tensor, kflat: torch.Tensor, vbias: torch.Tensor,
                q_seq_lens: torch.Tensor, kv_seq_lens: torch.Tensor,
                num_prompt_tokens: torch.Tensor | None, metadata: torch.Tensor,
                params: IndexerParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``custom::npu_stem_indexer`` with its attributes from ``params``."""
    return torch.ops.custom.npu_stem_indexer(
        qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens=num_prompt_tokens,
        metadata=metadata, **dataclasses.asdict(params))
