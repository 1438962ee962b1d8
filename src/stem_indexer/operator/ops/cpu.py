"""The fast path: vectorised, exact, memory-bounded.

Torch operations and, on CPU, a small C selection kernel (``native.py``).
Written for CPU tensors and device-agnostic (CUDA tensors take the Triton
path when it is available; without it they select with torch operations).

How the rows of a tile of the metadata's work plan (one batch, query blocks
[i0, i1), all heads) are processed:

1. Per row, from ``contract``: visible range s2, sink end, candidate end and
   the budget K. The candidates of every row form one contiguous range, so a
   row is sink ++ sorted(picks) ++ window, already ascending. A row whose
   budget covers all its candidates takes them all and needs no score.
2. Scores of the other rows, float32, for the union [lo, hi) of their
   candidate ranges (``_scores``): batched SGEMMs over all KV heads, then
   ``* 1/R^2`` and ``+ vbias`` written into the tile's score buffer. Query
   blocks are the outer row index, so the rows that can pick a key block
   form a suffix and a causal tile computes little more than its triangle
   (``gemm_blocks``). On CPUs whose bfloat16 dot products beat their float32
   GEMM (AMX, AMD's AVX512-BF16: ``torch_blas.bf16_products_pay``) the bf16
   operands are multiplied where they lie by oneDNN's micro-kernel
   into float32 (``native.scores_bf16``, keys repacked in pairs in cache),
   and each product tile is scaled and biased (the same two roundings) as it
   is stored: products exact, sums in float32, so integer-valued inputs
   score exactly as with float32 GEMMs. Elsewhere bf16 operands are upcast
   into float32 buffers:
   keys once per batch when small (``KEY_CACHE_BYTES``), else one
   ``key_chunk`` at a time, by a native pass that also bounds the keys'
   magnitude (``native.widen_bf16``), as the micro-kernel's packing does:
   the overflow check (``_ExactDots``) then reads no input of its own.
3. Exact top-k and the output rows, by the native kernel where it is built
   (``native.py``; the default wherever a C compiler exists): per row, a
   radix select over order-preserving integer keys finds the K-th best, and
   one ascending pass writes sink ++ picks ++ window into the output (a
   large one in the memory of a released earlier output of its size, else
   on huge pages where the kernel gives them on request: ``native.filled``).
4. Otherwise with torch operations, to the same results:
   a. exact top-k without ranking every score (``_top_blocks``): a lower
      bound of each row's K-th best score from group maxima, the few scores
      at or above it (the survivors) packed per row in ascending block
      order, distinct int64 ranking keys (``contract.rank_keys_at``: ties go
      to the lower block) for the survivors only, and the K-th best key as
      an exact threshold. The picks come out in ascending order: no sort;
   b. rows written straight into the output, runs of rows with the same
      layout at once.

Dot products that may overflow float32 (``_ExactDots``: the batch's largest
inputs say whether some order of summation could leave float32's range; with
bfloat16 products, the keys' and queries' largest magnitudes come from the
products themselves, per tile, so the inputs are not read once more for
them) are computed as the reference computes them, one float32 matmul per query head
of all the batch's blocks: once a sum overflows, whether it ends as +inf,
-inf or NaN depends on the order of accumulation and on fused multiply-adds,
which BLAS chooses by shape (and instruction set), so only the same product
gives the same scores. Other scores cannot overflow in any order.

The score buffer holds at most ``metadata.TILE_ELEMENTS`` float32 values (a
tile's rows x the key blocks its last row sees, all query heads; plans
squeezed into the fixed metadata size run in steps of that size); the other
temporaries are fractions of it or bounded by ``metadata.OPERAND_BYTES``.
The large buffers live in a ``_Workspace`` reused by every tile, and kept
for the next call (``WORKSPACE_KEEP_BYTES`` in all, whatever the number of
calling threads; see ``release_workspace``): first touches of fresh memory
(page faults) would otherwise cost as much as the arithmetic done in them.
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import NamedTuple

import torch

from .. import contract
from ..contract import IndexerParams, ceil_div
from ..metadata import OPERAND_BYTES, tile_rows
from . import native, torch_blas

# Key blocks per float32 matmul: up to GEMM_KEYS_MAX where every row of the
# matmul can pick them all; along a causal diagonal, steps of GEMM_KEYS_MIN (a
# row then computes fewer than GEMM_KEYS_MIN scores it cannot pick). Narrower
# matmuls run markedly below the SGEMM peak. The bfloat16 products write
# straight into the scores, tile by tile in cache, so their calls are not
# capped: each call ends at a barrier, and at S3 (8,184 key blocks) 17
# calls of 512 instead of 2 cost about a tenth of the op.
GEMM_KEYS_MAX = 512
GEMM_KEYS_MIN = 64
# Score buffers of at least this many bytes are written with streaming
# stores by the bfloat16 products: the selection reads them back after the
# products have read all the keys, so they are out of the caches by then, and
# ordinary stores would read each line in before writing it (AMX Xeon, S3's
# 67 MB of scores: the op 0.84x the time with them streamed). Rows are padded
# to SCORE_ROW_ALIGN floats so that whole tile rows are 64-byte aligned.
STREAM_SCORES_BYTES = 16 << 20
SCORE_ROW_ALIGN = 16
# At most this many key blocks are scored at once; wider rows go in chunks.
KEY_CHUNK_MAX = 1 << 14
# A batch's keys are upcast to float32 once (and reused by all its tiles)
# when the copy is at most this large; otherwise one key chunk at a time.
KEY_CACHE_BYTES = 2 * OPERAND_BYTES
# Group maxima per row, as a multiple of the budget: more groups give a
# tighter lower bound (fewer survivors) for a larger top-k over the maxima.
GROUPS_PER_PICK = 2
# Rows at least this many times wider than the budget are grouped.
GROUPING_MIN_WIDTH = 8
# Score elements per slice of the survivor stage (bounds its temporaries).
SURVIVOR_ELEMENTS = 1 << 22


def key_chunk(kv_heads: int, dim_qkflat: int) -> int:
    """Key blocks scored at once: their float32 copy fits ``OPERAND_BYTES``."""
    return max(1, min(KEY_CHUNK_MAX, OPERAND_BYTES // (4 * kv_heads * dim_qkflat)))


def stem_indexer_forward(
    qflat: torch.Tensor, kflat: torch.Tensor, vbias: torch.Tensor,
    q_lens: torch.Tensor, kv_lens: torch.Tensor, prompt_lens: torch.Tensor,
    tiles: torch.Tensor, params: IndexerParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the indexer over the plan's ``tiles`` (host tensors for lengths/plan).

    Tiles whose rows all keep every candidate or none need no score: their
    rows are written at once (``_write_unranked``), so a batch of many short
    sequences costs a few tensor operations, not a loop over its tiles. The
    other tiles run one at a time (``_select_rows``).
    """
    device = qflat.device
    batch, nq, qmax, df = qflat.shape
    kmax = kflat.shape[2]
    bs = params.stem_block_size
    small = batch * nq * qmax * kmax <= SMALL_OUTPUT  # filled faster than a team wakes
    with native.omp_threads(1 if small else torch.get_num_threads()):
        if device.type == "cpu":
            indices = native.filled((batch, nq, qmax, kmax), -1, torch.int32)
        else:
            indices = torch.full((batch, nq, qmax, kmax), -1, dtype=torch.int32, device=device)
        seq_len = torch.zeros((batch, nq, qmax), dtype=torch.int32, device=device)

    with native.omp_threads(1):  # bookkeeping: one value per row at most
        qb_all = ceil_div(q_lens.to(torch.int64), bs)
        kb_all = ceil_div(kv_lens.to(torch.int64), bs)
        p_all = ceil_div(prompt_lens.to(torch.int64), bs)
        ks_all = contract.prompt_budget(p_all, params)
        ranking_tiles = _write_unranked(tiles, qb_all, kb_all, p_all, ks_all, params, indices,
                                        seq_len)
    if not ranking_tiles:
        return indices, seq_len
    qb_all, kb_all = qb_all.tolist(), kb_all.tolist()
    scale = contract.score_scale(params)
    ws = _workspace(device)
    keys_b, cached_for, exact = None, None, None
    for b, i0, i1, facts in ranking_tiles:
        qb, kb = qb_all[b], kb_all[b]
        if cached_for != b:
            keys_b, cached_for = _batch_keys(kflat[b], kb, ws), b
            exact = _ExactDots.where_needed(
                qflat[b], kflat[b], qb, kb,
                checked_later=_bf16_gemm(keys_b) or _widened_bounded(keys_b))
        # A plan squeezed into the fixed-size metadata may hold tiles of more
        # rows than the budget allows; such tiles run in budget-sized steps.
        step = tile_rows(nq, df, kb)
        for r0 in range(i0, i1, step):
            r1 = min(r0 + step, i1)
            length = _select_rows(qflat[b, :, r0:r1], keys_b, vbias[b],
                                  facts[:, r0 - i0:r1 - i0], scale, params, ws,
                                  indices[b, :, r0:r1], exact, r0)
            seq_len[b, :, r0:r1] = length.to(device)
    _keep(ws)
    return indices, seq_len


