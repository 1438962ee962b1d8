"""A second scoring pass over Stem's candidates: the probe.

Stem's indexer scores a (query block, key block) pair from strided sums of
queries and keys: a mean over sampled token pairs. Attention's weight is
dominated by the largest logits, which a mean can hide. The probe ranks the
indexer's candidates again by what attention itself gives them:

1. the indexer runs with a wider budget (``candidates`` times the budget's
   ``Ks``: ``probe_params``), so that each row lists more candidates than
   it will keep;
2. the last ``queries`` queries of each query block attend, exactly and
   causally, to every key the block can see; each key block's *mass* is the
   attention probability its keys get, summed over those queries;
3. each row keeps its forced blocks (sink and window, as the contract's)
   and, of the listed candidates, the ``min(K, candidates)`` with the most
   mass, ``K`` the row's budget under the caller's parameters (equal masses
   to the lower block index).

A row keeps as many blocks as without the probe; only which ones changes.
Rows listing no more candidates than they keep are left as they are. The
pass costs, per sparse query block, ``queries`` query rows of dense
attention's logits (``queries / stem_block_size`` of a dense row's QK
products, and as many exponentials).

``probe_refine`` works on one sequence (one engine row) and needs its keys
contiguous; the paged entry point gathers them (``paged.py``), the vLLM
backend reads them back from its cache (``kv_read.PageReader``).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..operator import contract
from ..operator.contract import IndexerParams, ceil_div, fail

__all__ = ["probe_params", "check_probe", "probe_refine", "row_keep", "check_miss",
           "selection_miss", "MISS_CHECK_QUERIES", "MISS_CHECK_BLOCKS"]

#: float32 elements of one tile's probabilities (about 32 MB)
TILE_ELEMENTS = 1 << 23
#: the miss check's sample by default: the last 16 queries of one query block
MISS_CHECK_QUERIES, MISS_CHECK_BLOCKS = 16, 1


def check_probe(who: str, queries, candidates) -> None:
    """``queries`` an int >= 0 (0: off); ``candidates`` a finite number >= 1."""
    if isinstance(queries, bool) or not isinstance(queries, int) or queries < 0:
        fail(who, "probe_queries", "must be an int >= 0 (0: no probe)", repr(queries))
    if (isinstance(candidates, bool) or not isinstance(candidates, (int, float))
            or not math.isfinite(candidates) or candidates < 1):
        fail(who, "probe_candidates", "must be a finite number >= 1 (the indexer's budget "
             "is this many times the kept one)", repr(candidates))


def check_miss(who: str, miss, queries, blocks, first=0) -> None:
    """``miss`` a number in [0, 1) (0: off); ``queries`` and ``blocks`` ints >=
    1; ``first`` (``miss_check_from``) an int >= 0."""
    if (isinstance(miss, bool) or not isinstance(miss, (int, float))
            or not contract.is_finite(miss) or not 0 <= miss < 1):
        fail(who, "miss_check", "must be a number with 0 <= miss_check < 1 (0: off)", repr(miss))
    for name, value in (("miss_check_queries", queries), ("miss_check_blocks", blocks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail(who, name, "must be an int >= 1", repr(value))
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        fail(who, "miss_check_from", "must be an int >= 0 (a token position)", repr(first))


def probe_params(params: IndexerParams, candidates: float) -> IndexerParams:
    """The indexer's parameters for the candidates: the budget's rates and
    biases times ``candidates`` (biases rounded up), the rest unchanged."""
    return dataclasses.replace(
        params,
        k_block_num_rate_medium=params.k_block_num_rate_medium * candidates,
        k_block_num_bias_medium=math.ceil(params.k_block_num_bias_medium * candidates),
        k_block_num_rate_large=params.k_block_num_rate_large * candidates,
        k_block_num_bias_large=math.ceil(params.k_block_num_bias_large * candidates))


def row_keep(blocks: torch.Tensor, prompt: int, params: IndexerParams):
    """For absolute query blocks ``blocks`` (int64, causal, a sequence's own
    positions): ``(sink_end, cand_end, keep)``, the forced blocks being
    ``[0, sink_end)`` and ``[cand_end, blocks + 1)``, and ``keep`` the
    candidates a row keeps under ``params``' budget."""
    s2 = blocks + 1
    sink_end, cand_end = contract.candidate_range(s2, params.initial_blocks,
                                                  params.window_size)
    p = torch.tensor(ceil_div(prompt, params.stem_block_size), dtype=torch.int64)
    k = contract.row_budget(blocks, p, contract.prompt_budget(p, params), params.alpha)
    keep = torch.minimum(k, (cand_end - sink_end).clamp(min=0))
    return sink_end, cand_end, keep


