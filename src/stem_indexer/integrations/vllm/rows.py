"""One long prefill row of a vLLM step, on Stem: plain torch, no vLLM import.

A vLLM step hands the attention backend *rows*: one per request, ``q_len``
new query tokens at absolute positions ``[context, context + q_len)`` over
``context + q_len`` keys already in the paged KV cache (the cache is written
before the attention runs). A fresh prompt is a row with ``context = 0``; a
chunk of a long prompt, or a prefix-cache hit, is a row with cached context.

What a Stem row computes (docs/CONTRACT.md section 8):

* **Blocks are absolute.** Query block ``i`` is positions ``[i*Bs, (i+1)*Bs)``
  of the whole sequence, whatever the chunk boundaries. A chunk that starts
  inside a block gives the indexer that block with the missing (earlier)
  queries as zeros, so its last tokens are scored as part of their true
  block and keep the causal mask's every key. The indexer runs on the
  block-aligned window ``[Bs * (context // Bs), context + q_len)`` against
  all ``context + q_len`` keys, so each row's position, visible range, sink
  and window are those of a one-shot prefill.
* **The budget is the prompt's**: ``num_prompt_tokens`` is the request's
  prompt length (vLLM's runner holds it; the attention metadata does not).
* **The keys' block representations and the Output-Aware Metric** come
  from the indexer cache (``stem_indexer/pipeline/index_cache.py``): per-page sums and run maxima
  of the prompt's first ``context + q_len`` tokens, written as vLLM wrote
  them into its paged cache. The keys and values themselves are read back
  only for pages that decode steps filled (``kv_read.py``, by the backend).
  The OAM standardises value norms over those tokens only, where a
  one-shot prefill sees the whole prompt.

The row itself is the engine-neutral paged pipeline's (``paged.py``): its
lengths, the indexer's metadata, the tail rows ``exact_tail`` widens and the
selection are ``stem_paged_plan``'s and ``paged.select_on_inputs``'s, so that
every engine runs the same code. What is vLLM's stays here: which rows a
step hands over (``Row``, ``RowKinds``), the budget's accounting
(``plan_row``), and the virtual rows of vLLM's own paged kernel. The host
work is done once per step by ``plan_stem_row``, in the metadata builder;
each layer then runs tensor work only (``select_blocks``, ``virtual_rows``).

The kept blocks are attended by one of two kernels (the ``sparse_kernel``
setting). Stem's CPU block-sparse kernel takes the selection as it is, and
the row's keys and values either packed by the kernel straight from vLLM's
cache pages, where their layout allows it (``attend_row_paged``: the
``amx`` and ``vec`` layouts), or as read from vLLM's cache (``attend_row``,
with ``kv_read.PageReader``). Or the kept blocks become *virtual rows* of vLLM's own
paged kernel: for
query head ``h`` and query block ``i``, the block's query tokens attend a
sequence made of the pages of the kept key blocks, in ascending order. The
last kept block is ``i`` itself (the window keeps it), so the kernel's
bottom-right causal mask on that sequence is exactly the token-level causal
mask of the block, and every earlier kept block is wholly visible.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...operator import contract
from ...operator.contract import PARAM_NAMES, IndexerParams, ceil_div
from ...operator.ops.sparse_attention import sparse_attention, sparse_attention_paged
from ...pipeline.paged import PagedPlan, select_on_inputs, stem_paged_plan, window_queries
from .settings import StemSettings

__all__ = ["Row", "RowKinds", "RowPlan", "plan_row", "StemRow", "plan_stem_row",
           "select_blocks", "attend_row", "attend_row_paged", "virtual_rows", "VirtualRows",
           "decode_tokens_left_out"]


@dataclass(frozen=True)
class Row:
    """One request's row in a step (host integers)."""

    index: int  #: the row's place in the step's metadata
    start: int  #: its first query token in the step's query tensor
    q_len: int
    context: int  #: tokens in the cache before this row's
    prompt: int  #: the request's prompt length (the budget's)
    kind: str = "fresh"  #: "fresh", "continuation" or "prefix hit"
    request: str = ""
    visible: int = 0  #: visible (query block, key block) pairs per head (``plan_row``)

    @property
    def seq_len(self) -> int:
        return self.context + self.q_len


