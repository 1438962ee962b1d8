"""Stem attention in the FlashAttention calling conventions.

Most inference code calls attention as ``flash_attn_func(q, k, v, ...)`` on
``[B, S, H, D]`` tensors, or ``flash_attn_varlen_func`` on packed sequences
with cumulative lengths. These functions take the same shapes, the same
arguments in the same order, with the same meanings and defaults, and return
the same layouts, with Stem's selection in between (``stem_attention``): a
drop-in for prefill.

* ``stem_attn_func(q, k, v)``: ``q [B, Sq, Hq, D]``, ``k, v [B, Skv, Hkv, D]``
  -> ``[B, Sq, Hq, D]``; with ``return_lse=True`` also the log-sum-exp
  ``[B, Hq, Sq]`` (float32, natural log) of the scores attended.
* ``stem_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k)``: ``q [total_q, Hq, D]``, ``k, v [total_k, Hkv, D]``, int32
  cumulative lengths ``[B + 1]`` -> ``[total_q, Hq, D]``; the log-sum-exp is
  ``[Hq, total_q]``. Each sequence's result equals that sequence run alone.

FlashAttention's arguments, as FlashAttention means them: ``dropout_p``
(positional; only 0: Stem attention is inference-only), ``softmax_scale``,
``causal`` (default False, as in FlashAttention; causal masks are aligned
bottom-right, as in FlashAttention 2.1 and later), ``window_size`` (only
``(-1, -1)``, no sliding window: a sliding window is refused), ``softcap``
(``0.0`` = off), ``alibi_slopes`` (only None), ``deterministic`` (accepted:
Stem's forward is deterministic), ``return_attn_probs`` (``(out, lse, None)``:
the log-sum-exp, and no probabilities). Stem's own parameters are keywords
that do not clash with them: ``stem_window_blocks`` (the indexer's window of
always-kept key blocks, ``stem_attention``'s ``window_size``), and the rest
of ``stem_attention``'s keywords under their names (``preset``,
``stem_block_size``, ``stem_stride``, ``alpha``, ``oam``, ...).
"""

from __future__ import annotations

import math

import torch

from .attention import stem_attention
from ..pipeline.checks import _check_layout
from ..operator.contract import check_bool, fail

__all__ = ["stem_attn_func", "stem_attn_varlen_func"]

# stem_attention's keywords that these functions set themselves, and why.
_SET_HERE = {"scale": "is softmax_scale here",
             "return_info": "is not available here (these functions return what "
                            "FlashAttention's do; call stem_attention for the info)"}
_SET_BY_VARLEN = {"q_lens": "is given by cu_seqlens_q here",
                  "kv_lens": "is given by cu_seqlens_k here"}


def _flash_arguments(who: str, qkv: tuple, layout: str, dropout_p, causal, window_size,
                     softcap, alibi_slopes, deterministic, return_attn_probs, return_lse,
                     stem_params: dict) -> dict:
    """FlashAttention's arguments checked (q, k, v of ``layout``'s rank first)
    and turned into ``stem_attention``'s keywords (with ``stem_params``, Stem's own)."""
    rank = layout.count(",") + 1
    for name, x in zip("qkv", qkv):
        if not isinstance(x, torch.Tensor) or x.dim() != rank:
            fail(who, name, f"must be a {rank}-D tensor {layout}",
                 f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__)
    if (isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float))
            or dropout_p != 0):
        fail(who, "dropout_p", "must be 0.0: Stem attention is inference-only (no dropout)",
             dropout_p)
    check_bool(who, "causal", causal)
    for name, flag in (("deterministic", deterministic), ("return_attn_probs", return_attn_probs),
                       ("return_lse", return_lse)):
        check_bool(who, name, flag)
    if alibi_slopes is not None:
        fail(who, "alibi_slopes", "must be None: Stem attention has no ALiBi biases",
             type(alibi_slopes).__name__)
    params = dict(stem_params)
    reserved = {**_SET_HERE, **(_SET_BY_VARLEN if who == "stem_attn_varlen_func" else {})}
    for key, why in reserved.items():
        if key in params:
            fail(who, key, why, repr(params[key]))
    window_blocks = params.pop("stem_window_blocks", None)
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) for w in window_size)):
        fail(who, "window_size", "must be a pair of ints (left, right), -1 for no limit (the "
             "indexer's window of kept blocks is stem_window_blocks)", repr(window_size))
    left, right = window_size
    # FlashAttention ignores the right limit of a causal call (it is 0 there).
    if left != -1 or (right != -1 and not causal):
        fail(who, "window_size", "must be (-1, -1): a sliding window (FlashAttention's "
             "local attention) is not supported by Stem attention (the indexer's window of "
             "always-kept blocks is stem_window_blocks)", repr(tuple(window_size)))
    if window_blocks is not None:
        params["window_size"] = window_blocks
    if softcap is not None:
        if (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                or not (softcap == 0 or 0 < softcap < math.inf)):
            fail(who, "softcap", "must be 0.0 (off, FlashAttention's default), None or a "
                 "finite number > 0", softcap)
        softcap = softcap if softcap > 0 else None
    return dict(causal=causal, softcap=softcap, return_lse=return_lse or return_attn_probs,
                **params)


