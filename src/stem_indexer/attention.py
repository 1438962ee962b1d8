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
positions at or past ``q_len`` (padding), get an all-zero output.

Backends:

* ``"gather"`` (CPU, and any device): rows are grouped by list length (and
  by how many of their blocks need the token mask); each chunk of rows
  gathers its listed K/V blocks and runs two batched matrix products in
  float32 (``bmm`` for the scores, then for the values), with the token mask
  applied only to the partially visible blocks (the diagonal, a key tail) and
  the softmax done in place on the scores. Half-precision inputs are computed
  in float32 (converted once per (batch, KV head)) and returned in their
  dtype. Memory is bounded by ``_SCORE_BYTES`` of scores per step (a list too
  long for it is split by keys and merged exactly by running max and sum).
* ``"flex"`` (CUDA): FlexAttention with a ``BlockMask`` built from the lists
  (``kv_num_blocks = sparse_seq_len``, ``kv_indices = sparse_indices``) and the
  token mask as ``mask_mod``; compiled on CUDA, eager elsewhere (eager flex is
  dense math: use it for checks, not speed).
* ``"auto"``: ``"flex"`` on CUDA when FlexAttention is available and the block
  size suits it (a multiple of 128), else ``"gather"`` (the CPU path).

``stem_attention`` runs the whole Stem pipeline: ``prepare.stem_inputs`` ->
indexer metadata -> indexer -> ``block_sparse_attention``, and falls back to
dense attention where sparsity cannot help (see its docstring).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
import torch.nn.functional as F

from . import contract
from .api import stem_indexer, stem_indexer_metadata
from .contract import IndexerParams, StemIndexerInputError, ceil_div
from .prepare import DEFAULT_OAM_LAMBDA, check_qkv, seq_lens_tensor, stem_inputs

__all__ = ["block_sparse_attention", "dense_attention", "stem_attention"]

# Float32 scores computed at once (rows x listed keys of a chunk); the gathered
# K and V of a chunk take as much again each when head dim == block size.
_SCORE_BYTES = 64 << 20
# A chunk pads its rows' lists to its longest one while at most this fraction
# of its blocks is padding.
_PAD_WASTE = 0.125
_BACKENDS = ("auto", "gather", "flex")


def _fail(arg: str, rule: str, got: object) -> None:
    raise StemIndexerInputError(f"stem_attention: {arg} {rule}; got {got}")


# --------------------------------------------------------------------------- #
# Checks
# --------------------------------------------------------------------------- #


def _check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
    """Shapes of q [B,Hq,Sq,D], k/v [B,Hkv,Skv,D]; returns (B, Hq, Hkv, Sq, Skv, D)."""
    return check_qkv(q, k, v, "stem_attention", same_dtype=True)


