"""Triton kernels of the CUDA path: block scores, then per-row exact selection.

Two kernels, launched one after the other on the same stream (``launch.py``
prepares their inputs and explains the design as a whole):

``score_kernel``
    A persistent GEMM. Its work items are (plan tile, KV head, key chunk,
    row block): ``BLOCK_M`` rows of the tile's (query block, query head)
    pairs -- the ``G`` query heads of one KV head share every K tile --
    against ``BLOCK_N`` key blocks, bf16 operands, float32 accumulation. Each
    score ``acc * scale + vbias`` becomes a 32-bit ranking key (see
    ``_rank_key``) and is stored, for the candidate columns of rows that must
    rank, **into the row's own slot of ``sparse_indices``** (same shape as a
    score matrix, int32). Scores therefore need no memory of their own.

``select_kernel``
    One program per ``ROWS`` consecutive query blocks of one (batch, query
    head). For each row that must rank, it finds the K-th largest key by
    bisection over the key's value range (counting keys >= a threshold; it
    stops as soon as a threshold leaves exactly K keys above it), resolves
    ties at the threshold to the lower block index with a prefix count, and
    scatters the picks to ascending positions with a prefix count. Then it
    writes the forced blocks and the -1 padding around them and the row's
    length. Every output element is written exactly once, by its own row's
    program, after the row's keys have been read.

Both kernels only use pointer arithmetic, ``tl.dot``, reductions and scans,
so they run unchanged under the Triton CPU interpreter. Loops whose bounds
are tensors are ``while`` loops: the interpreter of Triton 3.6 cannot take a
tensor as a ``range`` bound with NumPy 2; ``DF`` is a compile-time constant
so that the GEMM's reduction loop stays a pipelined ``range`` loop. ``UPCAST`` converts
the bf16 operands to float32 before ``tl.dot``; the launcher sets it only under
the interpreter, whose bf16 ``tl.dot`` is not exact (products of bf16 values
are exact in float32 either way, so the scores are the same).
"""

from __future__ import annotations

import triton
import triton.language as tl


# Reductions and scans through ``tl.reduce``/``tl.associative_scan`` with
# Triton's own combine functions, not ``tl.sum``/``tl.max``/``tl.cumsum``:
# those are ``@jit`` library functions whose interpreted or compiled form is
# fixed when ``triton`` is first imported, while these kernels are loaded in
# both forms in one process. The interpreter recognises these combine
# functions and runs them as NumPy reductions.
@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _cumsum(x, axis: tl.constexpr):
    return tl.associative_scan(x, axis, tl.standard._sum_combine)