def _flash_result(out, lse, return_lse: bool, return_attn_probs: bool):
    """What FlashAttention returns: the output; with ``return_attn_probs``
    ``(out, lse, None)`` (no probabilities); with ``return_lse`` ``(out, lse)``."""
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


def stem_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                   softmax_scale: float | None = None, causal: bool = False,
                   window_size: tuple[int, int] = (-1, -1), softcap: float | None = 0.0,
                   alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                   return_attn_probs: bool = False, *, return_lse: bool = False,
                   **stem_params) -> torch.Tensor | tuple:
    """Stem attention on ``[B, S, H, D]`` tensors, with ``flash_attn_func``'s signature.

    Args:
        q: [B, Sq, Hq, D]; k, v: [B, Skv, Hkv, D], ``Hq % Hkv == 0``.
        dropout_p: must be 0.0 (inference only).
        softmax_scale: default ``1/sqrt(D)``.
        causal: bottom-right aligned causal mask; default False, as in
            FlashAttention (prefill wants ``causal=True``).
        window_size: must be ``(-1, -1)`` (no sliding window; with
            ``causal=True`` the right limit is ignored, as FlashAttention
            does). The indexer's window is ``stem_window_blocks``.
        softcap: logit soft-capping (``softcap * tanh(score / softcap)``);
            ``0.0`` (or None) is off.
        alibi_slopes: must be None.
        deterministic: accepted; the forward pass is deterministic anyway.
        return_attn_probs: return ``(out, lse, None)`` as FlashAttention's
            ``(out, softmax_lse, S_dmask)``: the log-sum-exp, no probabilities.
        return_lse: also return the float32 log-sum-exp [B, Hq, Sq].
        **stem_params: ``stem_attention``'s keyword arguments (``preset``,
            ``stem_block_size``, ``stem_stride``, ``alpha``, ``oam``, ...),
            with ``stem_window_blocks`` for its ``window_size``.

    Returns:
        [B, Sq, Hq, D] in q's dtype, and the log-sum-exp when asked.
    """
    who = "stem_attn_func"
    kwargs = _flash_arguments(who, (q, k, v), "[B, S, H, D]", dropout_p, causal, window_size,
                              softcap, alibi_slopes, deterministic, return_attn_probs,
                              return_lse, stem_params)
    _check_layout(who, q, k, "[B, S, H, D]")
    result = stem_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            scale=softmax_scale, **kwargs)
    want_lse = kwargs["return_lse"]
    out = (result[0] if want_lse else result).transpose(1, 2).contiguous()
    return _flash_result(out, result[1] if want_lse else None, return_lse, return_attn_probs)


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
                          max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                          softmax_scale: float | None = None, causal: bool = False,
                          window_size: tuple[int, int] = (-1, -1), softcap: float | None = 0.0,
                          alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                          return_attn_probs: bool = False, block_table: torch.Tensor | None = None,
                          *, return_lse: bool = False, **stem_params) -> torch.Tensor | tuple:
    """Stem attention on packed sequences, with ``flash_attn_varlen_func``'s signature.

    Args:
        q: [total_q, Hq, D]; k, v: [total_k, Hkv, D]; sequence b holds tokens
            ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1`` of q (and likewise k, v).
        cu_seqlens_q, cu_seqlens_k: int32 [B + 1], from 0 to the token count.
        max_seqlen_q, max_seqlen_k: at least the longest sequence of each.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
            deterministic, return_attn_probs, return_lse, **stem_params: as in
            ``stem_attn_func`` (``causal`` default False, as in FlashAttention).
        block_table: must be None (no paged KV cache).

    Returns:
        [total_q, Hq, D] in q's dtype, and with ``return_lse`` (or
        ``return_attn_probs``) the float32 log-sum-exp [Hq, total_q].
    """
    who = "stem_attn_varlen_func"
    kwargs = _flash_arguments(who, (q, k, v), "[total, H, D]", dropout_p, causal, window_size,
                              softcap, alibi_slopes, deterministic, return_attn_probs,
                              return_lse, stem_params)
    if block_table is not None:
        fail(who, "block_table", "must be None: a paged KV cache is not supported",
             type(block_table).__name__)
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
                            _pad(v, cu_k, max(kv_lens)), scale=softmax_scale, q_lens=q_lens,
                            kv_lens=kv_lens, **kwargs)
    want_lse = kwargs["return_lse"]
    out = _unpad(result[0] if want_lse else result, cu_q)
    lse = (_unpad(result[1][..., None], cu_q)[..., 0].transpose(0, 1).contiguous()
           if want_lse else None)
    return _flash_result(out, lse, return_lse, return_attn_probs)
