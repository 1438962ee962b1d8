"""Sliding-window causal attention at window cost.

``sliding_window_attention`` computes what ``scaled_dot_product_attention``
computes with a sliding-window causal mask (the mask of Mistral's and
Gemma 2/3's local layers, as transformers builds it:
``masking_utils.sliding_window_causal_mask_function``), without the
S x S square: query ``t`` at key position ``p = t + kv_len - q_len``
(queries are the last ``q_len`` keys) sees key ``j`` iff

    p - window < j <= p        and key j is valid,

so ``window`` keys including its own. The queries are cut into chunks of
``chunk`` tokens; chunk ``c`` needs only the ``chunk + window - 1`` keys
ending at its last query, taken as strided views of K and V (zeros before
position 0, masked). One ``scaled_dot_product_attention`` call per
sequence runs its chunks as batch entries with the boolean mask restricted
to those rows and columns: the cost is ``q_len x (chunk + window - 1)`` instead of
``q_len x kv_len``. With ``softcap`` (Gemma 2) the same chunks run the
model's eager formula (SDPA cannot cap logits), in groups of chunks so that
the score tensor stays small.

Query rows with no visible key (left padding) are zero, as SDPA returns them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import _check_scale, _check_softcap
from ..operator.contract import ceil_div, check_int, fail
from .prepare import check_qkv

__all__ = ["sliding_window_attention", "sliding_window_mask", "default_chunk"]

# Score elements (floats) per group of chunks on the soft-capped path.
_SCORES_PER_GROUP = 1 << 25


def default_chunk(window: int) -> int:
    """Queries per chunk: an eighth of the window rounded up to a multiple of
    64, within [64, 512] (64 for W = 512).

    Each query pays ``chunk + window - 1`` keys, so a smaller chunk wastes
    fewer of them, but more chunks mean more, smaller kernel calls; at 4K
    tokens and W = 512, 64 was the fastest of 64 to 512 in both dtypes
    (``benchmarks/WINDOW.md``). Chunks are views of K and V (one padded
    copy per sequence), so their overlap costs no memory."""
    return min(512, max(64, ceil_div(max(window // 8, 1), 64) * 64))


def sliding_window_mask(key_valid: torch.Tensor, q_len: int, window: int) -> torch.Tensor:
    """The 4-D boolean mask ``[B, 1, q_len, kv_len]`` of the sliding-window
    causal attention above (queries the last ``q_len`` keys), with
    ``key_valid [B, kv_len]`` the keys that are not padding: what SDPA is
    given for such a layer."""
    kv_len = key_valid.shape[1]
    p = torch.arange(q_len, device=key_valid.device)[:, None] + (kv_len - q_len)
    j = torch.arange(kv_len, device=key_valid.device)[None, :]
    band = (j <= p) & (j > p - window)
    return (key_valid[:, None, None, :] & band[None, None]).contiguous()


def _chunks(x: torch.Tensor, left: int, right: int, size: int, step: int) -> torch.Tensor:
    """Windows of ``size`` positions every ``step`` along dim 2 of
    ``x [B, H, S, D]`` padded with ``left``/``right`` zeros: [B, n, H, size, D]
    (a strided view of the padded copy)."""
    x = F.pad(x, (0, 0, left, right))
    return x.unfold(2, size, step).permute(0, 2, 1, 4, 3)


def sliding_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, *,
    key_valid: torch.Tensor | None = None, scale: float | None = None,
    softcap: float | None = None, chunk: int | None = None,
) -> torch.Tensor:
    """Sliding-window causal attention, ``q_len x (chunk + window - 1)`` work.

    Args:
        q: [B, Hq, Sq, D]; k, v: [B, Hkv, Skv, D] with ``Skv >= Sq`` (the
            queries are the last Sq keys) and ``Hq % Hkv == 0``.
        window: keys each query sees, its own included (transformers'
            ``sliding_window``): key j is visible to the query at position p
            iff ``p - window < j <= p``.
        key_valid: [B, Skv] boolean, False at padding keys (default all valid).
        scale: softmax scale, default ``1/sqrt(D)``.
        softcap: logit soft-capping, ``softcap * tanh(score / softcap)``.
        chunk: queries per chunk (default ``default_chunk(window)``).

    Returns:
        [B, Hq, Sq, D] in q's dtype; rows with no visible key are zero.
    """
    who = "sliding_window_attention"
    batch, hq, hkv, sq, skv, dim = check_qkv(q, k, v, who, same_dtype=True)
    check_int(who, "window", window, 1)
    if skv < sq:
        fail(who, "k", f"must have at least as many keys as q has queries ({sq}): the "
             "queries are the last keys", f"{skv} keys")
    if key_valid is not None:
        if (not isinstance(key_valid, torch.Tensor) or key_valid.dtype != torch.bool
                or tuple(key_valid.shape) != (batch, skv)):
            fail(who, "key_valid", f"must be a boolean tensor of shape (B, Skv) = "
                 f"{(batch, skv)}", getattr(key_valid, "shape", type(key_valid).__name__))
        key_valid = key_valid.to(q.device)
    scale = _check_scale(who, "scale", scale, dim)
    softcap = _check_softcap(who, softcap)
    if chunk is not None:
        check_int(who, "chunk", chunk, 1)
    return _windowed(q, k, v, window, key_valid, scale, softcap, chunk)


def _windowed(q, k, v, window, key_valid, scale, softcap, chunk):
    if q.shape[0] > 1:  # one sequence at a time: its chunks stay views of K and V
        return torch.cat([_windowed(q[b:b + 1], k[b:b + 1], v[b:b + 1], window,
                                    None if key_valid is None else key_valid[b:b + 1], scale,
                                    softcap, chunk) for b in range(q.shape[0])])
    batch, hq, sq, dim = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    if sq == 0:
        return q.new_zeros(q.shape)
    off = skv - sq
    # A window of kv_len keys or more masks nothing past causality.
    window = min(window, skv)
    size = min(chunk or default_chunk(window), sq)
    n = ceil_div(sq, size)
    span = size + window - 1
    right = n * size - sq
    # Chunk c's queries are q[c*size : (c+1)*size]; its keys are the span
    # keys from position base + c*size, base = off - (window - 1): K is cut
    # from max(base, 0), padded with zeros on the left up to position base
    # and on the right up to the last chunk's end.
    base = off - (window - 1)
    first, left = max(base, 0), max(-base, 0)
    kc = _chunks(k[:, :, first:], left, right, span, size)
    vc = _chunks(v[:, :, first:], left, right, span, size)
    # Which of a chunk's key columns each row sees: row r, column s holds key
    # j = p - (window - 1) + (s - r), visible iff r <= s <= r + window - 1,
    # j >= 0 (not the left zeros) and key_valid[j].
    r = torch.arange(size, device=q.device)[:, None]
    s = torch.arange(span, device=q.device)[None, :]
    band = (s >= r) & (s <= r + window - 1)
    if key_valid is None:
        key_valid = torch.ones(batch, skv, dtype=torch.bool, device=q.device)
    cols = F.pad(key_valid[:, first:], (left, right), value=False).unfold(1, span, size)
    mask = band[None, None] & cols[:, :, None, :]  # [B, n, size, span]
    qc = F.pad(q, (0, 0, 0, right)).reshape(batch, hq, n, size, dim).transpose(1, 2)
    qc = qc.reshape(batch * n, hq, size, dim)
    kc, vc = kc.reshape(batch * n, hkv, span, dim), vc.reshape(batch * n, hkv, span, dim)
    mask = mask.reshape(batch * n, 1, size, span)
    if softcap is None:
        out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale,
                                             enable_gqa=hq != hkv)
        # A row with no visible key is zero (SDPA's CPU kernels give zero,
        # its CUDA kernels need not).
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0)
    else:
        out = _capped(qc, kc, vc, mask, scale, softcap)
    out = out.reshape(batch, n, hq, size, dim).transpose(1, 2).reshape(batch, hq, n * size, dim)
    return out[:, :, :sq].to(q.dtype)


def _capped(q, k, v, mask, scale, softcap):
    """The eager soft-capped formula on chunk batches (scores in groups)."""
    group = q.shape[1] // k.shape[1]
    per = max(1, _SCORES_PER_GROUP // (q.shape[1] * q.shape[2] * k.shape[2]))
    out = torch.empty_like(q)
    for lo in range(0, q.shape[0], per):
        hi = lo + per
        kk = k[lo:hi].repeat_interleave(group, 1)
        vv = v[lo:hi].repeat_interleave(group, 1)
        scores = torch.matmul(q[lo:hi], kk.transpose(2, 3)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask[lo:hi], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
        out[lo:hi] = torch.matmul(probs, vv)
    return out