class RowKinds:
    """Tells a prompt's rows apart as the steps arrive: ``"fresh"`` (no
    context), ``"prefix hit"`` (the request's first row, over context another
    request computed), ``"continuation"`` (a later chunk), ``"decode"``."""

    def __init__(self, limit: int = 4096) -> None:
        self._open: dict[str, None] = {}  # requests whose prompt is under way
        self._limit = limit  # an aborted request is forgotten after this many

    def kind(self, request: str, context: int, prompt: int, q_len: int) -> str:
        if context >= prompt:
            self._open.pop(request, None)
            return "decode"
        seen = request in self._open
        if context + q_len >= prompt:
            self._open.pop(request, None)
        elif not seen:
            if len(self._open) >= self._limit:
                self._open.pop(next(iter(self._open)))
            self._open[request] = None
        if context == 0:
            return "fresh"
        return "continuation" if seen else "prefix hit"


@dataclass(frozen=True)
class RowPlan:
    """Block pairs a Stem row keeps and sees, per query head (from the
    contract's budget, before any score is computed)."""

    kept: int
    visible: int

    @property
    def share(self) -> float:
        return self.kept / self.visible if self.visible else 1.0


def _row_blocks(row: Row, bs: int) -> tuple[int, int, int]:
    """(first absolute query block, query blocks, key blocks) of a row."""
    first = row.context // bs
    kb = ceil_div(row.seq_len, bs)
    return first, kb - first, kb


def plan_row(row: Row, settings: StemSettings) -> RowPlan:
    """How many block pairs the indexer will keep for ``row`` (every head
    alike), by the contract's budget: forced blocks plus ``min(K, candidates)``."""
    bs = settings.block_size
    first = row.context // bs  # query blocks aligned to absolute positions
    lengths = [[row.seq_len - first * bs], [row.seq_len], [max(row.prompt, row.seq_len)]]
    q_lens, kv_lens, prompt = (torch.tensor(x, dtype=torch.int64) for x in lengths)
    return RowPlan(*contract.budget_pairs(q_lens, kv_lens, prompt, settings.params))


@dataclass(frozen=True)
class StemRow:
    """The step's plan of one Stem row, shared by every layer (``plan_stem_row``)."""

    row: Row
    page: int  #: tokens per KV-cache page
    pages: torch.Tensor  #: [ceil(seq_len / page)] int64, the row's pages in order
    fill: torch.Tensor  #: [same] int32, what a complete indexer cache holds on them
    paged: PagedPlan  #: the row as the engine-neutral paged pipeline plans it
    query_lens: torch.Tensor  #: [Hq * Qb] int32, each virtual row's queries
    block_tokens: torch.Tensor  #: [Qb] int64, keys of each query block's own block
    kept: int  #: block pairs kept per head, by the budget (tail rows not widened)
    #: the row with other budgets (``for_budget``), made once per step each
    budgets: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def for_budget(self, params: IndexerParams) -> "StemRow":
        """This row with the budget of ``params`` (a layer's
        ``StemSettings.layer_params``): the same pages, lengths and tail, the
        indexer keeping that budget's blocks."""
        if params == self.paged.params:
            return self
        row = self.budgets.get(params)
        if row is None:
            row = self.budgets[params] = dataclasses.replace(
                self, paged=self.paged.with_budget(params), budgets={})
        return row


