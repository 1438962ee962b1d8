"""The float64 reference of softmax attention under a token mask.

Every attention path of the package (dense, block-sparse on each backend,
windowed, the FlashAttention-style and transformers faces) is tested against
``reference_attention``: scores, the soft-cap and the softmax in float64 on
the CPU, with the package's conventions for what a query cannot see.
``token_mask`` turns a block selection into the token mask it means.
"""

from __future__ import annotations

import torch


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None = None, *, scale: float | None = None,
                        softcap: float | None = None, causal: bool = False,
                        return_lse: bool = False):
    """Softmax attention of q [B, Hq, Sq, D] over k, v [B, Hkv, Skv, D] in
    float64 on the CPU (query head h reads KV head h // (Hq / Hkv)).

    ``mask`` (bool, broadcastable to [B, Hq, Sq, Skv]; True: query t may see
    key j) and ``causal`` (right-down aligned: ``j <= t + Skv - Sq``) both
    restrict the keys. Scores are ``q k^T * scale`` (default ``1/sqrt(D)``),
    with ``softcap``: ``softcap * tanh(score / softcap)``. A query that sees
    no key gets 0 (log-sum-exp -inf). Keys a query does not see take no part
    in its output, NaN and inf included; NaN and inf among those it sees act
    as in plain softmax attention. Returns the float64 output [B, Hq, Sq, D],
    and with ``return_lse`` its float64 log-sum-exp [B, Hq, Sq]."""
    group = q.shape[1] // k.shape[1]
    qd = q.detach().cpu().double()
    kd, vd = (x.detach().cpu().double().repeat_interleave(group, 1) for x in (k, v))
    sq, skv = q.shape[2], k.shape[2]
    scores = qd @ kd.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    seen = torch.ones(sq, skv, dtype=torch.bool)
    if causal:
        seen = torch.arange(skv)[None, :] <= torch.arange(sq)[:, None] + skv - sq
    if mask is not None:
        seen = seen & mask.cpu()
    seen = seen.expand_as(scores)
    scores = scores.masked_fill(~seen, -torch.inf)
    p = torch.softmax(scores, -1)
    # 0 x inf and 0 x NaN at a key the query does not see must not reach it
    out = p @ vd if bool(vd.isfinite().all()) else _terms(p, vd, seen)
    some = seen.any(-1)
    out = torch.where(some[..., None], out, 0.0)
    if not return_lse:
        return out
    return out, torch.where(some, torch.logsumexp(scores, -1), -torch.inf)


def _terms(p: torch.Tensor, v: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``p @ v`` over the seen keys only, one query row at a time."""
    out = torch.empty(*p.shape[:3], v.shape[-1], dtype=p.dtype)
    for t in range(p.shape[2]):
        keys = seen[:, :, t, :, None]
        out[:, :, t] = torch.where(keys, p[:, :, t, :, None] * v, 0.0).sum(-2)
    return out


def token_mask(idx: torch.Tensor, lengths: torch.Tensor, block_size: int, sq: int, skv: int,
               q_lens=None, kv_lens=None, causal: bool = True) -> torch.Tensor:
    """[B, Hq, Sq, Skv] bool: key j lies in a block listed for query t's row
    (the first ``lengths[b, h, i]`` entries of ``idx[b, h, i]``), is valid
    (``j < kv_lens[b]``, ``t < q_lens[b]``) and, with ``causal``, visible
    right-down aligned (``j <= t + kv_len - q_len``): what block-sparse
    attention on the selection attends."""
    batch, heads, rows = lengths.shape
    kb = -(-skv // block_size)
    q_lens = [sq] * batch if q_lens is None else [int(n) for n in q_lens]
    kv_lens = [skv] * batch if kv_lens is None else [int(n) for n in kv_lens]
    listed = torch.zeros(batch, heads, rows, kb + 1, dtype=torch.bool)
    entries = torch.arange(idx.shape[-1]) < lengths.cpu()[..., None]
    listed.scatter_(-1, torch.where(entries, idx.cpu().long(), kb), True)
    listed = listed[..., :kb].repeat_interleave(block_size, 2)[:, :, :sq]
    listed = listed.repeat_interleave(block_size, 3)[..., :skv]
    t, j = torch.arange(sq)[:, None], torch.arange(skv)[None, :]
    valid = torch.stack([(j < kv) & (t < ql) & ((j <= t + kv - ql) if causal else True)
                         for ql, kv in zip(q_lens, kv_lens)])
    return listed & valid[:, None]