def probe_refine(query: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor,
                 lengths: torch.Tensor, *, context: int, seq_len: int, prompt: int,
                 params: IndexerParams, scale: float, queries: int,
                 softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's lists re-ranked by the probe (the module docstring).

    ``query [q_len, Hq, D]``: the row's queries, at positions ``[context,
    seq_len)``; ``keys [>= seq_len, Hkv, D]``: its keys in token order;
    ``idx [Hq, Qb, W]`` and ``lengths [Hq, Qb]``: the indexer's lists (from
    ``probe_params``) over absolute query blocks ``context // Bs ..``, before
    any exact-tail widening; ``params``: the budget the rows keep; ``scale``
    and ``softcap``: attention's. Returns new ``(idx, lengths)`` of the same
    shapes and dtypes.
    """
    hq, qb, width = idx.shape
    hkv, dim = keys.shape[1], keys.shape[2]
    bs = params.stem_block_size
    first = context // bs
    blocks = torch.arange(first, first + qb, dtype=torch.int64)
    sink_end, cand_end, keep = row_keep(blocks, prompt, params)
    forced = sink_end + (blocks + 1 - cand_end)
    refine = lengths.to(torch.int64).cpu() > (forced + keep)[None, :]  # [Hq, Qb]
    rows = refine.any(0).nonzero().flatten()
    if rows.numel() == 0:
        return idx, lengths
    idx, lengths = idx.clone(), lengths.clone()
    device = query.device
    # [Hkv, D, Kb * Bs]: the keys once, zeros past the sequence
    span = ceil_div(seq_len, bs) * bs
    keys_t = keys.new_zeros(hkv, dim, span)
    keys_t[..., :seq_len] = keys[:seq_len].permute(1, 2, 0)
    ends = torch.clamp((blocks + 1) * bs, max=seq_len)
    starts = torch.clamp(blocks * bs, min=context)
    at = 0
    while at < rows.numel():
        reach = int(ends[rows[at]])
        tile = max(1, TILE_ELEMENTS // (hq * queries * reach))
        part = rows[at:at + tile]
        at += part.numel()
        nb = int(blocks[part[-1]]) + 1  # key blocks the tile's last row sees
        mass = _block_mass(query, keys_t, ends[part], starts[part], context, nb, bs,
                           queries, scale, softcap)  # [Hq, T, nb]
        sub = idx[:, part].to(torch.int64)
        listed = torch.zeros(hq, part.numel(), nb + 1, dtype=torch.bool, device=device)
        listed.scatter_(-1, torch.where(sub < 0, nb, sub.clamp(max=nb)), True)
        listed = listed[..., :nb]
        j = torch.arange(nb, device=device)
        lo, hi = sink_end[part].to(device)[:, None], cand_end[part].to(device)[:, None]
        cand = listed & (j >= lo) & (j < hi)
        score = torch.where(cand, mass, -math.inf)
        order = score.argsort(dim=-1, descending=True, stable=True)
        top = torch.arange(nb, device=device) < keep[part].to(device)[:, None]
        chosen = torch.zeros_like(cand).scatter_(-1, order, top.expand_as(order)) & cand
        sees = j <= blocks[part].to(device)[:, None]
        kept = torch.where(refine[:, part].to(device)[..., None],
                           ((j < lo) | (j >= hi)) & sees | chosen, listed)
        ranked = torch.where(kept, j, nb).sort(-1).values[..., :width]
        ranked = torch.where(ranked == nb, -1, ranked)
        out = torch.full((hq, part.numel(), width), -1, dtype=idx.dtype, device=device)
        out[..., :ranked.shape[-1]] = ranked.to(idx.dtype)
        idx[:, part] = out
        lengths[:, part] = kept.sum(-1).to(lengths.dtype)
    return idx, lengths


def _block_mass(query, keys_t, ends, starts, context: int, nb: int, bs: int,
                queries: int, scale: float, softcap) -> torch.Tensor:
    """[Hq, T, nb] float32: per query head and query block (its queries end
    at ``ends``, none before ``starts``), the attention probability each of
    key blocks ``0 .. nb-1`` gets from the block's last ``queries`` queries,
    summed over them (each query's softmax over every key it can see).
    ``keys_t [Hkv, D, S]``: the keys, transposed (a view will do), ``S`` at
    least the last query's position + 1."""
    hkv, dim = keys_t.shape[0], keys_t.shape[1]
    hq = query.shape[1]
    group, t = hq // hkv, ends.shape[0]
    device = query.device
    pos = ends[:, None] + torch.arange(queries) - queries  # [T, m]
    valid = (pos >= starts[:, None]).flatten().to(device)
    pos = pos.flatten().to(device)
    qp = query[(pos - context).clamp(min=0)]  # [T*m, Hq, D]
    qp = qp.view(-1, hkv, group, dim).permute(1, 2, 0, 3).reshape(hkv, -1, dim)
    span = nb * bs
    # [Hkv, G*T*m, <= span]: keys as the left operand, so that a transposed
    # view of the cache's keys is read in place (not copied first)
    logits = torch.matmul(keys_t[..., :span].transpose(1, 2), qp.transpose(1, 2)).transpose(
        1, 2).to(torch.float32, memory_format=torch.contiguous_format)
    if logits.shape[-1] < span:  # keys_t ends with the sequence: the rest is masked
        logits = torch.nn.functional.pad(logits, (0, span - logits.shape[-1]),
                                         value=-math.inf)
    logits = logits.view(hkv, group, t * queries, span)
    if softcap:
        logits = torch.tanh(logits * (scale / softcap)) * softcap
    else:
        logits *= scale
    # Only keys from the tile's first diagonal block on can lie past a query.
    lo = int(starts.min()) // bs * bs
    later = torch.arange(lo, span, device=device)[None, :] > pos[:, None]
    logits[..., lo:].masked_fill_(later, -math.inf)
    top = logits.amax(-1, keepdim=True)
    logits.sub_(top).exp_()
    total = logits.sum(-1)  # [Hkv, G, T*m]
    mass = logits.view(hkv, group, t * queries, nb, bs).sum(-1)
    mass *= (valid / total)[..., None]
    return mass.view(hq, t, queries, nb).sum(2)


def selection_miss(query: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor,
                   lengths: torch.Tensor, *, context: int, seq_len: int, block_size: int,
                   queries: int, blocks: int, scale: float,
                   softcap: float | None = None) -> tuple[float, int, float]:
    """How much attention one sequence's lists miss, from a sample of exact
    attention: ``(miss, sampled query blocks, dropped)``.

    Of the query blocks whose lists leave out a block they can see, up to
    ``blocks`` evenly spaced ones (the last among them) are sampled. Their
    last ``queries`` queries attend exactly and causally to every key they
    can see; per query head, a key block's mass is the attention it gets,
    averaged over those queries. ``miss`` is, averaged over the sampled
    (query block, query head) pairs, the mass of as many heaviest blocks as
    the list holds less the mass of the listed blocks: 0 where the lists are
    the best of their size for the sample, up to 1. ``dropped`` is the share
    of the blocks they can see that the sampled lists leave out, averaged
    alike (a list that drops little cannot miss much). ``(0.0, 0, 0.0)``
    where every list holds every block it can see.

    The arguments are ``probe_refine``'s: ``query [q_len, Hq, D]`` at
    positions ``[context, seq_len)``, ``keys [>= seq_len, Hkv, D]`` in token
    order, ``idx [Hq, Qb, W]`` and ``lengths [Hq, Qb]`` over the absolute
    query blocks ``context // block_size ..``.
    """
    hq, qb, _ = idx.shape
    bs = block_size
    first = context // bs
    absolute = torch.arange(first, first + qb, dtype=torch.int64)
    lens = lengths.to(torch.int64).cpu()
    partial = (lens < (absolute + 1)[None, :]).any(0).nonzero().flatten()
    if partial.numel() == 0:
        return 0.0, 0, 0.0
    at = torch.linspace(partial.numel() - 1, 0, min(blocks, partial.numel())).round().long()
    sampled = partial[at.unique()].tolist()
    keys_t = keys[:seq_len].permute(1, 2, 0)  # a view: _block_mass reads it in place
    device = query.device
    total = dropped = 0.0
    for r in sampled:
        a = int(absolute[r])
        end, start = min((a + 1) * bs, seq_len), max(a * bs, context)
        mass = _block_mass(query, keys_t, torch.tensor([end]), torch.tensor([start]), context,
                           a + 1, bs, queries, scale, softcap)[:, 0].double()  # [Hq, a + 1]
        mass /= mass.sum(-1, keepdim=True)
        n = lens[:, r].to(device)
        sub = idx[:, r].to(device=device, dtype=torch.int64)
        listed = torch.zeros(hq, a + 2, dtype=torch.bool, device=device)
        listed.scatter_(-1, torch.where(sub < 0, a + 1, sub.clamp(max=a + 1)), True)
        kept = (mass * listed[:, :a + 1]).sum(-1)
        ranked = mass.sort(-1, descending=True).values.cumsum(-1)
        best = torch.where(n > 0, ranked.gather(-1, (n - 1).clamp(min=0)[:, None])[:, 0], 0.0)
        total += float((best - kept).clamp(min=0).sum())
        dropped += float((1 - n.double() / (a + 1)).sum())
    return total / (len(sampled) * hq), len(sampled), dropped / (len(sampled) * hq)