def _check_scale(scale, dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        _fail("scale", "must be a finite number or None", scale)
    return float(scale)


def _check_block_size(block_size) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        _fail("block_size", "must be an int", type(block_size).__name__)
    if block_size < 1:
        _fail("block_size", "must be >= 1", block_size)


def _check_selection(sparse_indices, sparse_seq_len, batch, hq, qmax, kmax, device):
    """Host copies of the selection, checked; lists sorted ascending.

    Returns (indices int64 [B,Hq,Qmax,W], lengths int64 [B,Hq,Qmax]) on CPU,
    with entries past each row's length set to -1.
    """
    for name, t, nd in (("sparse_indices", sparse_indices, 4),
                        ("sparse_seq_len", sparse_seq_len, 3)):
        if not isinstance(t, torch.Tensor):
            _fail(name, "must be a torch.Tensor", type(t).__name__)
        if t.dim() != nd:
            _fail(name, f"must be {nd}-D", f"shape {tuple(t.shape)}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            _fail(name, "must have an integer dtype", t.dtype)
        if t.device != device:
            _fail(name, f"must be on q's device ({device})", t.device)
    if tuple(sparse_indices.shape[:3]) != (batch, hq, qmax):
        _fail("sparse_indices", f"must have shape (B, Hq, ceil(Sq/block_size), W) with "
              f"(B, Hq, ceil(Sq/block_size)) = {(batch, hq, qmax)}", tuple(sparse_indices.shape))
    if tuple(sparse_seq_len.shape) != (batch, hq, qmax):
        _fail("sparse_seq_len", f"must have shape {(batch, hq, qmax)}",
              tuple(sparse_seq_len.shape))
    width = sparse_indices.shape[3]
    lengths = sparse_seq_len.detach().to("cpu", torch.int64)
    bad = ((lengths < 0) | (lengths > width)).nonzero()
    if bad.numel():
        b, h, i = bad[0].tolist()
        _fail(f"sparse_seq_len[{b}, {h}, {i}]", f"must be in [0, {width}] (sparse_indices' "
              "last dim)", int(lengths[b, h, i]))
    width = int(lengths.max()) if lengths.numel() else 0
    idx = sparse_indices[..., :width].detach().to("cpu", torch.int64)
    listed = torch.arange(width) < lengths[..., None]
    bad = (listed & ((idx < 0) | (idx >= kmax))).nonzero()
    if bad.numel():
        b, h, i, s = bad[0].tolist()
        _fail(f"sparse_indices[{b}, {h}, {i}, {s}]", f"must be a key block in [0, {kmax})",
              int(idx[b, h, i, s]))
    idx = torch.where(listed, idx, kmax).sort(dim=-1).values
    dup = listed[..., 1:] & (idx[..., 1:] == idx[..., :-1])
    bad = dup.nonzero()
    if bad.numel():
        b, h, i, s = bad[0].tolist()
        _fail(f"sparse_indices[{b}, {h}, {i}]", "must not list a key block twice",
              int(idx[b, h, i, s]))
    return torch.where(listed, idx, -1), lengths


# --------------------------------------------------------------------------- #
# Dense attention (fallback, prefix, and the meaning of "exact")
# --------------------------------------------------------------------------- #


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
    mask = j <= t + off
    out = _sdpa(q, k, v, attn_mask=mask, scale=scale)
    if off < 0:  # the first -off queries see no key
        out[:, :, : min(-off, ql)] = 0
    return out


def dense_attention(q, k, v, *, causal: bool = True, scale: float | None = None,
                    q_lens=None, kv_lens=None) -> torch.Tensor:
    """Dense softmax attention with the same masks and conventions as
    ``block_sparse_attention`` (right-down causal, valid tokens ``[0, len)``,
    zeros for queries with no visible key and for padded query positions).

    q [B,Hq,Sq,D], k/v [B,Hkv,Skv,D] -> [B,Hq,Sq,D] in q's dtype.
    """
    batch, hq, hkv, sq, skv, dim = _check_qkv(q, k, v)
    scale = _check_scale(scale, dim)
    if q_lens is None and kv_lens is None:
        return _dense_one(q, k, v, causal, scale).to(q.dtype)
    ql = seq_lens_tensor(q_lens, batch, sq, "q_lens", torch.device("cpu")).tolist()
    kl = seq_lens_tensor(kv_lens, batch, skv, "kv_lens", torch.device("cpu")).tolist()
    out = torch.zeros_like(q)
    for b in range(batch):
        if ql[b] == 0 or kl[b] == 0:
            continue
        out[b:b + 1, :, :ql[b]] = _dense_one(q[b:b + 1, :, :ql[b]], k[b:b + 1, :, :kl[b]],
                                             v[b:b + 1, :, :kl[b]], causal, scale)
    return out


# --------------------------------------------------------------------------- #
# Gathered-blocks backend
# --------------------------------------------------------------------------- #


def _softmax_(s: torch.Tensor) -> None:
    """Softmax over the last dim, in place (a row with no finite score gives NaN)."""
    try:
        torch.ops.aten._softmax.out(s, -1, False, out=s)
    except RuntimeError:  # an out= that may not alias its input: unfused passes
        s.sub_(s.amax(dim=-1, keepdim=True)).exp_()
        s.div_(s.sum(dim=-1, keepdim=True))


def _plan_chunks(rows, slice_of, n_tail, n_list, cap):
    """Chunks of rows sharing a slice and a tail count, rows ascending in list
    length; a chunk's lists are padded to its longest one while that wastes at
    most ``_PAD_WASTE`` of its blocks, and it holds at most ``cap`` blocks of
    rows x width (a longer single row is split by keys later).

    Returns a list of (start, stop, width) ranges into ``rows``.
    """
    chunks = []
    start, total, width = 0, 0, 0
    prev = None
    for pos, (s_id, t, n) in enumerate(zip(slice_of.tolist(), n_tail.tolist(),
                                           n_list.tolist())):
        c = pos - start
        if (prev == (s_id, t) and (c + 1) * n <= cap
                and (c + 1) * n - (total + n) <= _PAD_WASTE * (c + 1) * n):
            total += n
            width = n
            continue
        if pos:
            chunks.append((start, pos, width))
        start, total, width, prev = pos, n, n, (s_id, t)
    if len(rows):
        chunks.append((start, len(rows), width))
    return chunks


def _complete_prefix(idx, lengths, qlen, kvlen, bs, causal):
    """Per batch, the number of leading query blocks whose lists (in every head)
    hold exactly the key blocks their valid query tokens can see."""
    batch, _, qmax, _ = idx.shape
    i = torch.arange(qmax)
    last_q = torch.minimum((i[None] + 1) * bs, qlen[:, None]) - 1  # (B, Qmax)
    if causal:
        reach = torch.minimum(kvlen[:, None], last_q + (kvlen - qlen)[:, None] + 1).clamp(min=0)
    else:
        reach = kvlen[:, None].expand(batch, qmax)
    needed = ceil_div(reach, bs)[:, None, :]  # (B, 1, Qmax)
    last = idx.amax(dim=-1) if idx.shape[-1] else torch.full(lengths.shape, -1)
    complete = (lengths == needed) & ((needed == 0) | (last == needed - 1))
    complete = complete.all(dim=1) & (i[None] < ceil_div(qlen, bs)[:, None])
    return (~complete).int().cumsum(dim=1).eq(0).sum(dim=1)  # leading run length


def _tail_mask(blocks, t_n, i, bi, qlen_off, kvlen, bs, causal):
    """Visibility [c or 1, Bs, T*Bs] of the chunk's tail blocks (the first
    ``t_n`` gathered), one shared row when every row's tail sits at the same
    place relative to its queries and to its key length."""
    tail = blocks[:, :t_n] * bs  # (c, T) first key of each tail block
    room = (kvlen[bi][:, None] - tail).clamp(0, bs)
    rel = tail - (i * bs + qlen_off[bi])[:, None]
    if bool((room == room[:1]).all()) and (not causal or bool((rel == rel[:1]).all())):
        tail, i, bi = tail[:1], i[:1], bi[:1]
    ar = torch.arange(bs)
    keypos = (tail[:, :, None] + ar).flatten(1)  # (c', T*Bs)
    vis = (keypos < kvlen[bi][:, None])[:, None, :]
    if causal:
        qpos = i[:, None] * bs + ar + qlen_off[bi][:, None]  # (c', Bs)
        vis = vis & (keypos[:, None, :] <= qpos[:, :, None])
    return vis.expand(tail.shape[0], bs, t_n * bs)


def _gather_attention(q, k, v, idx, lengths, qlen, kvlen, bs, causal, scale):
    """Block-sparse attention with batched matrix products over gathered key blocks.

    Rows (b, h, i) are grouped by (KV slice, number of partially visible
    blocks) and sorted by list length; each chunk of rows gathers its listed
    K/V blocks (partially visible ones first, then fully visible ones, then
    masked padding up to the chunk's longest list), computes the scaled
    scores with one ``bmm`` in float32 (float64 for float64 inputs), masks
    the partial blocks token by token, applies softmax in place and
    multiplies by the gathered values with a second ``bmm``. Consecutive rows
    are read from Q and written to the output in place. Half-precision
    inputs are converted once per (batch, KV head) into reused buffers;
    scratch is allocated once per call.
    """
    batch, hq, sq, dim = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    group = hq // hkv
    qmax, kmax = ceil_div(sq, bs), ceil_div(skv, bs)
    device = q.device
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    width = idx.shape[-1]
    off = kvlen - qlen
    rows_per_f = group * qmax  # rows of one (batch, KV head): contiguous in (b, h, i) order
    out = torch.empty(batch, hq, qmax * bs, dim, dtype=q.dtype, device=device)
    out_blocks = out.view(-1, bs, dim)

    # Per row: listed blocks, how many of them every query token fully sees
    # (a prefix of the ascending list), whether the row is computed at all.
    i_of_row = torch.arange(qmax).expand(batch, hq, qmax)
    j = idx.clamp(min=0)
    full = (j + 1) * bs <= kvlen[:, None, None, None]
    if causal:
        full &= (j + 1) * bs - 1 <= (i_of_row * bs + off[:, None, None])[..., None]
    full &= torch.arange(width) < lengths[..., None]
    n_list = lengths.flatten()
    n_tail = n_list - full.sum(dim=-1).flatten()
    live = (lengths > 0) & (i_of_row < ceil_div(qlen, bs)[:, None, None])
    # Leading query blocks that list everything they see (the budget keeps
    # early blocks dense): one dense causal attention call per batch, after
    # the rest (the fused kernel is efficient on a long causal prefix).
    prefix = []
    if causal:
        n_pre = _complete_prefix(idx, lengths, qlen, kvlen, bs, causal)
        for b in range(batch):
            p = int(n_pre[b])
            if p >= 2 and int(off[b]) == 0:
                prefix.append((b, min(p * bs, int(qlen[b]))))
                live[b, :, :p] = False
    pre_rows = torch.zeros_like(live)
    for b, nq in prefix:
        pre_rows[b, :, :ceil_div(nq, bs)] = True
    live, pre_rows = live.flatten(), pre_rows.flatten()
    rows = live.nonzero().flatten()

    # Slices: all (batch, KV head) at once when Q/K/V are read in place, else
    # one (batch, KV head) at a time through padded / converted copies.
    q_inplace = sq % bs == 0 and q.dtype == cdt and q.is_contiguous()
    kv_inplace = (skv % bs == 0 and k.dtype == cdt and k.is_contiguous()
                  and v.is_contiguous())
    o_inplace = q.dtype == cdt
    per_f = not (q_inplace and kv_inplace)
    dead = (~live & ~pre_rows).nonzero().flatten()
    if dead.numel() and (o_inplace or not per_f):
        out_blocks.index_fill_(0, dead.to(device), 0)

    def dense_prefix():
        for b, nq in prefix:
            out[b:b + 1, :, :nq] = _sdpa(q[b:b + 1, :, :nq], k[b:b + 1, :, :nq],
                                         v[b:b + 1, :, :nq], is_causal=True, scale=scale)
        return out[:, :, :sq]

    if rows.numel() == 0:
        if not o_inplace and per_f:
            out.zero_()
        return dense_prefix()

    slice_of = rows // rows_per_f if per_f else torch.zeros_like(rows)
    w1 = width + 1
    key = (slice_of * w1 + n_tail[rows]) * w1 + n_list[rows]
    order = key.argsort(stable=True)  # row order kept within a key
    rows, slice_of = rows[order], slice_of[order]
    r_tail, r_len = n_tail[rows], n_list[rows]
    cap = max(1, _SCORE_BYTES // (bs * bs * torch.finfo(cdt).bits // 8))
    chunks = _plan_chunks(rows, slice_of, r_tail, r_len, cap)

    # Scratch, once per call.
    max_c = max(b - a for a, b, _ in chunks)
    max_blocks = max((b - a) * min(w, max(1, cap // (b - a))) for a, b, w in chunks)
    s_buf = torch.empty(max_blocks * bs * bs, dtype=cdt, device=device)
    k_buf = torch.empty(max_blocks * bs * dim, dtype=cdt, device=device)
    v_buf = torch.empty_like(k_buf)
    q_buf = torch.empty(max_c, bs, dim, dtype=cdt, device=device)
    o_buf = torch.empty_like(q_buf)
    q_src = q.view(-1, bs, dim) if q_inplace else None
    k_src = k.view(-1, bs, dim) if kv_inplace else None
    v_src = v.view(-1, bs, dim) if kv_inplace else None
    dst = out_blocks if o_inplace else None
    if not q_inplace:
        q_slice = torch.empty(rows_per_f * bs, dim, dtype=cdt, device=device)
    if not kv_inplace:
        k_slice = torch.empty(kmax * bs, dim, dtype=cdt, device=device)
        v_slice = torch.empty_like(k_slice)
    if not o_inplace:
        dst = torch.empty(rows_per_f, bs, dim, dtype=cdt, device=device)
    q_row0 = kv_blk0 = o_row0 = 0

    def flush(s_id):  # converted output of one (batch, KV head)
        out_blocks[s_id * rows_per_f:(s_id + 1) * rows_per_f].copy_(dst)

    idx_rows = idx.view(-1, width)
    cur_slice = None
    for a, b_, n_pad in chunks:
        r = rows[a:b_]
        c = r.numel()
        s_id = int(slice_of[a])
        if per_f and s_id != cur_slice:  # load one (batch, KV head)
            if cur_slice is not None and not o_inplace:
                flush(cur_slice)
            cur_slice = s_id
            bb, kvh = divmod(s_id, hkv)
            if not q_inplace:
                qv = q_slice.view(group, qmax * bs, dim)
                qv[:, :sq].copy_(q[bb, kvh * group:(kvh + 1) * group])
                qv[:, sq:].zero_()
                q_src, q_row0 = q_slice.view(-1, bs, dim), s_id * rows_per_f
            if not kv_inplace:
                for src, buf in ((k, k_slice), (v, v_slice)):
                    buf[:skv].copy_(src[bb, kvh])
                    buf[skv:].zero_()
                k_src, v_src = k_slice.view(-1, bs, dim), v_slice.view(-1, bs, dim)
                kv_blk0 = s_id * kmax
            if not o_inplace:
                dst.zero_()
                o_row0 = s_id * rows_per_f
        t_n = int(r_tail[a])
        lens = r_len[a:b_]
        # Gather order: the tail (partially visible) blocks, the fully visible
        # ones, then padding (the row's first block, masked).
        p = torch.arange(n_pad)
        src = torch.where(p < t_n, lens[:, None] - t_n + p, p - t_n)
        src = torch.where(p < lens[:, None], src, 0)
        blocks = idx_rows[r].gather(1, src)  # (c, n_pad)
        kv_ids = ((r // rows_per_f) * kmax - kv_blk0)[:, None] + blocks
        bi = r // (hq * qmax)
        i = r % qmax

        vis = empty = None
        if t_n:
            vis = _tail_mask(blocks, t_n, i, bi, off, kvlen, bs, causal)
            no_full = lens == t_n
            if bool(no_full.any()):
                empty = ~vis.any(dim=-1) & no_full[:, None]  # tokens seeing no key
                empty = empty.to(device) if bool(empty.any()) else None
            vis = vis.to(device)
        min_len = int(lens.min())
        pad_cols = None
        if min_len < n_pad:  # (c, 1, columns past the shortest list) padding
            col = torch.arange(min_len * bs, n_pad * bs) // bs
            pad_cols = (col >= lens[:, None])[:, None, :].to(device)

        # Queries in place when consecutive, else gathered.
        consecutive = c == 1 or bool((r[1:] - r[:-1] == 1).all())
        rq = r - q_row0
        if consecutive:
            qb = q_src[int(rq[0]):int(rq[0]) + c]
        else:
            qb = torch.index_select(q_src, 0, rq.to(device), out=q_buf[:c])
        ro = r - o_row0
        o_direct = consecutive
        ob = dst[int(ro[0]):int(ro[0]) + c] if o_direct else o_buf[:c]

        seg = max(1, min(n_pad, cap // c))
        m_run = l_run = None
        for s0 in range(0, n_pad, seg):
            s1 = min(n_pad, s0 + seg)
            nb = s1 - s0
            ids = kv_ids[:, s0:s1].flatten().to(device)
            kg = torch.index_select(k_src, 0, ids, out=k_buf[:c * nb * bs * dim]
                                    .view(c * nb, bs, dim)).view(c, nb * bs, dim)
            vg = torch.index_select(v_src, 0, ids, out=v_buf[:c * nb * bs * dim]
                                    .view(c * nb, bs, dim)).view(c, nb * bs, dim)
            s = s_buf[:c * bs * nb * bs].view(c, bs, nb * bs)
            s.baddbmm_(qb, kg.transpose(1, 2), beta=0.0, alpha=scale)
            if s0 < t_n:  # token mask on the partially visible blocks
                t1 = min(t_n, s1)
                s[:, :, :(t1 - s0) * bs].masked_fill_(~vis[:, :, s0 * bs:t1 * bs], -math.inf)
            if pad_cols is not None and s1 > min_len:
                p0 = max(s0, min_len)
                s[:, :, (p0 - s0) * bs:].masked_fill_(
                    pad_cols[:, :, (p0 - min_len) * bs:(s1 - min_len) * bs], -math.inf)
            if seg >= n_pad:  # the whole lists at once
                _softmax_(s)
                torch.bmm(s, vg, out=ob)
                break
            # Keys split in segments: running max and sum, exact rescaling.
            m = s.amax(dim=-1, keepdim=True)
            if m_run is not None:
                m = torch.maximum(m_run, m)
            m_safe = torch.where(torch.isinf(m), 0.0, m)  # rows with nothing visible yet
            s.sub_(m_safe).exp_()
            part = s.sum(dim=-1, keepdim=True)
            if m_run is None:
                torch.bmm(s, vg, out=ob)
                l_run = part
            else:
                alpha = torch.exp(m_run - m_safe)
                ob.mul_(alpha).baddbmm_(s, vg)
                l_run.mul_(alpha).add_(part)
            m_run = m
        else:
            ob.div_(torch.where(l_run > 0, l_run, 1.0))
        if empty is not None:
            ob.masked_fill_(empty[..., None], 0)
        if not o_direct:
            dst.index_copy_(0, ro.to(device), ob)
    if not o_inplace:
        flush(cur_slice)
        # (batch, KV head) slices without any computed row stay zero.
        done = torch.zeros(batch * hkv, dtype=torch.bool)
        done[slice_of.unique()] = True
        for s_id in (~done).nonzero().flatten().tolist():
            out_blocks[s_id * rows_per_f:(s_id + 1) * rows_per_f].zero_()
    return dense_prefix()

# --------------------------------------------------------------------------- #
# FlexAttention backend
# --------------------------------------------------------------------------- #

_compiled_flex = None


def _flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _flex_attention(q, k, v, idx_dev, len_dev, qlen, kvlen, bs, causal, scale):
    global _compiled_flex
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    batch, hq, sq, dim = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    qmax, kmax = ceil_div(sq, bs), ceil_div(skv, bs)
    device = q.device
    qp = F.pad(q, (0, 0, 0, qmax * bs - sq))
    kp = F.pad(k, (0, 0, 0, kmax * bs - skv))
    vp = F.pad(v, (0, 0, 0, kmax * bs - skv))
    width = idx_dev.shape[-1]
    kv_indices = torch.zeros(batch, hq, qmax, kmax, dtype=torch.int32, device=device)
    kv_indices[..., :min(width, kmax)] = idx_dev[..., :kmax].clamp(min=0).to(torch.int32)
    kv_num = len_dev.to(torch.int32)
    kv_len_d = kvlen.to(device)
    off_d = (kvlen - qlen).to(device)
    # Block membership for the mask_mod: the BlockMask's lists only let the
    # compiled kernel skip blocks; eager flex evaluates mask_mod alone.
    listed = torch.arange(width, device=device) < len_dev[..., None]
    member = torch.zeros(batch, hq, qmax, kmax + 1, dtype=torch.bool, device=device)
    member.scatter_(-1, torch.where(listed, idx_dev, kmax).long(), True)
    member = member[..., :kmax].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        visible = member[b, h, q_idx // bs, kv_idx // bs] & (kv_idx < kv_len_d[b])
        if causal:
            visible = visible & (kv_idx <= q_idx + off_d[b])
        return visible

    block_mask = BlockMask.from_kv_blocks(kv_num, kv_indices, BLOCK_SIZE=bs, mask_mod=mask_mod,
                                          seq_lengths=(qmax * bs, kmax * bs))
    fn = flex_attention
    if device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    out = fn(qp, kp, vp, block_mask=block_mask, scale=scale, enable_gqa=hq != hkv)
    return out[:, :, :sq]


# --------------------------------------------------------------------------- #
# Public entry points
# --------------------------------------------------------------------------- #


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    sparse_indices: torch.Tensor, sparse_seq_len: torch.Tensor, *,
    block_size: int, causal: bool = True, scale: float | None = None,
    q_lens=None, kv_lens=None, backend: str = "auto",
) -> torch.Tensor:
    """Softmax attention restricted to the listed key blocks of each query block.

    Args:
        q: [B, Hq, Sq, D]; k, v: [B, Hkv, Skv, D] (query head h uses KV head
            h // (Hq/Hkv)), one floating dtype and device.
        sparse_indices: [B, Hq, ceil(Sq/block_size), W] integer: the key blocks
            of each row (in [0, ceil(Skv/block_size)), any order, no
            duplicates); entries past the row's length are ignored (the
            indexer writes -1).
        sparse_seq_len: [B, Hq, ceil(Sq/block_size)] integer: listed blocks per row.
        block_size: tokens per block (the indexer's ``stem_block_size``).
        causal: token-level causal mask, right-down aligned: query t sees key
            j iff ``j <= t + kv_len - q_len``.
        scale: softmax scale, default ``1/sqrt(D)``.
        q_lens, kv_lens: valid tokens per batch (positions ``[0, len)``).
        backend: ``"auto"``, ``"gather"`` or ``"flex"`` (see the module doc).

    Returns:
        [B, Hq, Sq, D] in q's dtype. Query tokens with no visible key among
        their listed blocks, and padded query positions, are zero.

    The selection is checked on the host (this synchronises on CUDA).
    """
    batch, hq, hkv, sq, skv, dim = _check_qkv(q, k, v)
    _check_block_size(block_size)
    scale = _check_scale(scale, dim)
    if backend not in _BACKENDS:
        _fail("backend", f"must be one of {_BACKENDS}", backend)
    qmax, kmax = ceil_div(sq, block_size), ceil_div(skv, block_size)
    idx, lengths = _check_selection(sparse_indices, sparse_seq_len, batch, hq, qmax, kmax,
                                    q.device)
    cpu = torch.device("cpu")
    qlen = seq_lens_tensor(q_lens, batch, sq, "q_lens", cpu)
    kvlen = seq_lens_tensor(kv_lens, batch, skv, "kv_lens", cpu)

    use_flex = backend == "flex" or (
        backend == "auto" and q.device.type == "cuda" and block_size % 128 == 0
        and _flex_available())
    out = None
    if use_flex:
        try:
            out = _flex_attention(q, k, v, idx.to(q.device), lengths.to(q.device), qlen, kvlen,
                                  block_size, causal, scale)
        except Exception as exc:  # noqa: BLE001 - auto falls back, an explicit request raises
            if backend == "flex":
                raise
            warnings.warn(f"stem_attention: FlexAttention failed ({exc!r}); "
                          "using the gathered-blocks backend", RuntimeWarning, stacklevel=2)
    if out is None:
        out = _gather_attention(q, k, v, idx, lengths, qlen, kvlen, block_size, causal, scale)
    pad_q = torch.arange(sq)[None, :] >= qlen[:, None]
    if bool(pad_q.any()):
        out = out.masked_fill(pad_q.to(q.device)[:, None, :, None], 0)
    return out.to(q.dtype)


def _dense_is_exact(qlen, kvlen, prompt, params: IndexerParams) -> bool:
    """True when the indexer would keep, in every row, every key block that
    holds a key visible to the row's tokens: block-sparse == dense then."""
    bs = params.stem_block_size
    qb, kb = ceil_div(qlen, bs), ceil_div(kvlen, bs)
    p = ceil_div(prompt, bs)
    ks = contract.prompt_budget(p, params)
    for b in range(qlen.shape[0]):
        n = int(qb[b])
        if n == 0 or int(kb[b]) == 0:
            continue
        i = torch.arange(n)
        s2 = contract.visible_blocks(i, n, int(kb[b]), params.causal)
        sink_end, cand_end = contract.candidate_range(s2, params.initial_blocks,
                                                      params.window_size)
        budget = contract.row_budget(i + int(kb[b]) - n, p[b], ks[b], params.alpha)
        if bool((budget < cand_end - sink_end).any()):
            return False
        last_q = torch.minimum((i + 1) * bs, qlen[b]) - 1
        reach = kvlen[b] if not params.causal else torch.minimum(
            kvlen[b], last_q + kvlen[b] - qlen[b] + 1).clamp(min=0)
        if bool((s2 * bs < reach).any()):
            return False
    return True


def stem_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    causal: bool = True, scale: float | None = None, q_lens=None, kv_lens=None,
    num_prompt_tokens=None, block_size: int = 128, stride: int = 16, alpha: float = 1.0,
    initial_blocks: int = 4, window_size: int = 4,
    k_block_num_rate_medium: float = 0.2, k_block_num_bias_medium: int = 30,
    k_block_num_rate_large: float = 0.1, k_block_num_bias_large: int = 30,
    topk_score_precision: int = 1, oam: bool = True, oam_lambda: float = DEFAULT_OAM_LAMBDA,
    indexer_scale: float | None = None, min_q_blocks: int = 2, backend: str = "auto",
) -> torch.Tensor:
    """Stem attention in one call: Q/K/V -> indexer -> block-sparse attention.

    Args:
        q: [B, Hq, Sq, D]; k, v: [B, Hkv, Skv, D]; ``Hq % Hkv == 0``.
        causal, scale, q_lens, kv_lens: as in ``block_sparse_attention``
            (scale defaults to ``1/sqrt(D)``).
        num_prompt_tokens: per-batch prompt length for the budget (>= kv_lens),
            default the KV lengths (chunked prefill passes the full prompt).
        block_size, stride, alpha, initial_blocks, window_size, the rates and
            biases, topk_score_precision: the indexer's parameters
            (``stem_block_size``, ``stem_stride``, ...), op schema defaults.
        oam, oam_lambda: the Output-Aware Metric (``False`` = no value bias).
        indexer_scale: factor folded into ``qflat``. Default ``scale / stride``:
            the indexer's score of a block pair is then the mean attention logit
            of the R*R*Ts token pairs it samples (the indexer itself divides by
            R^2 and sums the Ts groups), so the OAM bias, in log-magnitude
            units, is added to a log attention weight as the method intends.
        min_q_blocks: below this many query blocks (``ceil(max q_len / Bs)``),
            e.g. single-token decode, dense attention is used: the indexer
            reads every key to score it, so it cannot save work there.
        backend: ``block_sparse_attention``'s backend.

    Returns:
        [B, Hq, Sq, D] in q's dtype.

    Dense attention (``dense_attention``, the same masks and zero-output
    conventions) is also used when the indexer would keep, in every row, every
    key block the row can see (short sequences: budgets below 56 prompt blocks
    keep all); the result is then identical to the sparse path's.

    The indexer aligns causality on blocks (its last query block sees its
    last key block). When ``kv_len - q_len`` is not a multiple of
    ``block_size``, a query block's last tokens may be allowed, token-wise, a
    few keys of the block after its last visible one; that block is never
    listed, so those keys are not attended (the sparse path is then not the
    dense result even when every listed row is complete).
    """
    batch, hq, hkv, sq, skv, dim = _check_qkv(q, k, v)
    scale = _check_scale(scale, dim)
    params = IndexerParams(
        causal=causal, stem_block_size=block_size, stem_stride=stride, alpha=alpha,
        initial_blocks=initial_blocks, window_size=window_size,
        k_block_num_rate_medium=k_block_num_rate_medium,
        k_block_num_bias_medium=k_block_num_bias_medium,
        k_block_num_rate_large=k_block_num_rate_large,
        k_block_num_bias_large=k_block_num_bias_large,
        topk_score_precision=topk_score_precision)
    params.check()
    if isinstance(min_q_blocks, bool) or not isinstance(min_q_blocks, int):
        _fail("min_q_blocks", "must be an int", type(min_q_blocks).__name__)
    if indexer_scale is not None:
        indexer_scale = _check_scale(indexer_scale, dim)  # finite number
    cpu = torch.device("cpu")
    qlen = seq_lens_tensor(q_lens, batch, sq, "q_lens", cpu)
    kvlen = seq_lens_tensor(kv_lens, batch, skv, "kv_lens", cpu)
    if num_prompt_tokens is None:
        prompt = kvlen
    else:
        prompt = seq_lens_tensor(num_prompt_tokens, batch, 2**31 - 1, "num_prompt_tokens", cpu)
        bad = (prompt < kvlen).nonzero()
        if bad.numel():
            b = int(bad[0, 0])
            _fail(f"num_prompt_tokens[{b}]", f"must be >= kv_lens[{b}] ({int(kvlen[b])})",
                  int(prompt[b]))

    q_blocks = int(ceil_div(qlen, block_size).max())
    if q_blocks < min_q_blocks or _dense_is_exact(qlen, kvlen, prompt, params):
        return dense_attention(q, k, v, causal=causal, scale=scale, q_lens=qlen, kv_lens=kvlen)

    if indexer_scale is None:
        indexer_scale = scale / stride
    inputs = stem_inputs(q, k, v, block_size=block_size, stride=stride, q_lens=qlen.to(q.device),
                         kv_lens=kvlen.to(q.device), scale=indexer_scale, oam=oam,
                         oam_lambda=oam_lambda)
    prompt_dev = prompt.to(device=q.device, dtype=torch.int32)
    metadata = stem_indexer_metadata(
        inputs.q_seq_lens, inputs.kv_seq_lens, hq, hkv, causal=causal,
        stem_block_size=block_size, dim_qkflat=inputs.qflat.shape[-1], window_size=window_size)
    sparse_indices, sparse_seq_len = stem_indexer(
        inputs.qflat, inputs.kflat, inputs.vbias, inputs.q_seq_lens, inputs.kv_seq_lens,
        num_prompt_tokens=prompt_dev, metadata=metadata, **dataclasses.asdict(params))
    return block_sparse_attention(q, k, v, sparse_indices, sparse_seq_len,
                                  block_size=block_size, causal=causal, scale=scale,
                                  q_lens=qlen, kv_lens=kvlen, backend=backend)