# Outputs of at most this many elements are allocated and filled by one thread.
SMALL_OUTPUT = 1 << 20
# Rows written at once by ``_write_unranked``, at most.
UNRANKED_ROWS_AT_ONCE = 4096


def _write_unranked(tiles, qb_all, kb_all, p_all, ks_all, params: IndexerParams, indices,
                    seq_len) -> list[tuple[int, int, int, torch.Tensor]]:
    """Write the rows of every tile in which no row ranks (each keeps all its
    candidates or none: sink ++ [candidates] ++ window); return the other
    tiles as ``(b, i0, i1, facts)``, facts (5, i1 - i0) int64: each row's
    visible blocks s2, sink end, candidate end, picks and length (computed
    here for all rows at once, not tile by tile)."""
    tiles = tiles.to(torch.int64)
    count = tiles[:, 2] - tiles[:, 1]
    tile_of = torch.repeat_interleave(torch.arange(tiles.shape[0]), count)
    b = tiles[tile_of, 0]
    i = tiles[tile_of, 1] + torch.arange(int(count.sum())) - (count.cumsum(0) - count)[tile_of]
    qb, kb = qb_all[b], kb_all[b]
    s2 = contract.visible_blocks(i, qb, kb, params.causal)
    sink_end, cand_end = contract.candidate_range(s2, params.initial_blocks, params.window_size)
    n_cand = cand_end - sink_end
    take = torch.minimum(contract.row_budget(i + kb - qb, p_all[b], ks_all[b], params.alpha),
                         n_cand)
    ranks = (take > 0) & (take < n_cand)
    tile_ranks = torch.zeros(tiles.shape[0], dtype=torch.bool).index_put_(
        (tile_of,), ranks, accumulate=True)
    keep = ~tile_ranks[tile_of]
    head = sink_end + take  # positions [0, head) hold blocks 0.., the rest cand_end..
    length = s2 - n_cand + take
    kept = keep.nonzero().flatten()
    for lo in range(0, kept.numel(), UNRANKED_ROWS_AT_ONCE):
        sel = kept[lo:lo + UNRANKED_ROWS_AT_ONCE]
        width = int(length[sel].max()) if sel.numel() else 0
        pos = torch.arange(width)
        row = torch.where(pos < head[sel, None], pos, pos - head[sel, None] + cand_end[sel, None])
        row = torch.where(pos < length[sel, None], row, -1).to(torch.int32)
        bd, idd = b[sel].to(indices.device), i[sel].to(indices.device)
        indices[bd, :, idd, :width] = row[:, None, :].to(indices.device)
        seq_len[bd, :, idd] = length[sel, None].to(device=indices.device, dtype=torch.int32)
    facts = torch.stack([s2, sink_end, cand_end, take, length])  # the rows in tile order
    ranking = tile_ranks.nonzero().flatten()
    starts = (count.cumsum(0) - count)[ranking].tolist()
    return [(batch, i0, i1, facts[:, start:start + i1 - i0])
            for (batch, i0, i1), start in zip(tiles[ranking, :3].tolist(), starts)]


