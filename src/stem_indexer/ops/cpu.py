"""The fast path: vectorised, exact, memory-bounded; plain torch operations.

Written for CPU tensors and device-agnostic, so it also serves CUDA tensors
until a dedicated GPU path exists.

How the rows of a tile of the metadata's work plan (one batch, query blocks
[i0, i1), all heads; run in budget-sized steps) are processed:

1. per row, from ``contract``: visible range s2, sink end, candidate end and
   the budget K; the candidates of every row form one contiguous range;
2. scores only for key blocks inside the union of the rows' candidate
   ranges (sink and window blocks need no score, blocks past the last row's
   visible range are never touched), ``metadata.key_chunk`` key blocks at a time:
   one batched float32 matmul over all KV heads, times 1/R^2, plus vbias;
3. scores become distinct int64 ranking keys (``contract.rank_keys``), so an
   ordinary top-k is exact and ties go to the lower block index; chunks are
   merged by a second top-k over at most 2 x 256 keys;
4. each row is written as sink ++ sorted(top-k) ++ window, which is already
   ascending and duplicate-free because the candidates lie between the two.

Temporaries are bounded by the tile budget (``metadata.TILE_ELEMENTS`` score
elements of a few bytes each, plus float32 copies of the tile's query rows and
of one key chunk, ``metadata.OPERAND_BYTES`` each), whatever the sequence
length.
"""

from __future__ import annotations

import torch

from .. import contract
from ..contract import IndexerParams, ceil_div
from ..metadata import key_chunk, tile_rows


def _tile_top_keys(q, kflat_b, vbias_b, lo, hi, sink_end, cand_end, take, scale, precision):
    """Top ``take`` ranking keys per row among candidates in [lo, hi).

    q: (Nk, G*c, Df) bf16; kflat_b: (Nk, Kmax, Df); vbias_b: (Nk, Kmax);
    sink_end, cand_end: (c,) candidate range per query block.
    Returns (Nk, G, c, take) int64 keys, descending.
    """
    nk, _, df = q.shape
    c = sink_end.shape[0]
    qf = q.float()
    chunk = key_chunk(nk, df)
    best = None
    for j0 in range(lo, hi, chunk):
        j1 = min(j0 + chunk, hi)
        k = kflat_b[:, j0:j1].float()
        scores = torch.bmm(qf, k.transpose(1, 2)) * scale + vbias_b[:, None, j0:j1]
        keys = contract.rank_keys(scores.view(nk, -1, c, j1 - j0), j0, precision)
        cols = torch.arange(j0, j1, device=q.device)
        is_candidate = (cols >= sink_end[:, None]) & (cols < cand_end[:, None])
        keys = keys.masked_fill(~is_candidate, contract.NO_CANDIDATE)
        top = keys.topk(min(take, j1 - j0), dim=-1).values
        if best is not None:
            top = torch.cat([best, top], dim=-1)
            top = top.topk(min(take, top.shape[-1]), dim=-1).values
        best = top
    return best


def stem_indexer_forward(
    qflat: torch.Tensor, kflat: torch.Tensor, vbias: torch.Tensor,
    q_lens: torch.Tensor, kv_lens: torch.Tensor, prompt_lens: torch.Tensor,
    tiles: torch.Tensor, params: IndexerParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the indexer over the plan's ``tiles`` (host tensors for lengths/plan)."""
    device = qflat.device
    batch, nq, qmax, df = qflat.shape
    nk, kmax = kflat.shape[1], kflat.shape[2]
    bs = params.stem_block_size
    indices = torch.full((batch, nq, qmax, kmax), -1, dtype=torch.int32, device=device)
    seq_len = torch.zeros((batch, nq, qmax), dtype=torch.int32, device=device)

    qb_all = ceil_div(q_lens.to(torch.int64), bs).tolist()
    kb_all = ceil_div(kv_lens.to(torch.int64), bs).tolist()
    p_all = ceil_div(prompt_lens.to(torch.int64), bs)
    ks_all = contract.prompt_budget(p_all, params)
    scale = contract.score_scale(params)

    for b, i0, i1, _ in tiles.tolist():
        qb, kb = qb_all[b], kb_all[b]
        # A plan squeezed into the fixed-size metadata may hold tiles of more
        # rows than the budget allows; such tiles run in budget-sized steps.
        step = tile_rows(nq, df, min(kb, key_chunk(nk, df)))
        for r0 in range(i0, i1, step):
            r1 = min(r0 + step, i1)
            rows = torch.arange(r0, r1)
            s2 = contract.visible_blocks(rows, qb, kb, params.causal)
            budget = contract.row_budget(rows + (kb - qb), p_all[b], ks_all[b], params.alpha)
            out, length = _select_rows(qflat[b, :, r0:r1], kflat[b], vbias[b], s2, budget,
                                       scale, params)
            if out is not None:
                indices[b, :, r0:r1, :out.shape[-1]] = out
                seq_len[b, :, r0:r1] = length
    return indices, seq_len


def _select_rows(q, kflat_b, vbias_b, s2, budget, scale, params):
    """Selections of consecutive query blocks of one batch, all heads.

    q: (Nq, c, Df); s2, budget: (c,) host int64. Returns the rows' leading
    ``width`` output columns (Nq, c, width) int32 and their lengths (c,)
    int32, or ``(None, None)`` when every row is empty.
    """
    device = q.device
    nq, c, df = q.shape
    nk, kmax = kflat_b.shape[0], kflat_b.shape[1]
    sink_end, cand_end = contract.candidate_range(s2, params.initial_blocks, params.window_size)
    take = torch.minimum(budget, cand_end - sink_end)  # picks per row
    length = s2 - (cand_end - sink_end) + take  # forced + picks
    width = int(length.max())
    if width == 0:
        return None, None
    take_max = int(take.max())
    if take_max > 0:  # score only the key blocks some row can pick
        picking = take > 0
        lo, hi = int(sink_end[picking].min()), int(cand_end[picking].max())
    sink_end, cand_end, take, length = (t.to(device) for t in (sink_end, cand_end, take, length))

    pos = torch.arange(width, device=device)
    # Forced part of each row: sink [0, sink_end), window from cand_end on.
    after_picks = pos - sink_end[:, None] - take[:, None]
    out = torch.where(pos < sink_end[:, None], pos, cand_end[:, None] + after_picks)
    out = out.expand(nq, c, width)
    if take_max > 0:
        top = _tile_top_keys(q.reshape(nk, (nq // nk) * c, df), kflat_b, vbias_b, lo, hi,
                             sink_end, cand_end, take_max, scale, params.topk_score_precision)
        picks = contract.block_of_key(top).view(nq, c, take_max)
        ranked_out = torch.arange(take_max, device=device) >= take[:, None]
        picks = picks.masked_fill(ranked_out, kmax).sort(dim=-1).values
        slot = (pos - sink_end[:, None]).clamp(0, take_max - 1).expand(nq, c, width)
        is_pick = (pos >= sink_end[:, None]) & (after_picks < 0)
        out = torch.where(is_pick, picks.gather(-1, slot), out)
    out = torch.where(pos < length[:, None], out, -1)
    return out.to(torch.int32), length.to(torch.int32)
