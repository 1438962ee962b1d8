"""Triton kernels of the CUDA path: block scores, then per-row exact selection.

Two kernels, launched one after the other on the same stream (``launch.py``
prepares their inputs and explains the design as a whole):

``score_kernel``
    A persistent GEMM. Its work items are (plan tile, KV head, key chunk,
    row block). A row block is ``BLOCK_G`` query heads of one KV head times
    ``BLOCK_I`` consecutive query blocks of the tile (row ``r`` is head
    ``r // BLOCK_I``, query block ``r % BLOCK_I``), so the query heads that
    share a KV head share every K tile. It multiplies the row block by
    ``BLOCK_N`` key blocks, bf16 operands, float32 accumulation. Each score
    ``acc * scale + vbias`` becomes a 32-bit ranking key (see ``_rank_key``)
    and is stored **into the row's own slot of ``sparse_indices``** (same
    shape as a score matrix, int32). Scores therefore need no memory of their
    own. The store covers every column of the chunk, not only the row's
    candidates: the other columns of the row are the row's own (no other item
    writes them) and ``select_kernel`` overwrites them after reading only the
    candidates. That keeps the store mask per row and per column, so the
    stores vectorise and the epilogue does not spill.

``select_kernel``
    One program per ``ROWS`` consecutive query blocks of one (batch, query
    head). For each row that must rank it finds the take-th largest key by
    radix select: one bit per pass while the row sits in registers (a compare
    and an add per key, stopping as soon as a threshold leaves exactly take
    keys), one 8-bit digit per pass for rows longer than ``BLOCK_C``, which
    are read from memory once per pass (four passes for float32 keys, two for
    bfloat16 ones), counting the digit among the keys that match the digits
    chosen so far. Ties at that key go to the lower block index (a prefix
    count), and the picks are scattered to ascending positions (a prefix
    count). Then it writes the forced blocks and the -1 padding around them
    and the row's length. Every output element is written exactly once, by
    its own row's program, after the row's keys have been read.

Operand tiles come either from TMA tensor descriptors (``TMA``: Hopper and
later) or from plain pointers with per-row offsets computed once per item;
either way the reduction loop has no masks (the launcher pads Df to a
multiple of ``BLOCK_K``; rows and key blocks past the tensors' ends are
clamped, or zero-filled by TMA, and never stored).

Everything runs unchanged under the Triton CPU interpreter. Loops whose
bounds are tensors are ``while`` loops: the interpreter of Triton 3.6 cannot
take a tensor as a ``range`` bound with NumPy 2; ``DF`` is a compile-time
constant so that the GEMM's reduction loop stays a pipelined ``range`` loop.
``UPCAST`` converts the bf16 operands to float32 before ``tl.dot``; the
launcher sets it only under the interpreter, whose bf16 ``tl.dot`` is not
exact (products of bf16 values are exact in float32 either way, so the scores
are the same).

The precision (``shift``: 0 for float32 keys, 16 for bfloat16 keys) is a
runtime argument, not a constant: both precisions share one compiled kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rank_key(s, shift):
    """Ranking keys of float32 scores: int32 whose signed order is the contract's.

    ``shift == 16`` (topk_score_precision=2) first rounds each score to
    bfloat16, to nearest even, and keeps the 16 significant bits. -0.0 ranks
    as +0.0 and NaN as -inf, exactly as ``contract.rank_keys``.
    """
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where(shift == 16, (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536, bits)
    bits = tl.where((bits & 0x7FFFFFFF) == 0, 0, bits)  # -0.0 -> +0.0
    bits = tl.where(s != s, -8388608, bits)  # NaN -> -inf (0xFF800000)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as signed int order
    return ordered >> shift


@triton.jit
def _find_tile(item_end_ptr, CAP, w):
    """The tile holding work item ``w``: the first t with item_end[t] > w."""
    lo = tl.full([], 0, tl.int64)
    hi = tl.full([], 0, tl.int64) + CAP - 1
    while lo < hi:
        mid = (lo + hi) // 2
        right = tl.load(item_end_ptr + mid) <= w
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _block_scores(q_src, k_src, b, h0, ia, n, j0, NQ, NK, QMAX, KMAX,
                  DF: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_I: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
                  UPCAST: tl.constexpr):
    """Dot products of rows (heads h0.., query blocks ia..) with key blocks j0..

    ``TMA``: ``q_src``/``k_src`` are 4-D descriptors of qflat/kflat (blocks
    past an end read as zeros). Otherwise they are the tensors' pointers and
    indices past an end are clamped (those rows and columns are never stored).
    """
    BLOCK_M: tl.constexpr = BLOCK_G * BLOCK_I
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if not TMA:
        r = tl.arange(0, BLOCK_M)
        h = tl.minimum(h0 + r // BLOCK_I, NQ - 1)
        i = tl.minimum(ia + r % BLOCK_I, QMAX - 1)
        q_rows = q_src + ((b.to(tl.int64) * NQ + h) * QMAX + i) * DF
        j = tl.minimum(j0 + tl.arange(0, BLOCK_N), KMAX - 1)
        k_rows = k_src + ((b.to(tl.int64) * NK + n) * KMAX + j) * DF
        kk = tl.arange(0, BLOCK_K)
    for k0 in range(0, DF, BLOCK_K):
        if TMA:
            a = q_src.load([b, h0, ia, k0]).reshape(BLOCK_M, BLOCK_K)
            kt = k_src.load([b, n, j0, k0]).reshape(BLOCK_N, BLOCK_K)
        else:
            a = tl.load(q_rows[:, None] + (k0 + kk)[None, :])
            kt = tl.load(k_rows[:, None] + (k0 + kk)[None, :])
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), kt.to(tl.float32).T, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, kt.T, acc)
    return acc


@triton.jit
def score_kernel(
    q_src, k_src, vb_ptr, out_ptr,
    plan_ptr, item_end_ptr, tile_lo_ptr, tile_mblocks_ptr, tile_nchunks_ptr, rows_ptr,
    scale, shift, B, NQ, NK, G, QMAX, KMAX, CAP, NPROG,
    DF: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    """Ranking keys of every candidate pair of the plan's tiles (see module doc).

    ``plan``: (CAP, 4) int32 tiles (batch, i0, i1, kend) from the metadata.
    ``item_end``: (CAP,) int64 running total of work items per tile (tiles
    past the plan's tile count have none); ``tile_lo``/``tile_mblocks``/
    ``tile_nchunks``: (CAP,) int32 first key block, row blocks and key chunks
    of each tile. ``rows``: (B, QMAX, 4) int32 (s2, sink_end, cand_end, take)
    per query block, from ``contract``. All tensors contiguous.
    """
    BLOCK_M: tl.constexpr = BLOCK_G * BLOCK_I
    total = tl.load(item_end_ptr + CAP - 1)
    head_blocks = (G + BLOCK_G - 1) // BLOCK_G
    w = tl.program_id(0).to(tl.int64)
    while w < total:
        t = _find_tile(item_end_ptr, CAP, w)
        mblocks = tl.load(tile_mblocks_ptr + t).to(tl.int64)  # products below stay int64
        nchunks = tl.load(tile_nchunks_ptr + t)
        local = w - (tl.load(item_end_ptr + t) - NK * mblocks * nchunks)
        # Row blocks of one key chunk are neighbours: K tiles are reused in L2.
        mb = (local % mblocks).to(tl.int32)
        chunk = ((local // mblocks) % nchunks).to(tl.int32)
        n = (local // (mblocks * nchunks)).to(tl.int32)
        # Clamped so that no plan, however built, leads out of bounds.
        b = tl.minimum(tl.maximum(tl.load(plan_ptr + 4 * t), 0), B - 1)
        i0 = tl.minimum(tl.maximum(tl.load(plan_ptr + 4 * t + 1), 0), QMAX)
        i1 = tl.minimum(tl.maximum(tl.load(plan_ptr + 4 * t + 2), i0), QMAX)
        g0 = (mb % head_blocks) * BLOCK_G
        ia = i0 + (mb // head_blocks) * BLOCK_I

        # The item's query blocks decide whether its key chunk holds a candidate.
        qi = ia + tl.arange(0, BLOCK_I)
        info = rows_ptr + (b.to(tl.int64) * QMAX + qi) * 4
        sink = tl.load(info + 1, mask=qi < i1, other=0)
        cand = tl.load(info + 2, mask=qi < i1, other=0)
        take = tl.load(info + 3, mask=qi < i1, other=0)
        ranks = (qi < i1) & (take > 0) & (take < cand - sink)
        j0 = tl.load(tile_lo_ptr + t) + chunk * BLOCK_N
        j_end = tl.max(tl.where(ranks, cand, 0), 0)
        j_begin = tl.min(tl.where(ranks, sink, KMAX), 0)
        if (j0 < j_end) & (j0 + BLOCK_N > j_begin):
            acc = _block_scores(q_src, k_src, b, n * G + g0, ia, n, j0, NQ, NK, QMAX, KMAX,
                                DF, BLOCK_G, BLOCK_I, BLOCK_N, BLOCK_K, TMA, UPCAST)
            j = j0 + tl.arange(0, BLOCK_N)
            vb = tl.load(vb_ptr + (b.to(tl.int64) * NK + n) * KMAX + j, mask=j < KMAX, other=0.0)
            key = _rank_key(acc * scale + vb[None, :], shift)
            r = tl.arange(0, BLOCK_M)
            g = g0 + r // BLOCK_I
            i = ia + r % BLOCK_I
            out_rows = ((b.to(tl.int64) * NQ + n * G + g) * QMAX + i) * KMAX
            tl.store(out_ptr + out_rows[:, None] + j[None, :], key,
                     mask=((g < G) & (i < i1))[:, None] & (j < KMAX)[None, :])
        w += NPROG


@triton.jit
def _in_rows(ranks, c, start, BLOCK: tl.constexpr):
    """Which of candidates [start, start+BLOCK) of each row exist and rank."""
    col = start + tl.arange(0, BLOCK)
    return ranks[:, None] & (col[None, :] < c[:, None])


@triton.jit
def _row_keys(out_ptr, row_base, sink, valid, start, shift, BLOCK: tl.constexpr):
    """Candidate keys [start, start+BLOCK) of each row as uint32 in the keys'
    order: the sign bit of the key's width (32 bits, or 16 for bfloat16 keys,
    which are sign-extended) flipped, the bits above that width cleared.
    Invalid slots read as 0, which no key takes (NaN ranks as -inf, above 0):
    they load as the sign bit, so one xor-and makes every slot's value."""
    col = start + tl.arange(0, BLOCK)
    sign = tl.where(shift == 16, 0x8000, -2147483648)
    width = tl.where(shift == 16, 0xFFFF, -1)
    x = tl.load(out_ptr + row_base[:, None] + sink[:, None] + col[None, :], mask=valid,
                other=sign)
    return ((x ^ sign) & width).to(tl.uint32, bitcast=True)


