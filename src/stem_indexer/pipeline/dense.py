"""Dense attention with ``block_sparse_attention``'s masks and conventions:
the path ``stem_attention`` takes where sparsity cannot help, and the meaning
of "exact" for the sparse one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import _check_scale
from ..operator.contract import check_bool
from .prepare import Lengths, check_qkv, seq_lens_tensor

__all__ = ["dense_attention"]

_CPU = torch.device("cpu")


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