class _Workspace:
    """Scratch buffers, reused (and grown when needed) by name.

    The buffers are ordinary tensors even when a call under
    ``torch.inference_mode()`` allocates them: an inference tensor cannot be
    written outside that mode, and the next call may run outside it.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        size = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < size:
            self._buffers.pop(name, None)  # free the old one first
            with torch.inference_mode(False):
                buf = self._buffers[name] = torch.empty(size, dtype=dtype, device=self.device)
        return buf[:size].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


# CPU calls keep their scratch buffers for the next call (a model calls the
# op once per layer): at most WORKSPACE_KEEP_BYTES in all, however many Python
# threads call the op. A call takes a kept workspace (its own while it runs)
# and returns it when done if the total stays within the bound.
WORKSPACE_KEEP_BYTES = 256 << 20
_pool: list[_Workspace] = []
_pool_lock = threading.Lock()


def _workspace(device: torch.device) -> _Workspace:
    if device.type == "cpu":
        with _pool_lock:
            if _pool:
                return _pool.pop()  # a call that raises leaves nothing behind
    return _Workspace(device)


def _keep(ws: _Workspace) -> None:
    if ws.device.type != "cpu":
        return
    with _pool_lock:
        if ws.nbytes() + sum(w.nbytes() for w in _pool) <= WORKSPACE_KEEP_BYTES:
            _pool.append(ws)


def kept_bytes() -> int:
    """Scratch memory kept for the next calls (all threads together)."""
    with _pool_lock:
        return sum(w.nbytes() for w in _pool)


def release_workspace() -> None:
    """Free the scratch buffers the CPU path keeps for the next calls, and
    the memory of released large outputs kept for the next ones
    (``native.release_outputs``)."""
    with _pool_lock:
        _pool.clear()
    native.release_outputs()


def _bf16_gemm(kflat_b: torch.Tensor) -> bool:
    """The scores of these keys come from bfloat16 products (``_scores``):
    where they can (``native.bf16_scores_available``) and are the faster
    (``torch_blas.bf16_products_pay``; else float32 GEMMs, said in
    ``native.bf16_scores_status``)."""
    return (kflat_b.device.type == "cpu" and kflat_b.dtype == torch.bfloat16
            and kflat_b.stride(-1) == 1 and torch_blas.bf16_products_pay()[0]
            and native.bf16_scores_available(kflat_b.shape[-1]))


def _widened_bounded(kflat_b: torch.Tensor) -> bool:
    """The float32 GEMMs widen these bfloat16 keys chunk by chunk in a pass
    that also bounds their magnitude (``native.widen_bf16``), so their
    overflow check needs no pass of its own (``_ExactDots.where_needed``)."""
    return (kflat_b.device.type == "cpu" and kflat_b.dtype == torch.bfloat16
            and kflat_b.stride(-1) == 1 and kflat_b.stride(-2) == kflat_b.shape[-1]
            and native.load(native.SELECT_ROWS) is not None)


def _batch_keys(kflat_b: torch.Tensor, kb: int, ws: _Workspace) -> torch.Tensor:
    """The batch's key blocks: a float32 copy when small, else the input (as
    is for the bfloat16 GEMM)."""
    nk, _, df = kflat_b.shape
    if 4 * nk * kb * df > KEY_CACHE_BYTES or _bf16_gemm(kflat_b):
        return kflat_b
    return ws.take("key_cache", (nk, kb, df), torch.float32).copy_(kflat_b[:, :kb])


def _select_rows(q, keys_b, vbias_b, facts, scale, params, ws, out, exact=None, r0=0):
    """Select for consecutive query blocks of one batch, all heads, into ``out``.

    q: (Nq, c, Df), query blocks r0.. of the batch; facts: (5, c) host int64,
    per row s2, sink end, candidate end, picks (the budget, at most the
    candidates) and length (``_write_unranked``); out: (Nq, c, Kmax) int32
    view of the output, prefilled with -1; exact: the batch's ``_ExactDots``
    or None.
    Returns the rows' lengths (c,) int32 (host).
    """
    c = q.shape[1]
    s2, sink_end, cand_end, take, length = facts
    n_cand = cand_end - sink_end
    # Rows whose budget is smaller than their candidate range must rank; with
    # s2 non-decreasing along the tile they are a suffix [first, c).
    ranking = (take < n_cand).nonzero()
    first = int(ranking[0]) if ranking.numel() else c
    picking = first < c and int(take[first:].max()) > 0
    if exact is not None:
        exact = exact.rows(r0 + first, r0 + c)
    if out.device.type == "cpu" and native.load(native.SELECT_ROWS) is None:
        native.report_fallback("selection", native.status(native.SELECT_ROWS))  # once
    if out.device.type == "cpu" and native.kernel() is not None:
        scores, lo = None, 0
        if picking:
            lo, hi = int(sink_end[first:].min()), int(cand_end.max())
            scores = _scores(q[:, first:], keys_b, vbias_b, lo, hi, cand_end[first:], scale,
                             hi - lo, ws, exact, aligned=True)
        nk = keys_b.shape[0]
        native.select_rows(nk, c, q.shape[0] // nk, s2, sink_end, cand_end, take, scores,
                           first, lo, params.topk_score_precision, out)
        return length.to(torch.int32)

    ranked = None
    if picking:
        ranked = _top_blocks(q[:, first:], keys_b, vbias_b, sink_end[first:], cand_end[first:],
                             take[first:], scale, params.topk_score_precision, ws, exact)

    # Rows are written into the prefilled output; past their length stays -1.
    ar = torch.arange(int(s2.max()) if c else 0, dtype=torch.int32, device=out.device)
    if first:  # rows taking every visible block: [0, s2)
        whole = int(s2[first - 1])
        s2_d = s2[:first].to(device=out.device, dtype=torch.int32)
        out[:, :first, :whole] = torch.where(ar[:whole] < s2_d[:, None], ar[:whole], -1)
    # Ranked rows: runs with the same layout (sink, picks and window lengths)
    # are written together as sink ++ picks ++ window.
    layout = torch.stack([sink_end, take, s2 - cand_end], 1)[first:].tolist()
    a = first
    while a < c:
        sink_i, take_i, win_i = layout[a - first]
        b = a + 1
        while b < c and layout[b - first] == layout[a - first]:
            b += 1
        out[:, a:b, :sink_i] = ar[:sink_i]
        if take_i:
            out[:, a:b, sink_i:sink_i + take_i] = ranked[:, a - first:b - first, :take_i]
        window_start = cand_end[a:b].to(device=out.device, dtype=torch.int32)
        out[:, a:b, sink_i + take_i:sink_i + take_i + win_i] = window_start[:, None] + ar[:win_i]
        a = b
    return length.to(torch.int32)


def _scores(q, keys_b, vbias_b, lo, hi, cand_end, scale, width, ws, exact=None,
            aligned=False):
    """Float32 scores (Nk, c, G, width) of key blocks [lo, hi), padding after;
    with ``aligned``, ``width`` may be rounded up to ``SCORE_ROW_ALIGN``.

    Row (n, i, g) is query head n*G + g, query block i. Entries outside a row's
    candidate range may be left unset: the caller masks them. ``exact``: a
    function of (lo, hi) giving the dot products (Nq, c, hi - lo) where they
    may overflow (``_ExactDots.rows``), else None; where the bfloat16
    products run, or the keys are widened by a pass that bounds them, and
    the inputs' check waits for them (``exact.deferred``), they are used
    only if the keys and queries those products read may overflow.
    """
    nq, c, df = q.shape
    nk = keys_b.shape[0]
    group = nq // nk
    bf16 = _bf16_gemm(keys_b) and (exact is None or exact.deferred)
    if bf16 and aligned:  # every row starts on a 64-byte boundary (the buffer does)
        width = ceil_div(width, SCORE_ROW_ALIGN) * SCORE_ROW_ALIGN
    scores = ws.take("scores", (nk, c, group, width), torch.float32)
    if bf16:
        # bfloat16 operands where they lie, float32 products
        a = q.view(nk, group, c, df)
        if a.stride(-1) != 1 or a.stride(-2) != df:
            a = ws.take("queries", a.shape, torch.bfloat16).copy_(a)
        bias = vbias_b if vbias_b.stride(-1) == 1 else vbias_b.contiguous()
        stream = 4 * scores.numel() >= STREAM_SCORES_BYTES
        # The first call's rows [r, c) hold every later call's (r only grows):
        # only it reports their largest magnitude.
        maxima = [native.scores_bf16(a[:, :, r:], keys_b[:, j0:j1],  # scaled and biased
                                     scores[:, r:, :, j0 - lo:j1 - lo], scale, bias[:, j0:j1],
                                     stream, queries=n == 0)
                  for n, (_, _, j0, j1, r) in enumerate(
                      gemm_blocks(cand_end.tolist(), lo, hi, hi - lo, widest=hi - lo))]
        if exact is None or not exact.needed(_largest([k for k, _ in maxima]),
                                             _largest([q for _, q in maxima])):
            return scores
        return _exact_scores(exact, lo, hi, scale, vbias_b, scores)
    if exact is not None and not exact.deferred:
        return _exact_scores(exact, lo, hi, scale, vbias_b, scores)
    qf = ws.take("queries", (nk, c, group, df), torch.float32)
    qf.copy_(q.view(nk, group, c, df).transpose(1, 2))  # upcast and reorder in one pass
    cached = keys_b.dtype == torch.float32
    chunk = hi - lo if cached else key_chunk(nk, df)
    kc, held, key_max = None, None, []
    for u0, u1, j0, j1, r in gemm_blocks(cand_end.tolist(), lo, hi, chunk):
        if cached:
            kc, held = keys_b, 0
        elif held != u0:
            kc = ws.take("keys", (nk, u1 - u0, df), torch.float32)
            bound = native.widen_bf16(keys_b[:, u0:u1], kc)
            if bound is None:
                kc.copy_(keys_b[:, u0:u1])
                bound = _abs_max(kc)
            key_max.append(bound)
            held = u0
        rows = qf[:, r:].reshape(nk, (c - r) * group, df)
        prod = ws.take("product", (nk, (c - r) * group, j1 - j0), torch.float32)
        torch.bmm(rows, kc[:, j0 - held:j1 - held].transpose(1, 2), out=prod)
        prod.mul_(scale)  # then + vbias: the contract's two roundings
        torch.add(prod.view(nk, c - r, group, j1 - j0), vbias_b[:, None, None, j0:j1],
                  out=scores[:, r:, :, j0 - lo:j1 - lo])
    if exact is not None and exact.needed(_largest(key_max), _abs_max(q)):  # deferred here
        return _exact_scores(exact, lo, hi, scale, vbias_b, scores)
    return scores


def _exact_scores(exact, lo: int, hi: int, scale: float, vbias_b: torch.Tensor,
                  scores: torch.Tensor) -> torch.Tensor:
    """``_scores`` from the exact products (``exact``), with the same two
    roundings as the GEMMs'."""
    nk, c, group, _ = scores.shape
    prod = (exact(lo, hi) * scale).view(nk, group, c, hi - lo).transpose(1, 2)
    torch.add(prod, vbias_b[:, None, None, lo:hi], out=scores[..., :hi - lo])
    return scores


