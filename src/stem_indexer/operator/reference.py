"""The golden: docs/CONTRACT.md section 3, one row at a time.

Written to be obviously correct rather than fast. It deliberately does not
use ``contract.py``'s vectorised helpers: the visible range, the forced set,
the budget (with its float32 roundings) and the ranking are restated here
from the contract's text, in scalar Python, so that tests compare the fast
paths against an independent oracle. Scores are the one shared ingredient:
they are float32 matrix products of the bf16 inputs, as the contract defines.

Use it on small and medium problems; it does no input checking beyond what
it needs, and it does not use metadata.
"""

from __future__ import annotations

import ctypes
import math

import torch

__all__ = ["stem_indexer_reference", "reference_budget", "reference_row_selection"]


def _f32(x: float) -> float:
    """Round a Python float to the nearest IEEE float32 (ties to even)."""
    return ctypes.c_float(x).value


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def reference_budget(
    prompt_blocks: int, pos: int, *, alpha: float = 1.0,
    k_block_num_rate_medium: float = 0.2, k_block_num_bias_medium: int = 30,
    k_block_num_rate_large: float = 0.1, k_block_num_bias_large: int = 30,
) -> int:
    """K for a row at right-down aligned position ``pos`` (docs/CONTRACT.md section 3)."""
    p = prompt_blocks
    if p < 56:
        ks = p
    else:
        rate, bias = ((k_block_num_rate_medium, k_block_num_bias_medium) if p < 160
                      else (k_block_num_rate_large, k_block_num_bias_large))
        product = _f32(_f32(p) * _f32(rate))
        # A product beyond float32 range is +inf: an unbounded budget, capped below.
        ks = math.floor(product) + bias if math.isfinite(product) else math.inf

    decay = p - ks
    if pos < ks or decay <= 1:
        k = ks
    else:
        ks32 = _f32(ks)
        ke32 = _f32(ks32 * _f32(alpha))
        t = _f32(_f32(pos - ks) / _f32(decay - 1))
        d = _f32(ke32 - ks32)
        k = math.floor(_f32(t * d + ks32))  # exact product in float64, one rounding
        k = min(max(k, 1), ks)
    return min(max(k, 0), 256)


def reference_row_selection(
    scores: list[float], s2_valid: int, budget: int, initial_blocks: int, window_size: int
) -> list[int]:
    """Selected key blocks of one row, ascending, from its ranked scores."""
    forced = set(range(min(initial_blocks, s2_valid)))
    forced |= set(range(max(s2_valid - window_size, 0), s2_valid))
    candidates = [j for j in range(s2_valid) if j not in forced]
    take = min(budget, len(candidates))
    # The value a score is ranked by: NaN (the one float unequal to itself)
    # ranks as -inf; -0.0 equals +0.0 as Python compares them.
    values = [x if x == x else -math.inf for x in map(scores.__getitem__, candidates)]
    # Highest score first; among equal scores, the lower block index first
    # (Python's sort is stable, with reverse=True too: equal keys keep their
    # ascending order).
    ranked = sorted(range(len(candidates)), key=values.__getitem__, reverse=True)
    return sorted(forced | {candidates[k] for k in ranked[:take]})


def stem_indexer_reference(
    qflat: torch.Tensor, kflat: torch.Tensor, vbias: torch.Tensor,
    q_seq_lens: torch.Tensor, kv_seq_lens: torch.Tensor, *,
    num_prompt_tokens: torch.Tensor | None = None, causal: bool = True,
    stem_block_size: int = 128, stem_stride: int = 16, alpha: float = 1.0,
    initial_blocks: int = 4, window_size: int = 4,
    k_block_num_rate_medium: float = 0.2, k_block_num_bias_medium: int = 30,
    k_block_num_rate_large: float = 0.1, k_block_num_bias_large: int = 30,
    topk_score_precision: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference ``(sparse_indices, sparse_seq_len)`` on CPU, one row at a time."""
    batch, nq, qmax, _ = qflat.shape
    nk, kmax = kflat.shape[1], kflat.shape[2]
    group = nq // nk
    r = stem_block_size // stem_stride
    scale = _f32(1.0 / (r * r))
    indices = torch.full((batch, nq, qmax, kmax), -1, dtype=torch.int32)
    seq_len = torch.zeros((batch, nq, qmax), dtype=torch.int32)
    q_lens = q_seq_lens.tolist()
    kv_lens = kv_seq_lens.tolist()
    prompts = kv_lens if num_prompt_tokens is None else num_prompt_tokens.tolist()
    budget_args = dict(
        alpha=alpha, k_block_num_rate_medium=k_block_num_rate_medium,
        k_block_num_bias_medium=k_block_num_bias_medium,
        k_block_num_rate_large=k_block_num_rate_large,
        k_block_num_bias_large=k_block_num_bias_large,
    )

    for b in range(batch):
        qb = _ceil_div(q_lens[b], stem_block_size)
        kb = _ceil_div(kv_lens[b], stem_block_size)
        if qb == 0 or kb == 0:
            continue
        p = _ceil_div(prompts[b], stem_block_size)
        # The budget depends on the row's position only, not on the head.
        budgets = [reference_budget(p, i + kb - qb, **budget_args) for i in range(qb)]
        for h in range(nq):
            n = h // group
            # Float32 scores of every (query block, key block) pair of this head.
            dots = qflat[b, h, :qb].float().cpu() @ kflat[b, n, :kb].float().cpu().T
            scores = dots * scale + vbias[b, n, :kb].cpu()
            if topk_score_precision == 2:
                scores = scores.to(torch.bfloat16).float()
            scores = scores.tolist()
            lengths = [0] * qb
            for i in range(qb):
                s2 = min(max(kb - qb + i + 1, 0), kb) if causal else kb
                if s2 == 0:
                    continue
                row = reference_row_selection(scores[i], s2, budgets[i], initial_blocks,
                                              window_size)
                lengths[i] = len(row)
                if row:
                    indices[b, h, i, : len(row)] = torch.tensor(row, dtype=torch.int32)
            seq_len[b, h, :qb] = torch.tensor(lengths, dtype=torch.int32)
    return indices, seq_len
