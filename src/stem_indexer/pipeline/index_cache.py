"""The indexer cache: what Stem's indexer needs of each KV-cache page, kept
beside an engine's paged KV cache. Plain torch, no engine import; the vLLM
CPU backend writes and reads it, and ``paged.py``'s entry point reads it for
any engine.

An engine writes each step's new keys and values into its paged cache, in
its own layout (vLLM's CPU cache is packed for the instruction set: ``vec``,
``vec16``, ``amx``), so reading them back is layout-specific. The indexer
needs far less than the keys and values themselves
(docs/CONTRACT.md section 7):

* ``kflat``: per Stem block and group ``s`` of the stride, the float32 sum
  of the block's keys at offsets ``r * Ts + s``;
* ``vbias``: per run of ``Ts`` tokens, the largest value norm (the
  Output-Aware Metric's raw statistic).

Both follow from the keys and values as the engine writes them.
``IndexCache`` holds them per page and KV head, indexed by the engine's page
ids, and is written from the same unpacked ``key``/``value`` and slots that
its cache writer receives (``write``):

* ``ksum [num_pages, Ts, Hkv, D]`` float32: group ``s`` of a page sums its
  keys at offsets ``o`` with ``o % Ts == s`` (pages hold whole groups: the
  page size is a multiple of ``Ts``);
* ``vmax [num_pages, page / Ts, Hkv]`` float32: the largest value norm of
  each run of ``Ts`` tokens;
* ``filled [num_pages]`` int32: tokens accumulated from offset 0, or -1;
* ``tag [num_pages]`` int64: who wrote the page, as the writer says (the
  vLLM backend gives each token the hash of the token ids up to it,
  ``token_tags``): the tag of the page's last token written.

A page's entry accumulates as its tokens arrive, across steps: a chunk that
ends inside a page leaves it partial and the next chunk completes it. A write
at offset 0 starts the page afresh (zeroes it first), so a page freed and
reused, or rewritten after preemption, never carries old sums. Each write
counts every page's tokens: one that neither starts the page nor continues
it exactly where it stopped, or whose offsets skip one (a gap) or repeat one
(a slot written twice), marks the page unusable (``filled = -1``) until it
starts again. ``complete`` tells whether a row's pages hold exactly its
tokens: the count each page must have, and where the row gives them, the
tags its tokens must have left (so that a page some other writer filled, or
whose sums belong to another sequence, is never taken for the row's). A
vLLM row whose pages are not complete runs vLLM's kernel instead.

Prefix-cache hits share pages, so they find their entries written. With
``Bs`` equal to the page size (vLLM's CPU default, 128) a block's group sums
are accumulated token after token in order, as ``prepare.block_representation``
sums them, and ``kflat`` is bit for bit ``stem_inputs``'s; with ``Bs`` a
multiple of the page, the pages' sums are added once more, in page order (a
float32 rounding per page, docs/CONTRACT.md section 8; ``block_inputs`` and
the Triton pass of ``ops/triton/paged_index.py`` add them alike). On CUDA
``write`` accumulates with atomics, whose order is not fixed: the sums are
then ``stem_inputs``'s up to summation order. The run maxima are exact
whatever the order, so ``vbias`` is ``stem_inputs``'s bit for bit.

Memory, per page and KV head: ``(Ts * D + page / Ts) * 4`` bytes (and 12
bytes per page for ``filled`` and ``tag``), against ``2 * page * D * itemsize``
for K and V: 1/8 of a bfloat16 KV cache with ``Ts`` 16 and 128-token pages
(``index_cache_bytes``; the vLLM backend takes it out of the KV-cache budget).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..operator.contract import ceil_div
from .prepare import bias_from_run_max

__all__ = ["IndexCache", "WritePlan", "WriteStage", "index_cache_bytes", "page_ids", "token_tags",
           "row_tags"]


def index_cache_bytes(num_pages: int, page: int, stride: int, kv_heads: int,
                      head_size: int) -> int:
    """Bytes of an ``IndexCache`` with these dimensions."""
    return num_pages * (kv_heads * (stride * head_size + page // stride) * 4 + 4 + 8)


# Odd 64-bit constants of a splitmix-style mixer, as signed int64.
_MIX = tuple(c - (1 << 64) if c >= 1 << 63 else c for c in
             (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0xBF58476D1CE4E5B9))


def _mixed(token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x = token_ids.to(torch.int64) * _MIX[0] + (positions + 1) * _MIX[1]
    x = (x ^ ((x >> 31) & 0x1FFFFFFFF)) * _MIX[2]
    return x ^ ((x >> 29) & 0x7FFFFFFFF)


def token_tags(token_ids: torch.Tensor, start: int = 0, carry: int = 0) -> torch.Tensor:
    """[n] int64: for each token of a sequence (``token_ids`` at positions
    ``start ..``; ``carry`` the tag of the token before, 0 at position 0), a
    hash of every token id and position up to it: the running sum of a
    mixed (id, position). Two sequences' tags at a position agree only where
    their tokens up to it agree (up to a 2**-64 collision): a page's tag says
    which prefix wrote it. Integer arithmetic wraps, the same on every
    machine."""
    pos = torch.arange(start, start + token_ids.shape[0], device=token_ids.device)
    return torch.cumsum(_mixed(token_ids, pos), 0) + carry


def row_tags(token_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
             carries: torch.Tensor) -> torch.Tensor:
    """``token_tags`` of several rows at once: row ``i`` is ``lengths[i]``
    tokens of ``token_ids`` at ``positions`` (rows concatenated), continuing
    from ``carries[i]``. Tensor work only, whatever the number of rows."""
    sums = torch.cumsum(_mixed(token_ids, positions.to(torch.int64)), 0)
    lengths = lengths.to(torch.int64)
    starts = torch.cumsum(lengths, 0) - lengths
    before = torch.where(starts > 0, sums[(starts - 1).clamp(min=0)] if sums.numel() else 0, 0)
    return sums + (carries.to(torch.int64) - before).repeat_interleave(lengths)


def page_ids(block_table: torch.Tensor, slot: torch.Tensor, num_pages: int) -> torch.Tensor:
    """[B, len(slot)] int64: the pages at table entries ``slot`` of each row,
    both clamped into range, so that no table content leads out of bounds
    (the entries past a row's pages are never used by the callers)."""
    width = block_table.shape[1]
    ids = block_table[:, slot.clamp(max=max(width - 1, 0))].to(torch.int64)
    return ids.clamp(0, num_pages - 1)


@dataclass(frozen=True)
class WritePlan:
    """One step's write into an indexer cache (``IndexCache.plan``)."""

    num_pages: int  #: pages of the cache it was made for
    slots: torch.Tensor  #: [T] int64, the slots written (negative ones dropped)
    keep: torch.Tensor | None  #: [T0] bool, the tokens with a slot (None: all)
    touched: torch.Tensor  #: pages written
    restart: torch.Tensor  #: pages written from offset 0: zeroed first
    before: torch.Tensor  #: ``filled`` of the touched pages the plan assumed
    after: torch.Tensor  #: ``filled`` of the touched pages after the write
    k_index: torch.Tensor  #: [T] rows of ``ksum`` viewed as [pages * Ts, Hkv, D]
    v_index: torch.Tensor  #: [T] rows of ``vmax`` viewed as [pages * runs, Hkv]
    sources: torch.Tensor | None  #: [T] int64, each token's row of the write's input
    tag_pages: torch.Tensor  #: the pages written ...
    tag_rows: torch.Tensor  #: ... and the input row of each one's last token (its tag)

    def fits(self, cache: "IndexCache", slots: torch.Tensor) -> bool:
        """Whether this plan is the one ``cache.plan(slots)`` would make."""
        if self.keep is not None:
            if slots.shape[0] != self.keep.shape[0]:
                return False
            slots = slots[self.keep]
        if not torch.equal(slots.to(torch.int64), self.slots):
            return False
        if self.touched.numel() == 0:
            return True
        return (cache.filled.shape[0] == self.num_pages
                and torch.equal(cache.filled[self.touched], self.before))


@dataclass
class IndexCache:
    """The indexer's per-page statistics of one attention layer."""

    ksum: torch.Tensor  #: [num_pages, Ts, Hkv, D] float32
    vmax: torch.Tensor  #: [num_pages, page / Ts, Hkv] float32
    filled: torch.Tensor  #: [num_pages] int32
    page: int
    tag: torch.Tensor | None = None  #: [num_pages] int64 (None: not kept)

    @classmethod
    def allocate(cls, num_pages: int, page: int, stride: int, kv_heads: int,
                 head_size: int, device: torch.device | str = "cpu") -> "IndexCache":
        if page % stride:
            raise ValueError(f"IndexCache: the page size ({page}) must be a multiple of "
                             f"stem_stride ({stride})")
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.zeros(num_pages, stride, kv_heads, head_size, **f32),
                   torch.zeros(num_pages, page // stride, kv_heads, **f32),
                   torch.zeros(num_pages, dtype=torch.int32, device=device), page,
                   torch.zeros(num_pages, dtype=torch.int64, device=device))

    @property
    def stride(self) -> int:
        return self.ksum.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.ksum, self.vmax, self.filled, self.tag) if t is not None)

    def plan(self, slots: torch.Tensor) -> "WritePlan":
        """What a write at ``slots`` does to this cache's pages (``write``):
        which pages start afresh, what ``filled`` becomes, and where each
        token's sums and maxima go. Every layer of a step writes the same
        slots into caches in the same state, so one plan serves them all.

        A page's write is good when its offsets are exactly ``start ..
        end - 1``, each once (counted, so that no gap or repeated slot passes),
        in one run of consecutive tokens, and ``start`` is 0 or where the page
        stopped; otherwise the page becomes unusable (``filled = -1``)."""
        slots = slots.to(torch.int64)
        # A page's tokens must come as one run of consecutive offsets (a slot
        # below 0 ends a run): a page in two runs, or a run that skips or
        # repeats an offset, is refused (the device writer's rule too).
        runs_of = torch.where(slots >= 0, slots // self.page, -1)
        prev = torch.cat([runs_of.new_full((1,), -1), runs_of[:-1]])
        starts = (runs_of >= 0) & (runs_of != prev)
        steps = torch.cat([slots.new_full((1,), -1), slots[:-1]])
        broken = runs_of[(runs_of >= 0) & ~starts & (slots != steps + 1)]
        keep = None
        if bool((slots < 0).any()):
            keep = slots >= 0
            slots = slots[keep]
        num_pages, stride, runs = self.ksum.shape[0], self.stride, self.vmax.shape[1]
        pages, offsets = slots // self.page, slots % self.page
        first = torch.full((num_pages,), self.page, dtype=torch.int64, device=slots.device)
        first.scatter_reduce_(0, pages, offsets, "amin")
        last = torch.full((num_pages,), -1, dtype=torch.int64, device=slots.device)
        last.scatter_reduce_(0, pages, offsets, "amax")
        touched = (last >= 0).nonzero().squeeze(1)
        start, end = first[touched], last[touched] + 1
        count = torch.bincount(pages, minlength=num_pages)[touched]
        distinct = torch.bincount(torch.unique(slots) // self.page, minlength=num_pages)[touched]
        before = self.filled[touched]
        fresh = start == 0
        # A page starting afresh is zeroed before its tokens are added; one
        # neither starting nor continuing where it stopped, or with a gap or
        # a repeated slot, is unusable.
        one_run = torch.bincount(runs_of[starts], minlength=num_pages)[touched] == 1
        clean = torch.bincount(broken, minlength=num_pages)[touched] == 0
        ok = (fresh | ((before >= 0) & (start == before))) & (count == end - start) \
            & (distinct == count) & one_run & clean
        sources = None if keep is None else keep.nonzero().squeeze(1)
        is_last = (offsets == last[pages]).nonzero().squeeze(1)
        return WritePlan(num_pages, slots.clone(), keep, touched, touched[fresh], before,
                         torch.where(ok, end, -1).to(torch.int32),
                         pages * stride + offsets % stride, pages * runs + offsets // stride,
                         sources, pages[is_last],
                         is_last if sources is None else sources[is_last])

    def write(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
              plan: "WritePlan | None" = None, *,
              tags: torch.Tensor | None = None) -> "WritePlan | None":
        """Accumulate a step's new tokens: ``key``, ``value [T, Hkv, D]`` (any
        float dtype; tokens in position order within each request) at
        ``slots [T]`` (page id x page size + offset; negative: no slot, skipped).
        ``plan``: another layer's plan of the same step, used where it fits
        (the same slots, this cache's pages in the state it assumed); returns
        the plan used. ``tags [T]`` int64: who wrote each token (``token_tags``);
        each page written keeps its last token's (0 without ``tags``).

        On a GPU (with Triton) the whole write is one kernel that reads
        nothing on the host, deterministic, which a CUDA graph can capture
        (``ops/triton/index_write.py``); it returns None (no host plan)."""
        if self.ksum.device.type != "cpu" and self.tag is not None and _device_kernel():
            from ..operator.ops.triton.index_write import index_write

            norms = torch.linalg.vector_norm(value.float(), dim=-1)
            index_write(self.ksum, self.vmax, self.filled, self.tag, self.page, key, norms,
                        slots, tags)
            return None
        if plan is None or not plan.fits(self, slots):
            plan = self.plan(slots)
        if plan.k_index.numel() == 0:
            return plan
        norms = torch.linalg.vector_norm(value.float(), dim=-1)  # [T0, Hkv]
        if _native_write(self, key, norms, plan, tags):
            return plan
        if plan.sources is not None:
            key, norms = key[plan.sources], norms[plan.sources]
        if plan.restart.numel():
            self.ksum.index_fill_(0, plan.restart, 0.0)
            self.vmax.index_fill_(0, plan.restart, 0.0)
        self.filled[plan.touched] = plan.after
        if self.tag is not None:
            self.tag[plan.tag_pages] = 0 if tags is None else \
                tags[plan.tag_rows].to(self.tag.device)
        num_pages, stride, runs = self.ksum.shape[0], self.stride, self.vmax.shape[1]
        self.ksum.view(num_pages * stride, *self.ksum.shape[2:]).index_add_(
            0, plan.k_index, key.float())
        self.vmax.view(num_pages * runs, self.vmax.shape[2]).scatter_reduce_(
            0, plan.v_index[:, None].expand_as(norms), norms, "amax")
        return plan

    def expected_fill(self, seq_len: int) -> torch.Tensor:
        """[ceil(seq_len / page)] int32: what ``filled`` holds on the pages of
        a sequence of ``seq_len`` tokens whose every token was written."""
        n = ceil_div(seq_len, self.page)
        fill = torch.full((n,), self.page, dtype=torch.int32)
        fill[-1] = seq_len - (n - 1) * self.page
        return fill

    def usable(self, pages: torch.Tensor, expected: torch.Tensor,
               tags: torch.Tensor | None = None) -> torch.Tensor:
        """[len(pages)] bool, on the cache's device (no host read): whether
        each page holds exactly what ``expected`` says (``expected_fill`` of
        each row, concatenated) and, with ``tags``, was last written by a
        token with that tag (``token_tags`` at the page's last token)."""
        pages = pages.to(device=self.filled.device, dtype=torch.int64)
        ok = self.filled[pages] == expected.to(self.filled.device)
        if tags is not None and self.tag is not None:
            ok &= self.tag[pages] == tags.to(self.tag.device)
        return ok

    def complete(self, pages: torch.Tensor, expected: torch.Tensor,
                 tags: torch.Tensor | None = None) -> bool:
        """Whether every page is ``usable`` (one host read)."""
        return bool(self.usable(pages, expected, tags).all())

    def invalidate(self, slots: torch.Tensor) -> None:
        """Mark the pages of ``slots`` unusable (negative slots skipped): a
        write that failed leaves only its own pages in doubt."""
        slots = slots.to(device=self.filled.device, dtype=torch.int64)
        self.filled[slots[slots >= 0] // self.page] = -1

    def inputs(self, pages: torch.Tensor, seq_len: int, block_size: int, oam: bool,
               oam_lambda: float, *,
               stat_runs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``kflat [Hkv, Kb, Ts*D]`` bfloat16 (groups reversed) and ``vbias
        [Hkv, Kb]`` float32 of a sequence's first ``seq_len`` tokens, from the
        entries of its ``pages`` (block-table order), as ``stem_inputs``
        computes them from the tokens themselves (``block_inputs`` of one row)."""
        lens = torch.tensor([seq_len], device=self.ksum.device)
        kflat, vbias = self.block_inputs(pages[None], lens, ceil_div(seq_len, block_size),
                                         block_size, oam, oam_lambda, stat_runs=stat_runs)
        return kflat[0], vbias[0]

    def block_inputs(self, block_table: torch.Tensor, seq_lens: torch.Tensor, kmax: int,
                     block_size: int, oam: bool, oam_lambda: float, *,
                     kflat: bool = True, stat_runs: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``kflat [B, Hkv, kmax, Ts*D]`` bfloat16 and ``vbias [B, Hkv, kmax]``
        float32 of B sequences: row ``b`` holds the first ``seq_lens[b]``
        tokens at pages ``block_table[b]`` (in order). Tensor work only (no
        value is read on the host). Key blocks past a sequence's end, and its
        last block's pages past its last token, count as zeros; table entries
        there are never used (ids are clamped into the cache). A block's pages
        are added in page order, then rounded once to bfloat16. ``kflat=False``
        gives ``(None, vbias)``, for a caller that builds kflat itself.
        ``stat_runs [B]``: the OAM's statistic over that many first runs of
        ``stem_stride`` tokens (``bias_from_run_max``; None: every run)."""
        ids, used = self.table_pages(block_table, seq_lens, kmax * (block_size // self.page))
        flat = self._kflat(ids, used, kmax) if kflat else None
        return flat, self._vbias(ids, used, seq_lens, kmax, block_size, oam, oam_lambda,
                                 stat_runs)

    def _kflat(self, ids: torch.Tensor, used: torch.Tensor, kmax: int) -> torch.Tensor:
        stride, kv_heads, dim = self.ksum.shape[1:]
        ksum = torch.where(used[..., None, None, None], self.ksum[ids], 0.0)
        ksum = ksum.view(ids.shape[0], kmax, -1, stride, kv_heads, dim)
        sums = ksum[:, :, 0]
        for p in range(1, ksum.shape[2]):
            sums = sums + ksum[:, :, p]
        kflat = sums.flip(2).permute(0, 3, 1, 2, 4).reshape(-1, kv_heads, kmax, stride * dim)
        return kflat.to(torch.bfloat16)

    def _vbias(self, ids: torch.Tensor, used: torch.Tensor, seq_lens: torch.Tensor, kmax: int,
               block_size: int, oam: bool, oam_lambda: float,
               stat_runs: torch.Tensor | None = None) -> torch.Tensor:
        stride, kv_heads = self.ksum.shape[1], self.ksum.shape[2]
        if not oam:
            return self.ksum.new_zeros(ids.shape[0], kv_heads, kmax)
        vmax = torch.where(used[..., None, None], self.vmax[ids], 0.0)  # [B, slots, runs, Hkv]
        run_max = vmax.permute(0, 3, 1, 2).reshape(ids.shape[0], kv_heads, -1)
        valid = ceil_div(seq_lens.to(torch.int64), stride)
        return bias_from_run_max(run_max, valid, block_size // stride, oam_lambda,
                                 stat_runs=stat_runs)

    def table_pages(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, used)``, both [B, slots]: the page ids of each row's first
        ``slots`` table entries, clamped into the cache, and whether the row
        has that page (``ceil(seq_lens[b] / page)`` of them)."""
        device = self.ksum.device
        slot = torch.arange(slots, device=device)
        used = slot < ceil_div(seq_lens.to(device=device, dtype=torch.int64), self.page)[:, None]
        return page_ids(block_table, slot, self.ksum.shape[0]), used


class WriteStage:
    """One step's writes into several layers' indexer caches, carried out at once.

    A decode step gives each layer a few tokens. Written layer by layer, the
    fixed cost of each write (checking the plan, the value norms, the native
    call around it) is most of the work, in every layer of every step. A
    stage copies each layer's keys and values aside as its turn comes
    (``put``: one small native copy, the cache untouched) and writes every
    layer in one pass (``flush``): one plan, one norm computation over all
    layers, one native call. The entries are those the layer-by-layer writes
    give, bit for bit.

    The caches change only at ``flush``, so an engine stages a step only
    where nothing reads the step's tokens before it flushes: the vLLM
    backend stages steps without a Stem row and flushes at the next step's
    first write, before any layer reads. CPU only, with the native writer
    (without it the stage cannot be made: RuntimeError); a write the stage
    cannot take (``takes``) is written at once.
    """

    def __init__(self, layers: int, capacity: int, heads: int, dim: int,
                 dtype: torch.dtype) -> None:
        self._lib = _native_lib()
        if self._lib is None:
            from ..operator.ops import native

            raise RuntimeError("WriteStage needs the native indexer-cache writer: "
                               + native.status(native.INDEX_CACHE))
        self.key = torch.empty(layers, capacity, heads, dim, dtype=dtype)
        self.value = torch.empty_like(self.key)
        self._rows = [(self.key[i].data_ptr(), self.value[i].data_ptr())
                      for i in range(layers)]
        self._fits: dict[int, tuple[IndexCache, bool]] = {}  # id(cache) -> (cache, fits)
        self.caches: list[IndexCache] = []
        self.owner: object = None  #: the step the staged writes belong to
        self.slots: torch.Tensor | None = None
        self.tags: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 2 * self.key.numel() * self.key.element_size()

    @property
    def pending(self) -> bool:
        return bool(self.caches)

    def takes(self, cache: "IndexCache", key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether ``put`` can take this layer's write (else write it at once)."""
        layers, capacity, heads, dim = self.key.shape
        return (len(self.caches) < layers and key.dim() == 3 and key.shape[0] <= capacity
                and value.shape == key.shape and key.shape[1] == heads and key.shape[2] == dim
                and key.dtype == value.dtype == self.key.dtype
                and key.device.type == value.device.type == "cpu"
                and key.stride(-1) == value.stride(-1) == 1 and self._cache_fits(cache)
                and (not self.caches or (cache.ksum.shape == self.caches[0].ksum.shape
                                         and cache.vmax.shape == self.caches[0].vmax.shape)))

    def _cache_fits(self, cache: "IndexCache") -> bool:
        """Whether the native writer can write ``cache`` with this stage's
        rows (its tensors do not change after allocation: asked once)."""
        known = self._fits.get(id(cache))
        if known is None or known[0] is not cache:
            heads, dim = self.key.shape[2:]
            fits = (cache.ksum.device.type == "cpu" and cache.tag is not None
                    and tuple(cache.ksum.shape[2:]) == (heads, dim)
                    and all(t.is_contiguous() for t in (cache.ksum, cache.vmax, cache.filled)))
            known = self._fits[id(cache)] = (cache, fits)
        return known[1]

    def put(self, owner: object, cache: "IndexCache", key: torch.Tensor, value: torch.Tensor,
            slots: torch.Tensor, tags: torch.Tensor | None = None) -> None:
        """Stage one layer's write of step ``owner`` (``IndexCache.write``'s
        arguments; every layer of a step has the same slots and tags). A
        stage holds one step: flush before putting another's."""
        if owner is not self.owner:
            if self.pending:
                raise RuntimeError("WriteStage.put: another step's writes are staged; "
                                   "flush them first")
            self.owner, self.slots = owner, slots.to(torch.int64).clone()
            self.tags = None if tags is None else tags.to(torch.int64).clone()
        elif slots.shape[0] != self.slots.shape[0]:
            raise ValueError(f"WriteStage.put: slots ({slots.shape[0]}) must be the step's "
                             f"({self.slots.shape[0]})")
        dst_key, dst_value = self._rows[len(self.caches)]
        k_t, k_h = key.stride()[:2]
        v_t, v_h = value.stride()[:2]
        n, heads, dim = key.shape
        self._lib.stem_stage_rows(dst_key, dst_value, key.data_ptr(), value.data_ptr(),
                                  key.element_size(), n, heads, dim, k_t, k_h, v_t, v_h)
        self.caches.append(cache)

    def flush(self) -> list[tuple["IndexCache", Exception]]:
        """Write every staged layer; empty the stage. A layer whose cache is
        not in the state the plan assumed is written on its own
        (``IndexCache.write``). Returns the layers whose write failed, with
        the error (their pages stay as they were: the caller invalidates)."""
        caches, slots, tags = self.caches, self.slots, self.tags
        self.caches, self.owner, self.slots, self.tags = [], None, None, None
        if not caches:
            return []
        n = slots.shape[0]
        key, value = self.key[:len(caches), :n], self.value[:len(caches), :n]
        failed = []
        try:
            plan = caches[0].plan(slots)
            ok = torch.zeros(len(caches), dtype=torch.int32)
            if plan.k_index.numel():
                norms = torch.linalg.vector_norm(value.float(), dim=-1)  # [L, n, Hkv]
                _native_layers(caches, key, norms, plan, tags, ok)
            else:
                ok.fill_(1)
        except Exception as exc:
            return [(cache, exc) for cache in caches]
        for i in (ok == 0).nonzero().flatten().tolist():
            try:
                caches[i].write(key[i], value[i], slots, tags=tags)
            except Exception as exc:
                failed.append((caches[i], exc))
        return failed


_KEY_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _device_kernel() -> bool:
    """Whether the device writer (Triton) can run; where it cannot, the
    torch path runs instead, reported once."""
    try:
        import triton  # noqa: F401
    except ImportError:
        from ..operator.ops import native

        native.report_once("index write", "the indexer cache is written with torch "
                           "operations on this device (Triton is not installed): host "
                           "reads, no CUDA graph")
        return False
    return True


def _native_write(cache: IndexCache, key: torch.Tensor, norms: torch.Tensor, plan: WritePlan,
                  tags: torch.Tensor | None) -> bool:
    """``IndexCache.write``'s work in one native call (``ops/csrc/index_cache.c``)
    where it can run: CPU tensors, a key of a float dtype with unit stride
    along the head dimension. Returns whether it ran (else the torch path
    runs, with the same bits; reported once)."""
    from ..operator.ops import native

    if key.device.type != "cpu" or key.dtype not in _KEY_DTYPES or key.stride(-1) != 1 \
            or cache.ksum.device.type != "cpu" or key.dim() != 3:
        return False
    lib = native.load(native.INDEX_CACHE)
    if lib is None:
        native.report_fallback("indexer-cache write", native.status(native.INDEX_CACHE))
        return False
    tensors = [cache.ksum, cache.vmax, cache.filled]
    if not all(t.is_contiguous() for t in tensors):
        return False
    norms = norms.contiguous()
    if tags is not None:
        tags = tags.to(torch.int64).contiguous()
    ok = torch.zeros(1, dtype=torch.int32)  # the plan fits the cache (WritePlan.fits): 1
    _native_layers([cache], key[None], norms[None], plan, tags, ok)
    return bool(ok[0])


def _native_lib():
    """The native writer's library (None where it cannot be built)."""
    from ..operator.ops import native

    return native.load(native.INDEX_CACHE)


def _native_layers(caches: list[IndexCache], key: torch.Tensor, norms: torch.Tensor,
                   plan: WritePlan, tags: torch.Tensor | None, ok: torch.Tensor) -> None:
    """``WriteStage.flush``'s native call: layer ``i`` writes ``key[i]``,
    ``norms[i]`` into ``caches[i]`` where its pages are as the plan assumed
    (``ok[i]`` = 1)."""
    from ..operator.ops import native

    ptr = native.pointer
    tables = torch.tensor([[ptr(c.ksum), ptr(c.vmax), ptr(c.filled), ptr(c.tag) or 0]
                           for c in caches], dtype=torch.int64)
    before = plan.before.to(torch.int32).contiguous()
    _native_lib().stem_index_write_layers(
        len(caches), ptr(tables), ptr(before), ptr(ok), ptr(key), _KEY_DTYPES[key.dtype],
        key.stride(0), key.stride(1), key.stride(2), ptr(norms), norms.stride(0),
        ptr(plan.sources), plan.k_index.shape[0], key.shape[2], key.shape[3],
        ptr(plan.k_index), ptr(plan.v_index), ptr(plan.restart), plan.restart.shape[0],
        caches[0].stride, caches[0].vmax.shape[1], ptr(plan.touched), ptr(plan.after),
        plan.touched.shape[0], ptr(plan.tag_pages), ptr(plan.tag_rows), ptr(tags),
        plan.tag_pages.shape[0])