# _ExactDots keeps all heads' products of a batch when they fit in this many
# bytes; larger batches compute one head's at a time for each tile.
EXACT_CACHE_BYTES = 4 * OPERAND_BYTES
# Below this bound on |dot| terms summed (Df * max|q| * max|k|), no partial
# sum can leave float32's range in any order (half its maximum: room for the
# roundings of the partial sums).
OVERFLOW_FREE = 2.0**127


class _ExactDots:
    """A batch's dot products, as ``stem_indexer.operator.reference`` computes them:
    ``qflat[h, :qb].float() @ kflat[h // G, :kb].float().T`` per query head.

    Used where a dot product may overflow float32 (``where_needed``): the
    result of an overflowing sum (+inf, -inf or NaN) depends on the order of
    accumulation and fused multiply-adds, which BLAS picks by the shape of the
    product, so the tile-shaped products of ``_scores`` could differ from the
    reference's there. The same product on the same inputs gives the same
    floats, whatever instruction set BLAS dispatches to.
    """

    def __init__(self, qflat_b: torch.Tensor, kflat_b: torch.Tensor, qb: int, kb: int,
                 deferred: bool = False):
        self.q, self.k, self.qb, self.kb = qflat_b, kflat_b, qb, kb
        self.group = qflat_b.shape[0] // kflat_b.shape[0]
        self.deferred = deferred  # the inputs are checked per tile (``needed``)
        self.all = None  # all heads' products, made when first needed, if small

    @staticmethod
    def where_needed(qflat_b, kflat_b, qb: int, kb: int,
                     checked_later: bool = False) -> _ExactDots | None:
        """The batch's products if some may overflow (or the inputs hold NaN
        or inf), else None. ``checked_later``: the scores' products report the
        largest key and query they read (``native.scores_bf16``, or the keys'
        widening, ``native.widen_bf16``), so the inputs are not read here:
        the products are then used by the tiles whose inputs need them
        (``needed``)."""
        if checked_later:
            return _ExactDots(qflat_b, kflat_b, qb, kb, deferred=True)
        if _overflow_free(qflat_b.shape[-1], _abs_max(qflat_b[:, :qb]),
                          _abs_max(kflat_b[:, :kb])):
            return None
        return _ExactDots(qflat_b, kflat_b, qb, kb)

    def needed(self, key_max: float, query_max: float) -> bool:
        """Whether products of keys and queries of magnitudes at most
        ``key_max`` and ``query_max`` need these exact products."""
        return not (self.deferred and _overflow_free(self.q.shape[-1], query_max, key_max))

    def _head(self, h: int) -> torch.Tensor:
        n = h // self.group
        return self.q[h, :self.qb].float().cpu() @ self.k[n, :self.kb].float().cpu().T

    def products(self, r0: int, r1: int, lo: int, hi: int) -> torch.Tensor:
        """The products (Nq, r1 - r0, hi - lo) of query blocks [r0, r1)
        with key blocks [lo, hi)."""
        if self.all is None and 4 * self.q.shape[0] * self.qb * self.kb <= EXACT_CACHE_BYTES:
            self.all = torch.stack([self._head(h) for h in range(self.q.shape[0])])
        if self.all is not None:
            return self.all[:, r0:r1, lo:hi].to(self.q.device)
        return torch.stack([self._head(h)[r0:r1, lo:hi]
                            for h in range(self.q.shape[0])]).to(self.q.device)

    def rows(self, r0: int, r1: int) -> _TileDots:
        """The products of query blocks [r0, r1), as a function of (lo, hi)."""
        return _TileDots(self, r0, r1)


