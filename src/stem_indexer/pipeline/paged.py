"""Stem attention on an engine's paged KV cache: plan once per step, run per layer.

A serving engine's attention backend (vLLM's, SGLang's, any other) holds a
step as *rows*: row ``b`` has ``query_lens[b]`` new query tokens, packed in
one ``query [T, Hq, D]``, at absolute positions ``[context, seq_lens[b])``,
and its keys and values are already in the paged KV cache, found through the
row's block table. This module is the entry point such a backend calls:

    plan = stem_paged_plan(query_lens, seq_lens, num_prompt_tokens=prompts,
                           num_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                           device="cuda", dtype=torch.bfloat16)      # once per step
    out = stem_paged_run(query, key_cache, value_cache, index_cache,
                         block_table, plan)                           # per layer

* ``key_cache``, ``value_cache`` [num_pages, page, Hkv, D]: any strides, so
  vLLM's and FlashAttention's NHD cache and FlashInfer's HND one (viewed as
  ``cache.transpose(1, 2)``) are taken as they are;
* ``index_cache``: the layer's ``IndexCache`` (``index_cache.py``), written
  beside the KV cache by the engine's cache writer (``IndexCache.write``, from
  the same keys, values and slots); the indexer reads the keys' statistics
  there and never the keys themselves;
* ``block_table`` [B, W] int: row ``b``'s pages in token order.

A row computes what a one-shot prefill of its prompt computes for its
tokens (docs/CONTRACT.md section 8, as the vLLM CPU backend's rows do):
query block ``i`` is the absolute positions ``[i*Bs, (i+1)*Bs)``; the
indexer runs on the block-aligned window ``[Bs * (context // Bs), seq_len)``
(earlier queries of the first block as zeros) over all ``seq_len`` keys,
with the budget of the request's prompt (``num_prompt_tokens``; a row past
its prompt budgets on its own length). The plan decides per row, on the
host: a row with fewer than ``min_q_blocks`` query blocks (decode), one
whose budget keeps every block, or one keeping more than ``dense_above`` of
its pairs attends every block it can see (a *dense* row: its lists are made
in the plan, and the indexer skips it); the rows holding the prompt's last
``exact_tail`` tokens are widened alike. The others are *sparse*.

Which rows to pass: the plan's tensors are padded to the longest row, as
the indexer's contract pads its batch (the lists are ``B x Hq x Qmax x
Kmax`` int32), so a step's many decode rows beside one long prompt belong to
the engine's own kernel, not here; pass the long prefill rows (the vLLM CPU
backend sends each Stem row alone and the others to vLLM's kernel).

The run is two custom ops joined by integer tensor work, reading nothing on
the host (so a CUDA graph can capture it; ``torch.compile(fullgraph=True,
dynamic=True)`` gives eager's result):

* ``stem_indexer::paged_select``: qflat from the packed queries, kflat and
  vbias from the indexer cache through the table, then the indexer (on the
  plan's lengths and metadata);
* the lists of the plan's dense and tail rows written in (``apply_tail``);
* ``stem_indexer::paged_attention``: block-sparse attention reading K and V
  from the pages through the table.

Kernels (``backend``): ``"triton"`` (the default on CUDA) runs
``ops/triton/paged_index.py``'s pass for kflat, the indexer's Triton kernels
and ``ops/triton/paged_attention.py``'s attention, all reading pages through
the table; ``"torch"`` (the default on CPU) gathers the pages with torch
operations and runs the contiguous path's kernels (``IndexCache.block_inputs``,
the indexer op, ``block_sparse_attention``'s kernel for the device). Both
pick the same blocks: kflat, qflat and vbias are the same bits and the
indexer's kernels agree exactly (docs/CONTRACT.md section 5).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..operator import contract
from ..operator.api import stem_indexer_metadata
from .checks import check_call_options, check_triton_device
from ..operator.contract import (BUDGET_FIELDS, DEFAULT_EXACT_TAIL, IndexerParams, ceil_div,
                                 check_int, fail)
from .dispatch import (TailRows, _backend_for, _Call, _dense_lists, _run, apply_tail,
                       dense_reason, tail_plan)
from .index_cache import IndexCache, page_ids
from .plan import PlanSettings
from .probe import check_probe, probe_params, probe_refine
from .prepare import DEFAULT_OAM_LAMBDA, Lengths, check_lens_values, lens_argument, represent

__all__ = ["PagedPlan", "stem_paged_plan", "stem_paged_run", "stem_paged_select",
           "stem_paged_valid"]

BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True, eq=False)
class PagedPlan(PlanSettings):
    """What ``stem_paged_run`` needs for one step, every host value decided.
    Tensors live on the plan's device unless named host."""

    page_size: int
    tokens: int  #: T, the packed queries
    kernel: str  #: "triton" or "torch"
    attention: str  #: the attention kernel: "triton", or the torch path's ("native", ...)
    #: per row: "sparse", or "dense: <reason>" (host)
    paths: tuple[str, ...]
    #: host int64 [B]: query tokens, keys, and the block-aligned windows' queries
    query_lens: torch.Tensor
    seq_lens: torch.Tensor
    window_lens: torch.Tensor
    qmax: int  #: query blocks of the longest window
    kmax: int  #: key blocks of the longest row
    pages: int  #: pages of the longest row (the table's least width)
    rows: torch.Tensor  #: [B, 4] int32 (q_start, context, seq_len, first block)
    q_map: torch.Tensor  #: [B, qmax * Bs] int64: each window position's token, T if none
    out_map: torch.Tensor  #: [T] int64: each token's flat window position
    kv_seq_lens: torch.Tensor  #: [B] int32
    window_lens_device: torch.Tensor  #: [B] int32, ``window_lens`` on the device
    #: the indexer's (None when no row is sparse): its window lengths (0 on
    #: dense rows), prompt lengths, metadata
    indexer_q_lens: torch.Tensor | None = None
    prompt: torch.Tensor | None = None
    metadata: torch.Tensor | None = None
    tail: tuple[TailRows, ...] = ()  #: dense rows and exact-tail rows, widened
    lists: tuple[torch.Tensor, torch.Tensor] | None = None  #: every row dense
    #: [B] int64: with ``chunk_invariant``, the runs of ``stem_stride`` tokens
    #: the OAM's statistic is taken over (None: every run present)
    oam_runs: torch.Tensor | None = None
    #: the probe (``probe.py``): the queries per query block (0: off), and
    #: the indexer's budget as a multiple of the kept one
    probe_queries: int = 0
    probe_candidates: float = 2.0

    @property
    def batch(self) -> int:
        return self.query_lens.shape[0]

    def every_block(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Lists in which every query block of every row holds every key
        block it can see (``stem_paged_select``'s shapes and dtypes): what a
        dense row lists, for a caller that widens sparse rows whole (the
        vLLM backend's ``miss_check``). No indexer."""
        idx, lengths = _dense_lists(self.window_lens, self.seq_lens, self.params.stem_block_size,
                                    True, self.num_heads, self.qmax, self.kmax,
                                    self.q_map.device)
        return idx.to(torch.int32), lengths.to(torch.int32)

    @property
    def indexer_params(self) -> IndexerParams:
        """The indexer's parameters: the budget's, widened for the probe's
        candidates where it runs."""
        if not self.probe_queries:
            return self.params
        return probe_params(self.params, self.probe_candidates)

    def with_budget(self, params: IndexerParams) -> "PagedPlan":
        """This plan with the budget of ``params``, which may differ from the
        plan's own in ``BUDGET_FIELDS`` only (an engine's per-layer budgets:
        the rows' paths, tails and metadata stay the plan's)."""
        if params == self.params:
            return self
        for field in dataclasses.fields(IndexerParams):
            if field.name not in BUDGET_FIELDS and (getattr(params, field.name)
                                                    != getattr(self.params, field.name)):
                fail("PagedPlan.with_budget", f"params.{field.name}", "must be the plan's "
                     f"({getattr(self.params, field.name)}): only the budget's parameters "
                     f"({', '.join(BUDGET_FIELDS)}) may differ", getattr(params, field.name))
        oam_runs = self.oam_runs
        if oam_runs is not None:  # chunk_invariant: the statistic's window is the budget's
            oam_runs = _oam_runs(self.prompt.cpu().to(torch.int64), params, oam_runs.device)
        return dataclasses.replace(self, params=params, oam_runs=oam_runs)


def stem_paged_plan(
    query_lens: Lengths, seq_lens: Lengths, *, num_heads: int, num_kv_heads: int,
    head_dim: int, page_size: int, device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16, num_prompt_tokens: Lengths = None,
    scale: float | None = None, softcap: float | None = None, preset: str = "default",
    oam: bool = True, oam_lambda: float = DEFAULT_OAM_LAMBDA,
    indexer_scale: float | None = None, min_q_blocks: int = 2,
    dense_above: float | None = None, exact_tail: int = DEFAULT_EXACT_TAIL,
    backend: str = "auto", chunk_invariant: bool = False, probe_queries: int = 0,
    probe_candidates: float = 2.0, **indexer_params,
) -> PagedPlan:
    """All host work of one engine step for ``stem_paged_run``.

    Args:
        query_lens: new query tokens per row (host ints or a tensor, read once).
        seq_lens: keys per row, the new tokens included (their K and V are in
            the cache when the run reads it).
        num_heads, num_kv_heads, head_dim: the layer's; ``page_size`` the KV
            cache's tokens per page (a multiple of ``stem_stride`` dividing
            ``stem_block_size``).
        device, dtype: those of the queries and the KV cache.
        num_prompt_tokens: each request's prompt length, for the budget
            (default ``seq_lens``); a row past it budgets on ``seq_lens``.
        backend: ``"auto"`` (``"triton"`` on CUDA where Triton is installed,
            else ``"torch"``), ``"triton"`` or ``"torch"``.
        chunk_invariant: pick, for every query block, what a one-shot
            prefill of the prompt picks with this option, wherever the
            engine cuts the prompt into chunks: a query block a row's start
            or end cuts (some of its queries in another chunk) lists every
            block it can see, and the Output-Aware Metric standardises over
            the prompt's first ``W`` blocks, ``W = min(Ks, 256)`` (the
            budget's ``Ks``: every row before block ``W`` keeps every block,
            so its statistic never matters, and every row from ``W`` on has
            those blocks' keys at hand).
        probe_queries, probe_candidates: the probe (``probe.py``): the
            indexer lists ``probe_candidates`` times the budget's blocks and
            the last ``probe_queries`` queries of each query block rank
            them by their exact attention mass; each row keeps as many
            blocks as the budget says (0: no probe). The run then reads the
            keys of every sparse row and the rows' lengths on the host.
        The rest: ``stem_attention``'s keywords (always causal).
    """
    who = "stem_paged_plan"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    qlen = lens_argument(query_lens, _rows(query_lens), 2**31 - 1, "query_lens", who)
    batch = qlen.shape[0]
    kvlen = lens_argument(seq_lens, batch, 2**31 - 1, "seq_lens", who).cpu()
    kvlen = check_lens_values(kvlen, 2**31 - 1, "seq_lens", who)
    qlen = qlen.cpu()
    for b in range(batch):
        if not 0 <= int(qlen[b]) <= int(kvlen[b]):
            fail(who, f"query_lens[{b}]", f"must be in [0, seq_lens[{b}]] ({int(kvlen[b])})",
                 int(qlen[b]))
    prompt = kvlen
    if num_prompt_tokens is not None:
        prompt = lens_argument(num_prompt_tokens, batch, 2**31 - 1, "num_prompt_tokens", who)
        prompt = torch.maximum(check_lens_values(prompt.cpu(), 2**31 - 1,
                                                 "num_prompt_tokens", who), kvlen)
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("page_size", page_size)):
        check_int(who, name, value, 1)
    if num_heads % num_kv_heads:
        fail(who, "num_heads", f"must be a multiple of num_kv_heads ({num_kv_heads})",
             num_heads)
    if backend not in BACKENDS:
        fail(who, "backend", f"must be one of {', '.join(map(repr, BACKENDS))}", repr(backend))
    if not isinstance(chunk_invariant, bool):
        fail(who, "chunk_invariant", "must be a bool", repr(chunk_invariant))
    check_probe(who, probe_queries, probe_candidates)
    params, indexer_scale, scale, softcap, dense_above = check_call_options(
        who, device, dtype, head_dim, scale=scale, softcap=softcap, dense_above=dense_above,
        causal=True, preset=preset, oam=oam, oam_lambda=oam_lambda,
        indexer_scale=indexer_scale, min_q_blocks=min_q_blocks, exact_tail=exact_tail,
        **indexer_params)
    bs, stride = params.stem_block_size, params.stem_stride
    if page_size % stride or bs % page_size:
        fail(who, "page_size", f"must be a multiple of stem_stride ({stride}) dividing "
             f"stem_block_size ({bs})", page_size)
    kernel, attention = _kernels(backend, device, dtype, bs, head_dim)
    return _build(qlen, kvlen, prompt, params, device=device, dtype=dtype, heads=num_heads,
                  kv_heads=num_kv_heads, head_dim=head_dim, page=page_size, scale=scale,
                  softcap=softcap, indexer_scale=scale / stride if indexer_scale is None
                  else indexer_scale, oam=oam, oam_lambda=float(oam_lambda),
                  min_q_blocks=min_q_blocks, dense_above=float(dense_above),
                  exact_tail=exact_tail, kernel=kernel, attention=attention,
                  chunk_invariant=chunk_invariant, probe_queries=probe_queries,
                  probe_candidates=float(probe_candidates))


def _rows(query_lens: Lengths) -> int:
    if isinstance(query_lens, torch.Tensor) and query_lens.dim() == 1:
        n = query_lens.shape[0]
    else:
        try:
            n = len(query_lens)
        except TypeError:
            fail("stem_paged_plan", "query_lens", "must be a 1-D integer tensor or a sequence "
                 "of ints (one per row)", type(query_lens).__name__)
    if n == 0:
        fail("stem_paged_plan", "query_lens", "must hold one length per row, at least one", "[]")
    return n


def _kernels(backend: str, device: torch.device, dtype: torch.dtype, block_size: int,
             head_dim: int) -> tuple[str, str]:
    """(indexer side, attention kernel) for ``backend``; a fallback is reported."""
    from ..operator.ops.library import _triton_available

    if backend == "auto":
        backend = "triton" if device.type == "cuda" and _triton_available() else "torch"
        if device.type == "cuda" and backend == "torch":
            from ..operator.ops import native
            native.report_once("paged cuda", "the paged entry point runs torch operations on "
                               "CUDA (Triton is not installed): same picks, slower")
    if backend == "torch":
        return "torch", _backend_for("auto", device, dtype)
    check_triton_device("stem_paged_plan", device)
    from ..operator.ops.triton import paged_attention

    why = paged_attention.paged_kernel_supports(block_size, head_dim)
    if why is None and dtype not in paged_attention.DTYPES:
        why = f"it takes bfloat16, float16 and float32, not {str(dtype).removeprefix('torch.')}"
    if why is None:
        return "triton", "triton"
    from ..operator.ops import native
    native.report_once(f"paged attention {block_size} {head_dim}", "paged block-sparse "
                       f"attention gathers the pages with torch operations ({why}): slower")
    return "triton", _backend_for("auto", device, dtype)


def _row_path(kv: int, p: int, window: int, params: IndexerParams,
              min_q_blocks: int, dense_above: float) -> str:
    """"sparse", or "dense: <reason>" (``dispatch.dense_reason``), for one row."""
    lens = [torch.tensor([x], dtype=torch.int64) for x in (window, kv, p)]
    reason = dense_reason(*lens, params, min_q_blocks, dense_above)
    return f"dense: {reason}" if reason else "sparse"


def _build(qlen, kvlen, prompt, params: IndexerParams, *, device, dtype, heads, kv_heads,
           head_dim, page, scale, softcap, indexer_scale, oam, oam_lambda, min_q_blocks,
           dense_above, exact_tail, kernel, attention, chunk_invariant=False,
           probe_queries=0, probe_candidates=2.0) -> PagedPlan:
    """The plan of checked arguments (host int64 lengths)."""
    bs, batch = params.stem_block_size, qlen.shape[0]
    context = kvlen - qlen
    first = context // bs
    window = kvlen - first * bs
    window[qlen == 0] = 0  # a row without queries has no window
    qmax = max(int(ceil_div(window, bs).max()), 1)
    kmax = max(int(ceil_div(kvlen, bs).max()), 1)
    paths = tuple("dense: no queries" if int(q) == 0 else
                  _row_path(int(kv), int(p), int(w), params, min_q_blocks, dense_above)
                  for q, kv, p, w in zip(qlen, kvlen, prompt, window))
    sparse = torch.tensor([p == "sparse" for p in paths])
    starts = torch.cumsum(qlen, 0) - qlen
    tokens = int(qlen.sum())
    i32 = dict(device=device, dtype=torch.int32)
    pos = torch.arange(qmax * bs)[None, :] + first[:, None] * bs  # absolute positions
    inside = (pos >= context[:, None]) & (pos < kvlen[:, None])
    q_map = torch.where(inside, starts[:, None] + pos - context[:, None], tokens)
    out_map = (torch.arange(batch)[:, None] * (qmax * bs) + pos - first[:, None] * bs)[inside]
    # Dense rows list every block they can see; so do the prompt's last tokens.
    widened = [TailRows(b, range(0, ceil_div(int(window[b]), bs)),
                        contract.reach_blocks(torch.arange(ceil_div(int(window[b]), bs)),
                                              window[b], kvlen[b], bs, True))
               for b in range(batch) if not sparse[b] and int(window[b]) > 0]
    indexer_q = torch.where(sparse, window, 0)
    widened += [t for t in tail_plan(indexer_q, kvlen, prompt, exact_tail, bs, True)]
    oam_runs = None
    if chunk_invariant:
        widened += _cut_blocks(sparse, context, kvlen, window, prompt, bs)
        oam_runs = _oam_runs(prompt, params, device)
    tail = tuple(TailRows(t.batch, t.rows, t.reach.to(device)) for t in widened)
    common = dict(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page,
        tokens=tokens, device=device, dtype=dtype, params=params, scale=scale,
        softcap=softcap, indexer_scale=indexer_scale, oam=oam, oam_lambda=oam_lambda,
        kernel=kernel, attention=attention, paths=paths, query_lens=qlen, seq_lens=kvlen,
        window_lens=window, qmax=qmax, kmax=kmax, pages=int(ceil_div(kvlen, page).max()),
        rows=torch.stack([starts, context, kvlen, first], 1).to(**i32),
        q_map=q_map.to(device), out_map=out_map.to(device), kv_seq_lens=kvlen.to(**i32),
        window_lens_device=window.to(**i32), probe_queries=probe_queries,
        probe_candidates=probe_candidates)
    if not bool(sparse.any()):
        empty = torch.full((batch, heads, qmax, 0), -1, **i32)
        lists = apply_tail(empty, torch.zeros(batch, heads, qmax, **i32), tail, kmax)
        return PagedPlan(**common, lists=lists)
    metadata = stem_indexer_metadata(
        indexer_q.to(**i32), common["kv_seq_lens"], heads, kv_heads, causal=True,
        stem_block_size=bs, dim_qkflat=params.stem_stride * head_dim,
        window_size=params.window_size)
    return PagedPlan(**common, indexer_q_lens=indexer_q.to(**i32), prompt=prompt.to(**i32),
                     metadata=metadata, tail=tail, oam_runs=oam_runs)


def _oam_runs(prompt: torch.Tensor, params: IndexerParams, device) -> torch.Tensor:
    """``chunk_invariant``: the runs the OAM's statistic is taken over, per
    row, from its prompt's budget (host int64 ``prompt`` tokens)."""
    bs = params.stem_block_size
    budget = contract.prompt_budget(ceil_div(prompt, bs), params).clamp(max=256)
    return (budget * (bs // params.stem_stride)).to(device)


def _cut_blocks(sparse, context, kvlen, window, prompt, bs: int) -> list[TailRows]:
    """The query blocks of sparse rows that a chunk boundary cuts: the first
    when the row starts inside a block, the last when it ends inside one and
    the prompt goes on. Each lists every block it can see."""
    cut = []
    for b in sparse.nonzero().flatten().tolist():
        blocks = ceil_div(int(window[b]), bs)
        rows = set()
        if int(context[b]) % bs:
            rows.add(0)
        if int(kvlen[b]) % bs and int(kvlen[b]) < int(prompt[b]):
            rows.add(blocks - 1)
        for j in sorted(rows):
            cut.append(TailRows(b, range(j, j + 1), contract.reach_blocks(
                torch.tensor([j]), window[b], kvlen[b], bs, True)))
    return cut


def stem_paged_run(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   index_cache: IndexCache, block_table: torch.Tensor,
                   plan: PagedPlan, *, page_tags: torch.Tensor | None = None) -> torch.Tensor:
    """Stem attention of one layer for the step ``plan`` was made for:
    ``out [T, Hq, D]`` in the query's dtype. ``query [T, Hq, D]`` the rows'
    new queries, packed; ``key_cache``, ``value_cache`` [num_pages, page,
    Hkv, D] (any strides) hold every row's keys and values, the new ones
    included; ``index_cache`` the layer's indexer cache, written from the
    same keys and values; ``block_table [B, W]`` the rows' pages. Tensor work
    and kernels only.

    A row whose pages the indexer cache does not hold exactly (``stem_paged_valid``:
    each page's token count and, with ``page_tags [B, W]`` int64, the tag its
    last token left, ``IndexCache.write``'s ``tags``) attends every block it
    can see instead, decided on the device: no host read."""
    _check_run(query, key_cache, value_cache, index_cache, block_table, plan)
    idx, lengths = _select(query, index_cache, block_table, plan, page_tags, key_cache)
    p = plan.params
    return torch.ops.stem_indexer.paged_attention(
        query, key_cache, value_cache, block_table, idx, lengths, plan.rows, plan.q_map,
        plan.out_map, plan.window_lens, plan.seq_lens, plan.window_lens_device, plan.kv_seq_lens,
        p.stem_block_size, plan.scale, plan.softcap, plan.attention)


def stem_paged_select(query: torch.Tensor, index_cache: IndexCache, block_table: torch.Tensor,
                      plan: PagedPlan, *, page_tags: torch.Tensor | None = None,
                      key_cache: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The key blocks ``stem_paged_run`` attends, for an engine that runs
    its own block-sparse kernel: ``(indices [B, Hq, qmax, kmax] int32,
    lengths [B, Hq, qmax] int32)``. Row ``b``'s query block ``i`` is the
    absolute block ``rows[b, 3] + i`` (``plan.rows``: its window starts
    there); its first ``lengths`` entries are absolute key blocks,
    ascending, then -1. Dense and tail rows, and rows whose pages the
    indexer cache does not hold exactly, list every block they can see.
    ``key_cache`` (as ``stem_paged_run``'s) is needed where the plan runs
    the probe."""
    _check_run(query, None, None, index_cache, block_table, plan)
    if key_cache is not None:
        _check_keys("stem_paged_select", key_cache, plan)
    return _select(query, index_cache, block_table, plan, page_tags, key_cache)


def stem_paged_valid(index_cache: IndexCache, block_table: torch.Tensor, plan: PagedPlan,
                     page_tags: torch.Tensor | None = None) -> torch.Tensor:
    """[B] bool on the plan's device: whether the indexer cache holds exactly
    each row's ``seq_lens[b]`` tokens on its pages (``block_table``): every
    page's count, and with ``page_tags [B, >= pages]`` int64 the tag of each
    page's last token (``IndexCache.usable``, for many rows). Tensor work
    only."""
    page = index_cache.page
    seq = plan.kv_seq_lens.to(torch.int64)
    slot = torch.arange(max(plan.pages, 1), device=seq.device)
    expected = (seq[:, None] - slot * page).clamp(0, page)
    used = expected > 0
    ids = page_ids(block_table, slot, index_cache.filled.shape[0])
    ok = index_cache.filled[ids] == expected
    if page_tags is not None and index_cache.tag is not None:
        ok &= index_cache.tag[ids] == page_tags[:, :slot.shape[0]].to(index_cache.tag.device)
    return (ok | ~used).all(dim=1)


def _dense_unless(valid: torch.Tensor, idx: torch.Tensor, lengths: torch.Tensor,
                  plan: PagedPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The lists of the rows ``valid`` marks False replaced by every block
    their query blocks can see (dense): tensor work only."""
    bs = plan.params.stem_block_size
    j = torch.arange(idx.shape[2], device=idx.device)
    window = plan.window_lens_device.to(torch.int64)[:, None]
    reach = contract.reach_blocks(j[None], window, plan.kv_seq_lens.to(torch.int64)[:, None],
                                  bs, True)
    reach = torch.where(j < ceil_div(window, bs), reach, 0)  # [B, qmax]
    blocks = torch.arange(idx.shape[3], device=idx.device)
    dense = torch.where(blocks < reach[..., None], blocks, -1).to(idx.dtype)[:, None]
    bad = ~valid.to(device=idx.device, dtype=torch.bool)[:, None, None]
    return (torch.where(bad[..., None], dense, idx),
            torch.where(bad, reach[:, None].to(lengths.dtype), lengths))


def _select(query, index_cache, block_table, plan: PagedPlan, page_tags=None, key_cache=None):
    p = plan.indexer_params
    if plan.lists is not None:
        return plan.lists
    idx, lengths = torch.ops.stem_indexer.paged_select(
        query, index_cache.ksum, index_cache.vmax, block_table, plan.q_map,
        plan.indexer_q_lens, plan.kv_seq_lens, plan.prompt, plan.metadata, plan.qmax,
        plan.kmax, plan.page_size, plan.indexer_scale, plan.oam, plan.oam_lambda,
        plan.kernel, p.stem_block_size, p.stem_stride, p.alpha, p.initial_blocks,
        p.window_size, p.k_block_num_rate_medium, p.k_block_num_bias_medium,
        p.k_block_num_rate_large, p.k_block_num_bias_large, p.topk_score_precision,
        plan.oam_runs)
    if plan.probe_queries:
        if key_cache is None:
            fail("stem_paged_select", "key_cache", "must be given where the plan runs the probe "
                 "(probe_queries > 0): it reads the rows' keys", None)
        bs = p.stem_block_size
        idx, lengths = _probe(query, lambda b: _contiguous_keys(
            key_cache, block_table[b:b + 1], plan.kv_seq_lens[b:b + 1], plan.kmax,
            bs)[0].transpose(0, 1), idx, lengths, plan)
    idx, lengths = apply_tail(idx, lengths, plan.tail, plan.kmax)
    return _dense_unless(stem_paged_valid(index_cache, block_table, plan, page_tags), idx,
                         lengths, plan)


def _check_run(query, key_cache, value_cache, index_cache, block_table, plan) -> None:
    """Shapes, dtypes and devices against the plan (metadata only: no value
    read). ``key_cache`` None: the selection alone."""
    who = "stem_paged_run" if key_cache is not None else "stem_paged_select"
    if not isinstance(plan, PagedPlan):
        fail(who, "plan", "must be a PagedPlan from stem_paged_plan", type(plan).__name__)
    want = (plan.tokens, plan.num_heads, plan.head_dim)
    if tuple(query.shape) != want:
        fail(who, "query", f"must have the plan's shape {list(want)}", tuple(query.shape))
    for name, x in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if x is not None and (x.dtype != plan.dtype or x.device != plan.device):
            fail(who, name, f"must be {plan.dtype} on {plan.device}, as planned",
                 f"{x.dtype} on {x.device}")
    if key_cache is not None:
        _check_keys(who, key_cache, plan)
        if value_cache.shape != key_cache.shape:
            fail(who, "value_cache", "must have key_cache's shape", tuple(value_cache.shape))
    if not isinstance(index_cache, IndexCache):
        fail(who, "index_cache", "must be an IndexCache", type(index_cache).__name__)
    pages = index_cache.ksum.shape[0] if key_cache is None else key_cache.shape[0]
    want = (pages, plan.params.stem_stride, plan.num_kv_heads, plan.head_dim)
    if index_cache.page != plan.page_size or tuple(index_cache.ksum.shape) != want \
            or index_cache.ksum.device != plan.device:
        fail(who, "index_cache", f"must have page {plan.page_size} and ksum {list(want)} on "
             f"{plan.device} (the KV cache's pages, stem_stride, heads)",
             f"page {index_cache.page}, ksum {tuple(index_cache.ksum.shape)}")
    if (block_table.dim() != 2 or block_table.shape[0] != plan.batch
            or block_table.shape[1] < plan.pages
            or block_table.dtype not in (torch.int32, torch.int64)
            or block_table.device != plan.device):
        fail(who, "block_table", f"must be int32 or int64 [{plan.batch}, >= {plan.pages}] on "
             f"{plan.device} (a row per row, a page per {plan.page_size} tokens)",
             f"{block_table.dtype} {tuple(block_table.shape)} on {block_table.device}")


def _check_keys(who: str, key_cache: torch.Tensor, plan: PagedPlan) -> None:
    want = (plan.page_size, plan.num_kv_heads, plan.head_dim)
    if key_cache.dim() != 4 or tuple(key_cache.shape[1:]) != want:
        fail(who, "key_cache", "must be [num_pages, page_size, num_kv_heads, head_dim] = "
             f"[*, {', '.join(map(str, want))}]", tuple(key_cache.shape))
    if key_cache.dtype != plan.dtype or key_cache.device != plan.device:
        fail(who, "key_cache", f"must be {plan.dtype} on {plan.device}, as planned",
             f"{key_cache.dtype} on {key_cache.device}")


# --------------------------------------------------------------------------- #
# The run's two ops
# --------------------------------------------------------------------------- #

def window_queries(query: torch.Tensor, q_map: torch.Tensor) -> torch.Tensor:
    """[B, Hq, qmax * Bs, D]: each row's block-aligned window, zeros where no
    token of the row is."""
    padded = torch.cat([query, query.new_zeros(1, *query.shape[1:])])
    return padded[q_map].permute(0, 2, 1, 3)


@torch.library.custom_op("stem_indexer::paged_select", mutates_args=())
def _paged_select_op(
    query: torch.Tensor, ksum: torch.Tensor, vmax: torch.Tensor, block_table: torch.Tensor,
    q_map: torch.Tensor, q_seq_lens: torch.Tensor, kv_seq_lens: torch.Tensor,
    prompt: torch.Tensor, metadata: torch.Tensor, qmax: int, kmax: int, page: int,
    indexer_scale: float, oam: bool, oam_lambda: float, kernel: str, stem_block_size: int,
    stem_stride: int, alpha: float, initial_blocks: int, window_size: int,
    k_block_num_rate_medium: float, k_block_num_bias_medium: int,
    k_block_num_rate_large: float, k_block_num_bias_large: int, topk_score_precision: int,
    oam_runs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's picks for a paged plan's rows (its checked lengths and
    metadata): qflat from the window queries, kflat and vbias from the
    indexer cache through the table."""
    params = IndexerParams(True, stem_block_size, stem_stride, alpha, initial_blocks,
                           window_size, k_block_num_rate_medium, k_block_num_bias_medium,
                           k_block_num_rate_large, k_block_num_bias_large, topk_score_precision)
    bs, stride = stem_block_size, stem_stride
    qflat = represent(window_queries(query, q_map), bs, stride, None, scale=indexer_scale)
    cache = IndexCache(ksum, vmax, ksum.new_empty(0, dtype=torch.int32), page)
    kflat, vbias = cache.block_inputs(block_table, kv_seq_lens, kmax, bs, oam, oam_lambda,
                                      kflat=kernel != "triton", stat_runs=oam_runs)
    if kernel == "triton":
        from ..operator.ops.triton import launch
        from ..operator.ops.triton.paged_index import paged_kflat

        kflat = paged_kflat(ksum, block_table, kv_seq_lens, kmax, bs, page)
        return launch.stem_indexer_triton(qflat, kflat, vbias, q_seq_lens, kv_seq_lens,
                                          prompt, metadata, params)
    return _indexer(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, prompt, metadata, params)


def _indexer(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, prompt, metadata,
             params: IndexerParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's lists on a plan's checked lengths and metadata (CPU or
    torch path)."""
    return torch.ops.stem_indexer.planned_indexer(
        qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens=prompt,
        metadata=metadata, **dataclasses.asdict(params))


def select_on_inputs(query: torch.Tensor, kflat: torch.Tensor, vbias: torch.Tensor,
                     plan: PagedPlan, *, indexer_scale: float | None = None,
                     scale: float | None = None, softcap: float | None = None,
                     keys=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``stem_paged_select``'s lists from the key side's inputs where an
    engine holds them already (``kflat [B, Hkv, kmax, Ts*D]`` bfloat16 and
    ``vbias [B, Hkv, kmax]`` float32, as ``IndexCache.block_inputs`` gives
    them): the vLLM CPU backend's rows. ``indexer_scale`` replaces the plan's
    (a layer's own softmax scale over ``stem_stride``), ``scale`` and
    ``softcap`` the attention's. Where the plan runs the probe, ``keys(b)`` gives row ``b``'s
    keys ``[>= seq_len, Hkv, D]``. Tensor work and the indexer; no validity
    check (the caller has made it)."""
    if plan.lists is not None:
        return plan.lists
    p = plan.indexer_params
    iscale = plan.indexer_scale if indexer_scale is None else indexer_scale
    qflat = represent(window_queries(query, plan.q_map), p.stem_block_size, p.stem_stride,
                      None, scale=iscale)
    idx, lengths = _indexer(qflat, kflat, vbias, plan.indexer_q_lens, plan.kv_seq_lens,
                            plan.prompt, plan.metadata, p)
    if plan.probe_queries:
        if keys is None:
            fail("select_on_inputs", "keys", "must be given where the plan runs the probe "
                 "(probe_queries > 0)", None)
        idx, lengths = _probe(query, keys, idx, lengths, plan, scale, softcap)
    return apply_tail(idx, lengths, plan.tail, plan.kmax)


def _probe(query: torch.Tensor, keys, idx: torch.Tensor, lengths: torch.Tensor,
           plan: PagedPlan, scale: float | None = None,
           softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's lists of the plan's sparse rows re-ranked by the probe
    (``probe.probe_refine``; ``keys(b)`` row ``b``'s keys), in place."""
    bs = plan.params.stem_block_size
    prompt = plan.prompt.cpu()
    starts = torch.cumsum(plan.query_lens, 0) - plan.query_lens
    for b, path in enumerate(plan.paths):
        if path != "sparse":
            continue
        qlen, seq = int(plan.query_lens[b]), int(plan.seq_lens[b])
        qb, start = ceil_div(int(plan.window_lens[b]), bs), int(starts[b])
        idx[b, :, :qb], lengths[b, :, :qb] = probe_refine(
            query[start:start + qlen], keys(b), idx[b, :, :qb], lengths[b, :, :qb],
            context=seq - qlen, seq_len=seq, prompt=int(prompt[b]), params=plan.params,
            scale=plan.scale if scale is None else scale, queries=plan.probe_queries,
            softcap=plan.softcap if softcap is None else softcap)
    return idx, lengths

@_paged_select_op.register_fake
def _(query, ksum, vmax, block_table, q_map, q_seq_lens, kv_seq_lens, prompt, metadata, qmax,
      kmax, *args):
    shape = (q_map.shape[0], query.shape[1], qmax)
    return (query.new_empty(*shape, kmax, dtype=torch.int32),
            query.new_empty(shape, dtype=torch.int32))


@torch.library.custom_op("stem_indexer::paged_attention", mutates_args=())
def _paged_attention_op(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_table: torch.Tensor, sparse_indices: torch.Tensor, sparse_seq_len: torch.Tensor,
    rows: torch.Tensor, q_map: torch.Tensor, out_map: torch.Tensor, window_lens: torch.Tensor,
    seq_lens: torch.Tensor, window_lens_device: torch.Tensor, seq_lens_device: torch.Tensor,
    block_size: int, scale: float, softcap: float | None, kernel: str,
) -> torch.Tensor:
    """Block-sparse attention of a paged plan's rows on its lists: the paged
    Triton kernel, or the pages gathered for the contiguous path's kernel."""
    if kernel == "triton":
        from ..operator.ops.triton.paged_attention import paged_sparse_attention

        return paged_sparse_attention(query, key_cache, value_cache,
                                      block_table.to(torch.int32), sparse_indices,
                                      sparse_seq_len, rows, block_size=block_size, scale=scale,
                                      softcap=softcap)
    q = window_queries(query, q_map)
    k, v = (_contiguous_keys(x, block_table, seq_lens_device, sparse_indices.shape[3],
                             block_size) for x in (key_cache, value_cache))
    valid = torch.arange(q.shape[2], device=q.device) < window_lens_device[:, None]
    call = _Call(q, k, v, sparse_indices, sparse_seq_len, window_lens, seq_lens, block_size,
                 True, scale, softcap, (window_lens_device, seq_lens_device, valid))
    out, _ = _run(call, kernel)
    return out.transpose(1, 2).flatten(0, 1)[out_map].contiguous()

@_paged_attention_op.register_fake
def _(query, *args):
    return query.new_empty(query.shape)


def _contiguous_keys(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     width: int, block_size: int) -> torch.Tensor:
    """[B, Hkv, kmax * Bs, D]: each row's keys (or values) gathered from its
    pages, zeros past its length (``kmax`` the lists' width, at least the
    longest row's key blocks)."""
    page = cache.shape[1]
    pos = torch.arange(width * block_size, device=cache.device)
    ids = page_ids(block_table, pos // page, cache.shape[0])
    used = pos[None, :] < seq_lens[:, None]
    x = cache[ids, (pos % page)[None, :]]  # [B, S, Hkv, D]
    return torch.where(used[..., None, None], x, 0).permute(0, 2, 1, 3)
