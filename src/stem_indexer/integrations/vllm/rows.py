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
* **The keys' block representations and the Output-Aware Metric** are
  computed from the keys and values in the cache, i.e. from the prompt's
  first ``context + q_len`` tokens: the OAM standardises value norms over
  those tokens only, where a one-shot prefill sees the whole prompt.

The kept blocks then become *virtual rows* of vLLM's own paged kernel: for
query head ``h`` and query block ``i``, the block's query tokens attend a
sequence made of the pages of the kept key blocks, in ascending order. The
last kept block is ``i`` itself (the window keeps it), so the kernel's
bottom-right causal mask on that sequence is exactly the token-level causal
mask of the block, and every earlier kept block is wholly visible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import contract
from ...api import run_indexer, stem_indexer_metadata
from ...contract import ceil_div
from ...dispatch import widen_tail
from ...prepare import stem_inputs
from .settings import StemSettings

__all__ = ["Row", "RowKinds", "RowPlan", "plan_row", "context_kv", "select_blocks",
           "virtual_rows", "VirtualRows"]


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


def context_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, pages: torch.Tensor,
               length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` keys and values of a sequence from vLLM's CPU cache.

    ``key_cache``/``value_cache`` are the views vLLM's CPU backend makes of a
    layer's cache, ``[num_pages, Hkv, page, D]``, in the ``vec`` layout: a
    page's keys are stored transposed (``[D, page]`` in memory), its values
    row-major. ``pages`` lists the sequence's pages in order. Returns
    ``k, v [Hkv, length, D]``.
    """
    n, heads, page, dim = key_cache.shape
    np_ = ceil_div(length, page)
    ids = pages[:np_].to(torch.int64)
    k = key_cache[ids].reshape(np_, heads, dim, page).transpose(2, 3)
    v = value_cache[ids]
    k = k.permute(1, 0, 2, 3).reshape(heads, np_ * page, dim)[:, :length]
    v = v.permute(1, 0, 2, 3).reshape(heads, np_ * page, dim)[:, :length]
    return k, v


def select_blocks(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: Row,
                  scale: float, settings: StemSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Stem's selection for a row: the indexer on the block-aligned window.

    ``query [q_len, Hq, D]`` (the row's new queries), ``k, v [Hkv, seq_len, D]``
    (all its keys and values). Returns ``(indices [Hq, Qb, W] int32 ascending
    then -1, lengths [Hq, Qb] int32)`` over the row's absolute query blocks
    ``context // Bs ..``; the blocks holding the prompt's last
    ``settings.exact_tail`` tokens list every block ``0 .. i``.
    """
    bs, stride = settings.block_size, settings.stride
    first, _, _ = _row_blocks(row, bs)
    lead = row.context - first * bs  # earlier queries of the first block: zeros
    hq, dim = query.shape[1], query.shape[2]
    q = query.new_zeros(1, hq, lead + row.q_len, dim)
    q[0, :, lead:] = query.transpose(0, 1)
    inputs = stem_inputs(q, k[None], v[None], stem_block_size=bs, stem_stride=stride,
                         scale=scale / stride, oam=settings.oam,
                         oam_lambda=settings.oam_lambda)
    metadata = stem_indexer_metadata(
        inputs.q_seq_lens, inputs.kv_seq_lens, hq, k.shape[0], causal=True,
        stem_block_size=bs, dim_qkflat=inputs.qflat.shape[-1],
        window_size=settings.params.window_size)
    prompt = torch.tensor([max(row.prompt, row.seq_len)], dtype=torch.int32)
    idx, lengths = run_indexer(inputs.qflat, inputs.kflat, inputs.vbias, inputs.q_seq_lens,
                               inputs.kv_seq_lens, prompt, metadata, settings.params)
    # The prompt's tail (settings.exact_tail) on the same window: a widened
    # row lists blocks 0 .. i, so it still ends at its own block.
    if settings.exact_tail:
        idx, lengths = widen_tail(idx, lengths, torch.tensor([lead + row.q_len]),
                                  torch.tensor([row.seq_len]), prompt.long(),
                                  settings.exact_tail, bs, True, ceil_div(row.seq_len, bs))
    return idx[0], lengths[0]


@dataclass(frozen=True)
class VirtualRows:
    """Rows for vLLM's paged kernel with one query head each, over a cache
    viewed as ``[num_pages * Hkv, 1, page, 2D]`` (page ``p`` of KV head ``n``
    is page ``p * Hkv + n`` there)."""

    query_lens: torch.Tensor  #: [V] int32 query tokens per virtual row
    seq_lens: torch.Tensor  #: [V] int32 keys per virtual row
    block_table: torch.Tensor  #: [V, W] int32 pages (flattened ids)


def virtual_rows(indices: torch.Tensor, lengths: torch.Tensor, row: Row, block_size: int,
                 page: int, pages: torch.Tensor, num_kv_heads: int) -> VirtualRows:
    """The virtual rows of one Stem row, ordered head-major then by block:
    the order of ``query.transpose(0, 1)``'s tokens (head ``h``'s tokens of
    block ``i`` are one contiguous run there).

    ``indices [Hq, Qb, W]`` and ``lengths [Hq, Qb]`` are the selection,
    ``pages`` the row's block-table entries (its pages in order).
    """
    hq, qb, _ = indices.shape
    first = row.context // block_size
    per_block = block_size // page
    width = int(lengths.max())
    blocks = indices[..., :width].to(torch.int64)  # [Hq, Qb, width]
    listed = torch.arange(width) < lengths[..., None]
    # Page slots of every listed block, block after block; past the table's
    # end (a block the sequence only partly fills) any valid id will do: the
    # row's length stops the kernel before it.
    slot = blocks.clamp(min=0)[..., None] * per_block + torch.arange(per_block)
    slot = slot.clamp(max=pages.shape[0] - 1)
    table = pages.to(torch.int64)[slot]  # [Hq, Qb, width, per_block]
    kv_head = (torch.arange(hq) // (hq // num_kv_heads))[:, None, None, None]
    table = torch.where(listed[..., None], table * num_kv_heads + kv_head, 0)
    i = torch.arange(first, first + qb)
    block_start = i * block_size
    block_end = torch.clamp((i + 1) * block_size, max=row.seq_len)
    q_tokens = block_end - torch.clamp(block_start, min=row.context)
    # All kept blocks but the last (the diagonal block i) are whole.
    seq = (lengths.to(torch.int64) - 1) * block_size + (block_end - block_start)
    return VirtualRows(q_tokens.expand(hq, qb).reshape(-1).to(torch.int32),
                       seq.reshape(-1).to(torch.int32),
                       table.reshape(hq * qb, width * per_block).to(torch.int32))