class _TileDots(NamedTuple):
    """``_ExactDots`` of one tile's rows: called with (lo, hi), the products
    (Nq, r1 - r0, hi - lo) with key blocks [lo, hi)."""

    dots: _ExactDots
    r0: int
    r1: int

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        return self.dots.products(self.r0, self.r1, lo, hi)

    @property
    def deferred(self) -> bool:
        return self.dots.deferred

    def needed(self, key_max: float, query_max: float) -> bool:
        return self.dots.needed(key_max, query_max)


def _largest(x: list[float]) -> float:
    """The largest of ``x`` (0 if empty), NaN if one is."""
    return math.nan if any(math.isnan(v) for v in x) else max(x, default=0.0)


def _overflow_free(df: int, q_max: float, k_max: float) -> bool:
    """No sum of ``df`` products of such magnitudes can overflow float32 in
    any order (False for NaN and inf)."""
    return df * q_max * k_max < OVERFLOW_FREE


def _abs_max(x: torch.Tensor) -> float:
    """The largest magnitude in ``x`` (heads, rows, Df), NaN if any element
    is. Head by head: torch reduces a contiguous head several times faster
    than a view of the leading rows of every head at once."""
    lo_hi = torch.stack([torch.stack(torch.aminmax(head)) for head in x])  # NaN if any is
    return max(-float(lo_hi[:, 0].min()), float(lo_hi[:, 1].max()))