def plan_stem_row(row: Row, settings: StemSettings, pages: torch.Tensor, page: int,
                  q_heads: int, kv_heads: int, head_size: int) -> StemRow:
    """The host work of a Stem row, done once per step: ``pages`` is the
    row's block-table entry (vLLM's pages of the sequence, in order). The
    row's lengths, the indexer's metadata and the rows ``exact_tail`` widens
    are ``stem_paged_plan``'s (``paged.py``): one pipeline for every engine."""
    bs = settings.block_size
    first, qb, kb = _row_blocks(row, bs)
    n = ceil_div(row.seq_len, page)
    fill = torch.full((n,), page, dtype=torch.int32)
    fill[-1] = row.seq_len - (n - 1) * page
    params = {name: getattr(settings.params, name) for name in PARAM_NAMES if name != "causal"}
    # The indexer's scale is the layer's (select_blocks); vLLM's kernel attends.
    paged = stem_paged_plan([row.q_len], [row.seq_len], num_prompt_tokens=[row.prompt],
                            num_heads=q_heads, num_kv_heads=kv_heads, head_dim=head_size,
                            page_size=page, dtype=torch.float32, oam=settings.oam,
                            oam_lambda=settings.oam_lambda, min_q_blocks=1, dense_above=1.0,
                            exact_tail=settings.exact_tail, backend="torch",
                            chunk_invariant=settings.chunk_invariant,
                            probe_queries=settings.probe_queries,
                            probe_candidates=settings.probe_candidates, **params)
    i = torch.arange(first, first + qb)
    block_start = i * bs
    block_end = torch.clamp((i + 1) * bs, max=row.seq_len)
    q_tokens = block_end - torch.clamp(block_start, min=row.context)
    return StemRow(row, page, pages[:n].to(torch.int64), fill, paged,
                   q_tokens.repeat(q_heads).to(torch.int32), block_end - block_start,
                   plan_row(row, settings).kept)


