"""Block-sparse attention with torch operations: the device-agnostic fallback.

Runs wherever torch runs (any device, float64 too); ``attention.py`` uses it
when neither the native CPU kernel nor FlexAttention applies. One (batch,
KV head) at a time:

1. ``_blocks``: its queries, keys and values as blocks in the compute dtype
   (float32, or float64 for float64 inputs), **padding zeroed**: tokens at or
   past a sequence's length are never read again, so NaN or inf there cannot
   reach a valid output;
2. ``_chunks``: its rows (query head, query block) with a non-empty list,
   sorted by list length and cut into chunks whose score matrices fit
   ``SCORE_BYTES`` (a list too long for it alone is cut into segments);
3. ``_attend``: per chunk, gather the listed K/V blocks, scores by one
   batched matmul (soft-capped when asked), the token mask (valid keys,
   right-down causal), softmax merged exactly across segments by running
   max and sum, then the values; the log-sum-exp comes with them.

Query tokens that see no key get 0 (and a log-sum-exp of -inf).
"""

from __future__ import annotations

import math

import torch

from ..contract import ceil_div

SCORE_BYTES = 64 << 20
_CPU = torch.device("cpu")


def gather_attention(q, k, v, idx, lengths, qlen, kvlen, bs: int, causal: bool,
                     scale: float, softcap: float | None = None):
    """``(out [B, Hq, Sq, D], lse [B, Hq, Sq])``: out in the compute dtype, lse
    float32 (natural log; -inf where a query sees no key).

    ``idx`` [B, Hq, Qmax, W] and ``lengths`` [B, Hq, Qmax]: integer lists
    (valid, no duplicates, -1 past each length); ``qlen``, ``kvlen``: host
    int64 [B]. ``softcap``: scores become ``softcap * tanh(score / softcap)``
    before the softmax.
    """
    idx, lengths = idx.to(_CPU, torch.int64), lengths.to(_CPU, torch.int64)
    batch, hq, sq, dim = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    group = hq // hkv
    qmax, kmax = ceil_div(sq, bs), ceil_div(skv, bs)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(batch, hq, qmax, bs, dim, dtype=cdt, device=q.device)
    lse = torch.full((batch, hq, qmax, bs), -math.inf, dtype=torch.float32, device=q.device)
    for b in range(batch):
        for n in range(hkv):
            heads = slice(n * group, (n + 1) * group)
            rows = (lengths[b, heads] > 0).nonzero()  # (g, i)
            if rows.numel() == 0:
                continue
            qs = _blocks(q[b, heads], qmax, bs, int(qlen[b]), cdt)
            ks = _blocks(k[b, n][None], kmax, bs, int(kvlen[b]), cdt)[0]
            vs = _blocks(v[b, n][None], kmax, bs, int(kvlen[b]), cdt)[0]
            offset = int(kvlen[b]) - int(qlen[b])
            for chunk, width, seg in _chunks(rows, lengths[b, heads], bs, cdt):
                g, i = chunk.unbind(1)
                h = n * group + g
                out[b, h, i], lse[b, h, i] = _attend(
                    qs[g, i], ks, vs, idx[b, heads][g, i, :width], lengths[b, heads][g, i],
                    i, seg, bs, int(kvlen[b]), offset if causal else None, scale, softcap)
    return (out.view(batch, hq, qmax * bs, dim)[:, :, :sq],
            lse.view(batch, hq, qmax * bs)[:, :, :sq])


def _blocks(x: torch.Tensor, nblocks: int, bs: int, valid: int, cdt) -> torch.Tensor:
    """x [H, S, D] -> [H, nblocks, bs, D] in ``cdt``, positions >= ``valid`` zero."""
    heads, seq, dim = x.shape
    out = torch.zeros(heads, nblocks * bs, dim, dtype=cdt, device=x.device)
    out[:, :valid] = x[:, :valid]
    return out.view(heads, nblocks, bs, dim)


def _chunks(rows: torch.Tensor, lengths: torch.Tensor, bs: int, cdt):
    """(rows, width, segment) per chunk: rows of similar list length whose
    scores (rows x width blocks of bs x bs) fit ``SCORE_BYTES``, taken
    ``segment`` blocks at a time."""
    n = lengths[rows[:, 0], rows[:, 1]]
    order = n.argsort(stable=True)
    rows, n = rows[order], n[order].tolist()
    per_block = bs * bs * torch.finfo(cdt).bits // 8
    cap = max(1, SCORE_BYTES // per_block)  # blocks of scores at once
    a = 0
    while a < len(n):
        c = 1
        while a + c < len(n) and (c + 1) * n[a + c] <= cap:
            c += 1
        yield rows[a:a + c], n[a + c - 1], max(1, cap // c)
        a += c


def _attend(qb, ks, vs, blocks, lens, i, seg, bs, kvlen, offset, scale, softcap):
    """Attention of ``c`` query blocks ``qb`` [c, bs, D] over their listed
    key blocks ``blocks`` [c, width] (entries past ``lens`` ignored), the
    key blocks ``seg`` at a time, merged exactly; returns (out, lse)."""
    c, width = blocks.shape
    device = qb.device
    t = torch.arange(bs)
    qpos = (i[:, None] * bs + t)[:, :, None]  # [c, bs, 1]
    out = m_run = l_run = None
    for s0 in range(0, width, seg):
        blk = blocks[:, s0:s0 + seg]
        listed = torch.arange(s0, s0 + blk.shape[1]) < lens[:, None]
        blk = torch.where(listed, blk, 0)
        keypos = (blk[:, :, None] * bs + t).flatten(1)[:, None, :]  # [c, 1, n*bs]
        vis = listed.repeat_interleave(bs, 1)[:, None, :] & (keypos < kvlen)
        if offset is not None:
            vis = vis & (keypos <= qpos + offset)
        kg = ks[blk.to(device)].flatten(1, 2)  # [c, n*bs, D]
        vg = vs[blk.to(device)].flatten(1, 2)
        s = torch.bmm(qb, kg.transpose(1, 2)).mul_(scale)
        if softcap is not None:
            s = s.div_(softcap).tanh_().mul_(softcap)
        s.masked_fill_(~vis.to(device), -math.inf)
        m = s.amax(dim=-1, keepdim=True)
        if m_run is not None:
            m = torch.maximum(m, m_run)
        m_safe = torch.where(torch.isinf(m), 0.0, m)  # rows that see nothing yet
        p = s.sub_(m_safe).exp_()
        part = p.sum(dim=-1, keepdim=True)
        if out is None:
            out, l_run = torch.bmm(p, vg), part
        else:
            alpha = torch.exp(m_run - m_safe)
            out = out.mul_(alpha).baddbmm_(p, vg)
            l_run = l_run.mul_(alpha).add_(part)
        m_run = m
    lse = torch.where(l_run > 0, m_run + torch.log(l_run), -math.inf).squeeze(-1)
    return out.div_(torch.where(l_run > 0, l_run, 1.0)), lse.float()