def gemm_blocks(cand_ends: list[int], lo: int, hi: int, chunk: int,
                widest: int = GEMM_KEYS_MAX):
    """The matmuls of a tile's scores, as ``(u0, u1, j0, j1, r)``.

    Key blocks [u0, u1) are one float32 key chunk; within it, key blocks
    [j0, j1) are multiplied with query blocks [r, c), the rows that can pick
    block j0 (``cand_ends``, one per query block, is non-decreasing). Keys
    that all those rows can pick go in matmuls up to ``widest`` wide;
    along a causal diagonal the steps are ``GEMM_KEYS_MIN`` wide.
    """
    c = len(cand_ends)
    for u0 in range(lo, hi, chunk):
        u1 = min(u0 + chunk, hi)
        j0 = u0
        while j0 < u1:
            r = bisect.bisect_right(cand_ends, j0)  # first row that can pick block j0
            if r >= c:
                return
            j1 = min(u1, j0 + widest, max(cand_ends[r], j0 + GEMM_KEYS_MIN))
            yield u0, u1, j0, j1, r
            j0 = j1


def _top_blocks(q, keys_b, vbias_b, sink_end, cand_end, take, scale, precision, ws,
                exact=None):
    """The ``take`` best candidates of each row, ascending block indices.

    q: (Nq, c, Df); sink_end, cand_end, take: (c,) host int64 per query block.
    Returns (Nq, c, max(take)) int32; entries past a row's ``take`` are junk.
    """
    device = q.device
    nq, c, _ = q.shape
    nk = keys_b.shape[0]
    group = nq // nk
    lo, hi = int(sink_end.min()), int(cand_end.max())
    take_max = int(take.max())
    # Groups of g strided columns; at least GROUPS_PER_PICK * take_max groups.
    # Rows only a few times wider than the budget rank directly (g = 1).
    g = 1
    if hi - lo >= GROUPING_MIN_WIDTH * take_max:
        g = (hi - lo) // (GROUPS_PER_PICK * take_max)
    n_groups = ceil_div(hi - lo, g)
    width = n_groups * g
    sink_d, cand_d, take_d = (t.to(device) for t in (sink_end, cand_end, take))

    scores = _scores(q, keys_b, vbias_b, lo, hi, cand_end, scale, width, ws, exact)
    if precision == 2:
        scores.copy_(scores.to(torch.bfloat16))
    # Non-candidates (sink, window, blocks a row cannot see, padding) and
    # entries never computed rank below every candidate. Sinks are a few
    # columns on the left; on the right only the columns past the first row's
    # candidate end need a per-row mask.
    sink_max, cand_min = int(sink_end.max()), int(cand_end.min())
    if sink_max > lo:
        cols = torch.arange(lo, sink_max, device=device)
        scores[..., :sink_max - lo].masked_fill_(
            (cols < sink_d[:, None])[None, :, None, :], -math.inf)
    cols = torch.arange(cand_min, lo + width, device=device)
    scores[..., cand_min - lo:].masked_fill_((cols >= cand_d[:, None])[None, :, None, :],
                                             -math.inf)

    # Lower bound: the take-th largest of the group maxima is a take-th
    # largest of a subset of the row, so at most the row's take-th largest
    # (exactly it when g == 1).
    n_rows = nk * c * group
    maxima = scores.view(n_rows, width)
    if g > 1:
        maxima = scores.view(nk, c, group, g, n_groups).amax(dim=3).view(n_rows, n_groups)
    if bool(maxima.sum().isnan()):  # NaN ranks as -inf (sums and maxima propagate NaN)
        torch.nan_to_num_(scores, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        if g > 1:
            maxima = scores.view(nk, c, group, g, n_groups).amax(dim=3).view(n_rows, n_groups)

    def per_row(t):  # (c,) per query block -> (n_rows,)
        return t[None, :, None].expand(nk, c, group).reshape(n_rows)

    row_take = per_row(take_d)
    uniform = int(take.min()) == take_max
    bound = _kth_largest(maxima, row_take, take_max, uniform)
    bound = bound.masked_fill((row_take == 0)[:, None], math.inf)

    # The rest runs in slices of rows, so that its temporaries stay small.
    flat = scores.view(n_rows, width)
    row_sink, row_cand = per_row(sink_d), per_row(cand_d)
    picks = torch.empty((n_rows, take_max), dtype=torch.int32, device=device)
    step = max(1, SURVIVOR_ELEMENTS // width)
    for r0 in range(0, n_rows, step):
        r1 = min(r0 + step, n_rows)
        picks[r0:r1] = _survivor_picks(flat[r0:r1], bound[r0:r1], row_take[r0:r1],
                                       row_sink[r0:r1], row_cand[r0:r1], lo, take_max, uniform)
    # Survivors and picks are in column order: ascending block indices.
    return picks.view(nk, c, group, take_max).transpose(1, 2).reshape(nq, c, take_max)


def _survivor_picks(flat, bound, row_take, row_sink, row_cand, lo, take_max, uniform):
    """Picks (rows, take_max) int32 of score rows ``flat`` (first column = key
    block ``lo``) from their survivors, the scores >= ``bound``."""
    device = flat.device
    n_rows, width = flat.shape
    row, col = (flat >= bound).nonzero().unbind(1)  # row-major: ascending columns
    starts = row_take.cumsum(0) - row_take  # first pick slot of each row
    block = col + lo
    if row.numel() == int(row_take.sum()):
        # Each row has at least take survivors, so with this total exactly
        # take: the survivors are the picks (always when g == 1 and no tie
        # straddles the threshold).
        if uniform:
            return block.to(torch.int32).view(n_rows, take_max)
        picks = torch.zeros((n_rows, take_max), dtype=torch.int32, device=device)
        picks[row, torch.arange(row.numel(), device=device) - starts[row]] = block.to(
            torch.int32)
        return picks
    # Exact threshold among the survivors: the take-th best ranking key (keys
    # are distinct, so exactly take keys of a row are >= it).
    counts = torch.bincount(row, minlength=n_rows)
    slot = torch.arange(row.numel(), device=device) - (counts.cumsum(0) - counts)[row]
    keys = contract.rank_keys_at(flat.view(-1)[row * width + col], block, 1)  # rounded already
    keys.masked_fill_((block < row_sink[row]) | (block >= row_cand[row]), contract.NO_CANDIDATE)
    packed = torch.full((n_rows, max(int(counts.max()), take_max)), contract.NO_CANDIDATE,
                        dtype=torch.int64, device=device)
    packed[row, slot] = keys
    kth = _kth_largest(packed, row_take, take_max, uniform)
    kth = kth.masked_fill((row_take == 0)[:, None], torch.iinfo(torch.int64).max)
    prow, pslot = (packed >= kth).nonzero().unbind(1)
    picks = torch.zeros((n_rows, take_max), dtype=torch.int32, device=device)
    picks[prow, torch.arange(prow.numel(), device=device) - starts[prow]] = (
        contract.block_of_key(packed[prow, pslot]).to(torch.int32))
    return picks


def _kth_largest(x: torch.Tensor, row_take: torch.Tensor, k: int, uniform: bool) -> torch.Tensor:
    """(rows, 1): the ``row_take``-th largest entry of each row of ``x``.

    When every row takes the same ``k`` (``uniform``), an unsorted top-k and
    a minimum suffice (cheaper than sorting).
    """
    if uniform:
        return x.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    nth = (row_take - 1).clamp(min=0)[:, None]
    return x.topk(k, dim=-1).values.gather(-1, nth)