def select_blocks(query: torch.Tensor, kflat: torch.Tensor, vbias: torch.Tensor,
                  plan: StemRow, scale: float, settings: StemSettings,
                  keys: torch.Tensor | None = None,
                  softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stem's selection for a row: the paged pipeline's (``paged.select_on_inputs``).

    ``query [q_len, Hq, D]`` (the row's new queries); ``kflat [Hkv, Kb,
    Ts*D]`` and ``vbias [Hkv, Kb]`` of all its keys (the indexer cache's
    ``inputs``, equal to ``stem_inputs``'s). Returns ``(indices [Hq, Qb, W]
    int32 ascending then -1, lengths [Hq, Qb] int32)`` over the row's absolute
    query blocks ``context // Bs ..``; the blocks holding the prompt's last
    ``settings.exact_tail`` tokens list every block ``0 .. i``. With the
    probe on (``settings.probe_queries``), ``keys [>= seq_len, Hkv, D]`` are
    the row's keys in token order, and ``scale``, ``softcap`` the layer's.
    """
    idx, lengths = select_on_inputs(query, kflat[None], vbias[None], plan.paged,
                                    indexer_scale=scale / settings.stride, scale=scale,
                                    softcap=softcap,
                                    keys=None if keys is None else (lambda b: keys))
    return idx[0], lengths[0]


def attend_row(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               indices: torch.Tensor, lengths: torch.Tensor, plan: StemRow, scale: float,
               softcap: float | None = None, bf16: str = "auto") -> torch.Tensor:
    """A row's attention on its selection, by Stem's CPU block-sparse kernel
    (``bf16``: how it multiplies bfloat16, ``sparse_attention``'s).

    ``query [q_len, Hq, D]``; ``keys``, ``values [Hkv, >= seq_len, D]`` the
    row's keys and values in token order (``PageReader.read_heads``);
    ``indices``/``lengths`` the selection over the row's absolute query
    blocks (``select_blocks``). The queries go in the paged plan's
    block-aligned window, as the indexer saw them (``window_queries``), and
    come back out of it. Returns ``[q_len, Hq, D]``."""
    p = plan.paged
    out = sparse_attention(window_queries(query, p.q_map), keys[None], values[None],
                           indices[None], lengths[None], p.window_lens, p.seq_lens,
                           p.params.stem_block_size, True, scale, softcap or None, bf16=bf16)
    return out.transpose(1, 2).flatten(0, 1)[p.out_map]


def attend_row_paged(query: torch.Tensor, kv_cache: torch.Tensor, reader, indices: torch.Tensor,
                     lengths: torch.Tensor, plan: StemRow, scale: float,
                     softcap: float | None = None, bf16: str = "auto") -> torch.Tensor:
    """``attend_row`` with the row's keys and values packed by the kernel
    straight from vLLM's cache ``kv_cache [num_pages, Hkv, page, 2D]``,
    where ``reader`` (its ``kv_read.PageReader``) says they lie; the layout
    must pass ``sparse_attention.paged_refused`` (for ``bf16``: how the
    kernel multiplies, ``sparse_attention_paged``'s)."""
    p = plan.paged
    out = sparse_attention_paged(window_queries(query, p.q_map), kv_cache, plan.pages[None],
                                 kv_cache.shape[2], reader.key_view, reader.value_view,
                                 indices[None], lengths[None], p.window_lens, p.seq_lens,
                                 p.params.stem_block_size, True, scale, softcap or None,
                                 bf16=bf16)
    return out.transpose(1, 2).flatten(0, 1)[p.out_map]


@dataclass(frozen=True)
class VirtualRows:
    """Rows for vLLM's paged kernel with one query head each, over a cache
    viewed as ``[num_pages * Hkv, 1, page, 2D]`` (page ``p`` of KV head ``n``
    is page ``p * Hkv + n`` there)."""

    query_lens: torch.Tensor  #: [V] int32 query tokens per virtual row
    seq_lens: torch.Tensor  #: [V] int32 keys per virtual row
    block_table: torch.Tensor  #: [V, W] int32 pages (flattened ids)


def virtual_rows(indices: torch.Tensor, lengths: torch.Tensor, plan: StemRow, block_size: int,
                 page: int, num_kv_heads: int) -> VirtualRows:
    """The virtual rows of one Stem row, ordered head-major then by block:
    the order of ``query.transpose(0, 1)``'s tokens (head ``h``'s tokens of
    block ``i`` are one contiguous run there).

    ``indices [Hq, Qb, W]`` and ``lengths [Hq, Qb]`` are the selection.
    """
    hq, qb, _ = indices.shape
    pages = plan.pages
    per_block = block_size // page
    width = int(lengths.max())
    blocks = indices[..., :width].to(torch.int64)  # [Hq, Qb, width]
    listed = torch.arange(width) < lengths[..., None]
    # Page slots of every listed block, block after block; past the table's
    # end (a block the sequence only partly fills) any valid id will do: the
    # row's length stops the kernel before it.
    slot = blocks.clamp(min=0)[..., None] * per_block + torch.arange(per_block)
    slot = slot.clamp(max=pages.shape[0] - 1)
    table = pages[slot]  # [Hq, Qb, width, per_block]
    kv_head = (torch.arange(hq) // (hq // num_kv_heads))[:, None, None, None]
    table = torch.where(listed[..., None], table * num_kv_heads + kv_head, 0)
    # All kept blocks but the last (the diagonal block i) are whole.
    seq = (lengths.to(torch.int64) - 1) * block_size + plan.block_tokens
    return VirtualRows(plan.query_lens, seq.reshape(-1).to(torch.int32),
                       table.reshape(hq * qb, width * per_block).to(torch.int32))


def decode_tokens_left_out(q_lens: torch.Tensor, decode: torch.Tensor) -> torch.Tensor | None:
    """``[tokens]`` bool, False on the tokens of the rows ``decode`` marks
    (``q_lens [rows]`` tokens each, in order); None when no row is one."""
    if not bool(decode.any()):
        return None
    return (~decode).repeat_interleave(q_lens)


def decode_only(starts: list[int], seq_lens: list[int],
                prompts: list[int]) -> tuple[tuple[str, int], ...] | None:
    """A step whose rows are all decodes (one token, past the prompt) or
    empty, at least one a decode: its rows by reason, as ``StepPlan.bulk``
    counts them; None for any other step. ``starts``: the rows' query start
    offsets (one more than rows), ``seq_lens`` and ``prompts`` per row. Host
    integers only: the common step of a served engine, planned in
    microseconds."""
    decodes = empty = 0
    for a, b, seq, prompt in zip(starts, starts[1:], seq_lens, prompts):
        if b == a:
            empty += 1
        elif b - a == 1 and seq - 1 >= prompt:
            decodes += 1
        else:
            return None
    if not decodes:
        return None
    return (("decode", decodes),) + ((("empty row", empty),) if empty else ())