@triton.jit
def _digit_counts(u, valid, prefix, pos, ROWS: tl.constexpr):
    """Per row, a 256-bin histogram of the 8-bit digit at bit ``pos`` of the
    keys whose higher digits equal ``prefix``: (ROWS, 256) int32."""
    digit = ((u >> pos) & 0xFF).to(tl.int32)
    match = valid & (((u >> pos) >> 8) == prefix[:, None])
    row = tl.arange(0, ROWS)[:, None] * 256
    # One histogram of ROWS*256 bins; -1 marks keys that do not count.
    bins = tl.reshape(tl.where(match, row + digit, -1), [ROWS * u.shape[1]], can_reorder=True)
    counts = tl.histogram(bins, ROWS * 256, mask=bins >= 0)
    return tl.reshape(counts, [ROWS, 256])


@triton.jit
def _bisect(u, ranks, take, top):
    """Per ranking row, the take-th largest of its keys ``u`` (all in
    registers, 0 where there is none) and how many keys equal to it are
    picked: a radix select of one bit per pass, from bit ``top`` down, as the
    largest ``thr`` with count(u >= thr) >= take. A pass costs a compare and
    an add per key, and a row is done as soon as some threshold leaves
    exactly ``take`` keys."""
    thr = tl.zeros_like(take).to(tl.uint32)
    above = tl.zeros_like(take)  # keys above thr once every bit is resolved
    exact = tl.zeros_like(ranks)
    done = ~ranks
    pos = top
    while (pos >= 0) & (tl.max((~done).to(tl.int32), 0) > 0):
        t = thr | (tl.full([], 1, tl.uint32) << pos)
        n = tl.sum((u >= t[:, None]).to(tl.int32), 1)  # t > 0: no empty slot counts
        thr = tl.where(~done & (n >= take), t, thr)
        above = tl.where(~done & (n < take), n, above)
        exact = exact | (~done & (n == take))
        done = done | exact
        pos -= 1
    # Exact rows take every key >= thr: `take` bounds the keys equal to it.
    return thr, tl.where(exact, take, take - above)