@triton.jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _min(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@triton.jit
def _rank_key(s, SHIFT: tl.constexpr):
    """Ranking key of float32 scores: a signed int32 whose order is the contract's.

    ``SHIFT == 16`` (topk_score_precision=2) first rounds each score to
    bfloat16, to nearest even, and keeps the 16 significant bits. -0.0 ranks
    as +0.0 and NaN as -inf, exactly as ``contract.rank_keys``.
    """
    bits = s.to(tl.int32, bitcast=True)
    if SHIFT == 16:
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    bits = tl.where((bits & 0x7FFFFFFF) == 0, 0, bits)  # -0.0 -> +0.0
    bits = tl.where(s != s, -8388608, bits)  # NaN -> -inf (0xFF800000)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as signed int order
    return ordered >> SHIFT


@triton.jit
def score_kernel(
    q_ptr, k_ptr, vb_ptr, out_ptr,
    plan_ptr, item_end_ptr, tile_lo_ptr, tile_mblocks_ptr, tile_nchunks_ptr, rows_ptr,
    scale, B, NQ, NK, G, QMAX, KMAX, CAP, NPROG,
    DF: tl.constexpr, LOG_CAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SHIFT: tl.constexpr, UPCAST: tl.constexpr,
):
    """Ranking keys of every candidate pair of the plan's tiles (see module doc).

    ``plan``: (CAP, 4) int32 tiles (batch, i0, i1, kend) from the metadata.
    ``item_end``: (CAP,) int64 running total of work items per tile (tiles
    past the plan's tile count have none); ``tile_lo``/``tile_mblocks``/
    ``tile_nchunks``: (CAP,) int32 first key block, row blocks and key chunks
    of each tile. ``rows``: (B, QMAX, 4) int32 (s2, sink_end, cand_end, take)
    per query block, from ``contract``. All tensors contiguous.
    """
    pid = tl.program_id(0)
    total = tl.load(item_end_ptr + CAP - 1)
    w = pid.to(tl.int64)
    while w < total:
        # The tile holding item w: the first t with item_end[t] > w.
        lo = tl.full([], 0, tl.int64)
        hi = tl.full([], 0, tl.int64) + CAP - 1
        for _ in range(LOG_CAP):
            mid = (lo + hi) // 2
            right = tl.load(item_end_ptr + mid) <= w
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(right, hi, mid)
        t = lo
        mblocks = tl.load(tile_mblocks_ptr + t)
        nchunks = tl.load(tile_nchunks_ptr + t)
        local = w - (tl.load(item_end_ptr + t) - NK * mblocks * nchunks)
        mb = local % mblocks  # row blocks of one key chunk are neighbours: K reuse in L2
        chunk = (local // mblocks) % nchunks
        n = local // (mblocks * nchunks)

        # Clamped so that no plan, however built, leads out of bounds.
        b = tl.minimum(tl.maximum(tl.load(plan_ptr + 4 * t), 0), B - 1)
        i0 = tl.minimum(tl.maximum(tl.load(plan_ptr + 4 * t + 1), 0), QMAX)
        i1 = tl.minimum(tl.maximum(tl.load(plan_ptr + 4 * t + 2), i0), QMAX)

        # Rows r of the tile: query block i0 + r // G, query head n*G + r % G.
        r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = r < G * (i1 - i0)
        i = i0 + r // G
        h = n * G + r % G
        info = rows_ptr + (b * QMAX + i) * 4
        sink = tl.load(info + 1, mask=row_ok, other=0)
        cand = tl.load(info + 2, mask=row_ok, other=0)
        take = tl.load(info + 3, mask=row_ok, other=0)
        ranks = row_ok & (take > 0) & (take < cand - sink)

        j0 = tl.load(tile_lo_ptr + t) + chunk * BLOCK_N
        j_end = _max(tl.where(ranks, cand, 0), 0)
        j_begin = _min(tl.where(ranks, sink, KMAX), 0)
        if (j0 < j_end) & (j0 + BLOCK_N > j_begin):
            j = j0 + tl.arange(0, BLOCK_N)
            col_ok = (j >= 0) & (j < KMAX)
            q_rows = ((b * NQ + h).to(tl.int64) * QMAX + i) * DF
            k_rows = ((b * NK + n).to(tl.int64) * KMAX + j) * DF
            acc = tl.full((BLOCK_M, BLOCK_N), 0, tl.float32)
            for k0 in range(0, DF, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < DF
                a = tl.load(q_ptr + q_rows[:, None] + kk[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                kt = tl.load(k_ptr + k_rows[None, :] + kk[:, None],
                             mask=col_ok[None, :] & k_ok[:, None], other=0.0)
                if UPCAST:
                    acc = tl.dot(a.to(tl.float32), kt.to(tl.float32), acc,
                                 input_precision="ieee")
                else:
                    acc = tl.dot(a, kt, acc)
            vb = tl.load(vb_ptr + (b * NK + n).to(tl.int64) * KMAX + j, mask=col_ok, other=0.0)
            key = _rank_key(acc * scale + vb[None, :], SHIFT)
            store = (ranks[:, None] & col_ok[None, :] & (j[None, :] >= sink[:, None])
                     & (j[None, :] < cand[:, None]))
            out_rows = ((b * NQ + h).to(tl.int64) * QMAX + i) * KMAX
            tl.store(out_ptr + out_rows[:, None] + j[None, :], key, mask=store)
        w += NPROG


@triton.jit
def _count_at_least(out_ptr, row_base, sink, c, ranks, thr, n_chunks,
                    BLOCK_C: tl.constexpr, ROWS: tl.constexpr):
    """Per row: how many candidate keys (read from global memory) are >= thr."""
    cols = tl.arange(0, BLOCK_C)
    cnt = tl.full([ROWS], 0, tl.int32)
    ci = 0
    while ci < n_chunks:
        col = ci * BLOCK_C + cols
        m = ranks[:, None] & (col[None, :] < c[:, None])
        x = tl.load(out_ptr + row_base[:, None] + sink[:, None] + col[None, :], mask=m, other=0)
        cnt += _sum((m & (x >= thr[:, None])).to(tl.int32), 1)
        ci += 1
    return cnt


@triton.jit
def select_kernel(
    out_ptr, len_ptr, rows_ptr, NQ, QMAX, KMAX,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr, SHIFT: tl.constexpr,
):
    """Exact per-row selection and the full output rows (see module doc).

    Grid: (B * NQ * cdiv(QMAX, ROWS),), the row groups of one (batch, head)
    consecutive. ``out`` holds, for rows that rank, the
    keys of candidate columns [sink_end, cand_end) written by ``score_kernel``.
    Rows whose candidates are all kept (take == count) or none (take == 0)
    need no keys.
    """
    groups = (QMAX + ROWS - 1) // ROWS
    pid = tl.program_id(0)
    bh = pid // groups
    b = bh // NQ
    i = (pid % groups) * ROWS + tl.arange(0, ROWS)
    row_ok = i < QMAX
    info = rows_ptr + (b * QMAX + i) * 4
    s2 = tl.load(info, mask=row_ok, other=0)
    sink = tl.load(info + 1, mask=row_ok, other=0)
    cand = tl.load(info + 2, mask=row_ok, other=0)
    take = tl.load(info + 3, mask=row_ok, other=0)
    c = cand - sink
    length = s2 - c + take
    ranks = row_ok & (take > 0) & (take < c)
    row_base = (bh.to(tl.int64) * QMAX + i) * KMAX

    if _max(ranks.to(tl.int32), 0) > 0:
        # Bisection: count(key >= lo) >= take > count(key >= hi); stop at
        # hi == lo + 1 (lo is then the take-th largest key) or as soon as a
        # threshold leaves exactly `take` keys at or above it.
        lo = tl.where(ranks, -(1 << (31 - SHIFT)), 0).to(tl.int64)
        hi = tl.where(ranks, 1 << (31 - SHIFT), 0).to(tl.int64)
        above_hi = tl.full([ROWS], 0, tl.int32)
        exact = tl.full([ROWS], 0, tl.int1)
        done = ~ranks
        n_chunks = (_max(tl.where(ranks, c, 0), 0) + BLOCK_C - 1) // BLOCK_C
        cols = tl.arange(0, BLOCK_C)
        if n_chunks == 1:  # the whole row in registers
            m = ranks[:, None] & (cols[None, :] < c[:, None])
            x = tl.load(out_ptr + row_base[:, None] + sink[:, None] + cols[None, :],
                        mask=m, other=0)
        else:
            m = tl.full((ROWS, BLOCK_C), 0, tl.int1)
            x = tl.full((ROWS, BLOCK_C), 0, tl.int32)
        while _max((~done).to(tl.int32), 0) > 0:
            mid = (lo + hi) >> 1
            if n_chunks == 1:
                cnt = _sum((m & (x >= mid.to(tl.int32)[:, None])).to(tl.int32), 1)
            else:
                cnt = _count_at_least(out_ptr, row_base, sink, c, ranks, mid.to(tl.int32),
                                      n_chunks, BLOCK_C, ROWS)
            live = ~done
            ge = cnt >= take
            lo = tl.where(live & ge, mid, lo)
            hi = tl.where(live & ~ge, mid, hi)
            above_hi = tl.where(live & ~ge, cnt, above_hi)
            exact = exact | (live & (cnt == take))
            done = done | exact | (hi - lo <= 1)
        # Picks: key > thr, plus the first `need` keys equal to thr (lower
        # block index first).
        thr = tl.where(exact, lo - 1, lo).to(tl.int32)
        need = tl.where(exact, 0, take - above_hi)
        ties_before = tl.full([ROWS], 0, tl.int32)
        picks_before = tl.full([ROWS], 0, tl.int32)
        ci = 0
        while ci < n_chunks:
            col = ci * BLOCK_C + cols
            if n_chunks != 1:
                m = ranks[:, None] & (col[None, :] < c[:, None])
                x = tl.load(out_ptr + row_base[:, None] + sink[:, None] + col[None, :],
                            mask=m, other=0)
            tie = (m & (x == thr[:, None])).to(tl.int32)
            tie_rank = ties_before[:, None] + _cumsum(tie, 1) - tie
            pick = m & ((x > thr[:, None]) | ((tie != 0) & (tie_rank < need[:, None])))
            pick_i = pick.to(tl.int32)
            slot = sink[:, None] + picks_before[:, None] + _cumsum(pick_i, 1) - pick_i
            tl.debug_barrier()  # every key of this chunk is read before any write
            tl.store(out_ptr + row_base[:, None] + slot, sink[:, None] + col[None, :],
                     mask=pick)
            ties_before += _sum(tie, 1)
            picks_before += _sum(pick_i, 1)
            ci += 1
        tl.debug_barrier()  # the row's keys are consumed; its other slots may be written

    # Sink [0, sink), picks [sink, sink+take) (ranked rows: written above;
    # otherwise all candidates or none), window, then -1.
    p0 = 0
    while p0 < KMAX:
        p = p0 + tl.arange(0, BLOCK_W)
        pp = p[None, :]
        after = pp - sink[:, None] - take[:, None]
        value = tl.where(pp < sink[:, None], pp,
                         tl.where(pp < length[:, None], cand[:, None] + after, -1))
        in_picks = (pp >= sink[:, None]) & (after < 0)
        value = tl.where(in_picks, pp, value)
        keep = row_ok[:, None] & (pp < KMAX) & ~(in_picks & ranks[:, None])
        tl.store(out_ptr + row_base[:, None] + pp, value, mask=keep)
        p0 += BLOCK_W
    tl.store(len_ptr + bh.to(tl.int64) * QMAX + i, length, mask=row_ok)
