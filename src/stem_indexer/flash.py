"""Stem attention in the FlashAttention calling conventions.

Most inference code calls attention as ``flash_attn_func(q, k, v, ...)`` on
``[B, S, H, D]`` tensors, or ``flash_attn_varlen_func`` on packed sequences
with cumulative lengths. These functions take the same shapes and return the
same layouts, with Stem's selection in between (``stem_attention``): a
drop-in for prefill.

* ``stem_attn_func(q, k, v)``: ``q [B, Sq, Hq, D]``, ``k, v [B, Skv, Hkv, D]``
  -> ``[B, Sq, Hq, D]``; with ``return_lse=True`` also the log-sum-exp
  ``[B, Hq, Sq]`` (float32, natural log) of the scores attended.
* ``stem_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k)``: ``q [total_q, Hq, D]``, ``k, v [total_k, Hkv, D]``, int32
  cumulative lengths ``[B + 1]`` -> ``[total_q, Hq, D]``; the log-sum-exp is
  ``[Hq, total_q]``. Each sequence's result equals that sequence run alone.

Causal masks are aligned bottom-right (the last query sees the last key), as
in FlashAttention 2.1 and later. The indexer's parameters and presets are
keyword arguments, as in ``stem_attention``.
"""

from __future__ import annotations

import torch

from .attention import _check_layout, stem_attention
from .contract import fail

__all__ = ["stem_attn_func", "stem_attn_varlen_func"]


def stem_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   softmax_scale: float | None = None, causal: bool = True,
                   softcap: float | None = None, return_lse: bool = False,
                   **stem_params) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Stem attention on ``[B, S, H, D]`` tensors (``flash_attn_func``'s layout).

    Args:
        q: [B, Sq, Hq, D]; k, v: [B, Skv, Hkv, D], ``Hq % Hkv == 0``.
        softmax_scale: default ``1/sqrt(D)``.
        causal: bottom-right aligned causal mask.
        softcap: logit soft-capping (``softcap * tanh(score / softcap)``).
        return_lse: also return the float32 log-sum-exp [B, Hq, Sq].
        **stem_params: ``stem_attention``'s keyword arguments (``preset``,
            ``stem_block_size``, ``alpha``, ``oam``, ...).

    Returns:
        [B, Sq, Hq, D] in q's dtype, and the log-sum-exp when asked.
    """
    who = "stem_attn_func"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            fail(who, name, "must be a 4-D tensor [B, S, H, D]",
                 f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__)
    _check_layout(who, q, k, "[B, S, H, D]")
    result = stem_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            causal=causal, scale=softmax_scale, softcap=softcap,
                            return_lse=return_lse, **stem_params)
    out = (result[0] if return_lse else result).transpose(1, 2).contiguous()
    return (out, result[1]) if return_lse else out


def _check_cu(who: str, name: str, cu, total: int, device) -> list[int]:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
        fail(who, name, "must be a 1-D int32 tensor of cumulative lengths [B + 1]",
             f"{getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}")
    if cu.device != device:
        fail(who, name, f"must be on q's device ({device})", cu.device)
    values = cu.tolist()
    if len(values) < 2 or values[0] != 0 or values[-1] != total:
        fail(who, name, f"must start at 0 and end at the token count ({total})", values)
    if any(b < a for a, b in zip(values, values[1:])):
        fail(who, name, "must not decrease", values)
    return values


def _pad(x: torch.Tensor, cu: list[int], max_len: int) -> torch.Tensor:
    """Packed [total, H, D] -> [B, H, max_len, D], padding zero."""
    out = x.new_zeros(len(cu) - 1, max_len, *x.shape[1:])
    for b, (start, end) in enumerate(zip(cu, cu[1:])):
        out[b, :end - start] = x[start:end]
    return out.transpose(1, 2)


def _unpad(x: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """[B, H, max_len, ...] -> packed [total, H, ...]."""
    return torch.cat([x[b, :, :end - start].transpose(0, 1)
                      for b, (start, end) in enumerate(zip(cu, cu[1:]))])


def stem_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          max_seqlen_q: int, max_seqlen_k: int, *,
                          softmax_scale: float | None = None, causal: bool = True,
                          softcap: float | None = None, return_lse: bool = False,
                          **stem_params) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Stem attention on packed sequences (``flash_attn_varlen_func``'s layout).

    Args:
        q: [total_q, Hq, D]; k, v: [total_k, Hkv, D]; sequence b holds tokens
            ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1`` of q (and likewise k, v).
        cu_seqlens_q, cu_seqlens_k: int32 [B + 1], from 0 to the token count.
        max_seqlen_q, max_seqlen_k: at least the longest sequence of each.
        softmax_scale, causal, softcap, return_lse, **stem_params: as in
            ``stem_attn_func``.

    Returns:
        [total_q, Hq, D] in q's dtype, and with ``return_lse`` the float32
        log-sum-exp [Hq, total_q].
    """
    who = "stem_attn_varlen_func"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            fail(who, name, "must be a 3-D tensor [total, H, D]",
                 f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__)
    cu_q = _check_cu(who, "cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    cu_k = _check_cu(who, "cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
    if len(cu_q) != len(cu_k):
        fail(who, "cu_seqlens_k", f"must have as many sequences as cu_seqlens_q "
             f"({len(cu_q) - 1})", len(cu_k) - 1)
    q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
    kv_lens = [b - a for a, b in zip(cu_k, cu_k[1:])]
    for name, wanted, given in (("max_seqlen_q", max(q_lens), max_seqlen_q),
                                ("max_seqlen_k", max(kv_lens), max_seqlen_k)):
        if isinstance(given, bool) or not isinstance(given, int) or given < wanted:
            fail(who, name, f"must be an int >= the longest sequence ({wanted})", given)
    result = stem_attention(_pad(q, cu_q, max(q_lens)), _pad(k, cu_k, max(kv_lens)),
                            _pad(v, cu_k, max(kv_lens)), causal=causal, scale=softmax_scale,
                            softcap=softcap, q_lens=q_lens, kv_lens=kv_lens,
                            return_lse=return_lse, **stem_params)
    out = _unpad(result[0] if return_lse else result, cu_q)
    if not return_lse:
        return out
    return out, _unpad(result[1][..., None], cu_q)[..., 0].transpose(0, 1).contiguous()