@triton.jit
def _next_digit(counts, prefix, want):
    """Append to ``prefix`` the digit of the ``want``-th largest matching key;
    ``want`` becomes its rank among the keys that match the longer prefix."""
    at_least = tl.sum(counts, 1)[:, None] - tl.cumsum(counts, 1) + counts  # keys with digit >= d
    digit = tl.sum((at_least >= want[:, None]).to(tl.int32), 1) - 1
    d = tl.arange(0, 256)[None, :]
    above = tl.sum(tl.where(d > digit[:, None], counts, 0), 1)
    return (prefix << 8) | digit.to(tl.uint32), want - above


@triton.jit
def _radix(out_ptr, row_base, sink, c, ranks, take, shift,
           ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """``_bisect`` for rows that do not fit in registers: a radix select of one
    8-bit digit per pass (four passes for 32-bit keys, two for 16-bit ones),
    each pass one read of the rows, BLOCK keys at a time, and a histogram per
    row of the digit among the keys that match the digits chosen so far."""
    n_chunks = (tl.max(tl.where(ranks, c, 0), 0) + BLOCK - 1) // BLOCK
    prefix = tl.zeros([ROWS], tl.uint32)
    want = take
    pos = 24 - shift
    while pos >= 0:
        counts = tl.zeros([ROWS, 256], tl.int32)
        ci = 0
        while ci < n_chunks:
            valid = _in_rows(ranks, c, ci * BLOCK, BLOCK)
            u = _row_keys(out_ptr, row_base, sink, valid, ci * BLOCK, shift, BLOCK)
            counts += _digit_counts(u, valid, prefix, pos, ROWS)
            ci += 1
        prefix, want = _next_digit(counts, prefix, want)
        pos -= 8
    return prefix, want


@triton.jit
def _threshold(out_ptr, row_base, sink, c, ranks, take, shift,
               ROWS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    """Per ranking row, the take-th largest key (as ``_row_keys`` gives it) and
    how many keys equal to it are picked. Rows of at most BLOCK_C candidates
    are read once and kept in registers, where a bit per pass is cheapest (a
    histogram costs far more instructions per key than a compare); longer rows
    are read once per 8-bit digit, BLOCK_W keys at a time."""
    if tl.max(tl.where(ranks, c, 0), 0) <= BLOCK_C:
        u = _row_keys(out_ptr, row_base, sink, _in_rows(ranks, c, 0, BLOCK_C), 0, shift, BLOCK_C)
        thr, need = _bisect(u, ranks, take, 31 - shift)
    else:
        thr, need = _radix(out_ptr, row_base, sink, c, ranks, take, shift, ROWS, BLOCK_W)
    return thr, need


@triton.jit
def _scatter_picks(out_ptr, row_base, sink, c, ranks, thr, need, shift, BLOCK_S: tl.constexpr):
    """Write each ranking row's picks (keys above ``thr`` and the first ``need``
    keys equal to it, lower block index first) to its slots sink, sink+1, ..."""
    ties_before = tl.zeros_like(sink)
    picks_before = tl.zeros_like(sink)
    n_chunks = (tl.max(tl.where(ranks, c, 0), 0) + BLOCK_S - 1) // BLOCK_S
    ci = 0
    while ci < n_chunks:
        valid = _in_rows(ranks, c, ci * BLOCK_S, BLOCK_S)
        u = _row_keys(out_ptr, row_base, sink, valid, ci * BLOCK_S, shift, BLOCK_S)
        tie = (valid & (u == thr[:, None])).to(tl.int32)
        tie_rank = ties_before[:, None] + tl.cumsum(tie, 1) - tie
        pick = valid & ((u > thr[:, None]) | ((tie != 0) & (tie_rank < need[:, None])))
        pick_i = pick.to(tl.int32)
        slot = sink[:, None] + picks_before[:, None] + tl.cumsum(pick_i, 1) - pick_i
        col = ci * BLOCK_S + tl.arange(0, BLOCK_S)
        tl.debug_barrier()  # every key of this chunk is read before any write
        tl.store(out_ptr + row_base[:, None] + slot, sink[:, None] + col[None, :], mask=pick)
        ties_before += tl.sum(tie, 1)
        picks_before += tl.sum(pick_i, 1)
        ci += 1


@triton.jit
def _row_facts(info, row_ok):
    """s2, sink_end, cand_end and take of rows whose facts start at ``info``,
    and whether they rank (some but not all of their candidates are picked)."""
    s2 = tl.load(info, mask=row_ok, other=0)
    sink = tl.load(info + 1, mask=row_ok, other=0)
    cand = tl.load(info + 2, mask=row_ok, other=0)
    take = tl.load(info + 3, mask=row_ok, other=0)
    return s2, sink, cand, take, row_ok & (take > 0) & (take < cand - sink)


@triton.jit
def select_kernel(
    out_ptr, len_ptr, rows_ptr, shift, NQ, QMAX, KMAX, first,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Exact per-row selection and the full output rows (see module doc).

    Program ``first + program_id`` takes row group ``pid % groups`` of
    (batch, head) ``pid // groups``; ``first`` lets the launcher split a grid
    larger than CUDA allows. ``out`` holds, for rows that rank, the keys of
    candidate columns [sink_end, cand_end) written by ``score_kernel``. Rows
    whose candidates are all kept (take == count) or none (take == 0) need no
    keys.
    """
    groups = (QMAX + ROWS - 1) // ROWS
    pid = tl.program_id(0).to(tl.int64) + first
    bh = pid // groups
    i = (pid % groups).to(tl.int32) * ROWS + tl.arange(0, ROWS)
    row_ok = i < QMAX
    info = rows_ptr + ((bh // NQ) * QMAX + i) * 4
    row_base = (bh * QMAX + i) * KMAX

    s2, sink, cand, take, ranks = _row_facts(info, row_ok)
    if tl.max(ranks.to(tl.int32), 0) > 0:
        c = cand - sink
        thr, need = _threshold(out_ptr, row_base, sink, c, ranks, take, shift, ROWS,
                               BLOCK_C, BLOCK_W)
        _scatter_picks(out_ptr, row_base, sink, c, ranks, thr, need, shift, BLOCK_W)
        tl.debug_barrier()  # the rows' keys are consumed; their other slots may be written
        # Read again rather than kept: held across the selection they spill.
        s2, sink, cand, take, ranks = _row_facts(info, row_ok)

    # Sink [0, sink), picks [sink, sink+take) (ranked rows: written above;
    # otherwise all candidates or none), window, then -1.
    length = s2 - (cand - sink) + take
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
    tl.store(len_ptr + bh * QMAX + i, length, mask=row_ok)
