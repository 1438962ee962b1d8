"""The indexer's key side read from an indexer cache through a block table.

The paged entry point (``paged.py``) gets the keys' statistics as an engine
keeps them: an ``IndexCache`` per layer (``index_cache.py``: per page and KV
head, the float32 key sums per stride group) and a block table per row.
``kflat_kernel`` turns them into the indexer's ``kflat [B, Hkv, Kmax, Ts*D]``
bfloat16 in one pass: one program per (key block, KV head, row) reads the
block's ``Bs / page`` pages through the table, adds their sums in page
order, rounds once to bfloat16 and writes the contract's layout (group ``s``
at slot ``Ts-1-s``). The score and selection kernels (``kernels.py``) then
run on it unchanged.

Why a pass of its own rather than page reads inside the score kernel: that
kernel reads every key tile once per row block of queries, and from pages
each bfloat16 element would cost ``Bs / page`` float32 loads (8 with 16-token
pages: 16 times the bytes). Here each page's sums are read once, and
``kflat`` (``Ts * D`` bfloat16 per block and KV head, a sixteenth of the
keys' own bytes at the defaults) is written once.

Exactness: the same float32 additions in the same order as
``IndexCache.block_inputs`` (the first page's sums, then each next page's
added; missing pages as +0.0), and the same round-to-nearest-even to
bfloat16, so ``kflat`` equals the torch path's bit for bit. Table entries are
read only for a row's pages and clamped into the cache, so no table content
leads out of bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...contract import fail
from .launch import Launch, pow2_at_least, require_device

__all__ = ["kflat_kernel", "kflat_launch", "paged_kflat"]


@triton.jit
def _bf16_bits(x):
    """The bfloat16 bit pattern of float32 ``x``, rounded to nearest even (as
    torch rounds; Triton's interpreter would truncate a plain cast): int16."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def kflat_kernel(ksum_ptr, table_ptr, seq_ptr, out_ptr, NUM_PAGES, TABLE_W, NK, KMAX, PAGE,
                 TS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 PER_BLOCK: tl.constexpr):
    """kflat of key block ``program_id(0)``, KV head ``program_id(1)``, row
    ``program_id(2)``: ``ksum`` is [NUM_PAGES, TS, NK, D] float32
    (contiguous), ``table`` [B, TABLE_W] int32, ``seq`` [B] int32, ``out``
    [B, NK, KMAX, TS * D] bfloat16 written as its int16 bits."""
    j = tl.program_id(0)
    n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    pages = (tl.load(seq_ptr + b) + PAGE - 1) // PAGE  # pages the row holds
    s = tl.arange(0, TS)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    acc = tl.zeros((TS, BLOCK_D), tl.float32)
    for p in tl.static_range(PER_BLOCK):
        slot = j * PER_BLOCK + p
        used = slot < pages
        page = tl.load(table_ptr + b * TABLE_W + tl.minimum(slot, TABLE_W - 1), mask=used,
                       other=0)
        page = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1).to(tl.int64)
        x = tl.load(ksum_ptr + ((page * TS + s) * NK + n) * D + d, mask=used & (d < D),
                    other=0.0)
        acc = x if p == 0 else acc + x
    row = out_ptr + ((b * NK + n) * KMAX + j) * (TS * D)
    tl.store(row + (TS - 1 - s) * D + d, _bf16_bits(acc), mask=d < D)


def paged_kflat(ksum: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                kmax: int, block_size: int, page: int) -> torch.Tensor:
    """``kflat [B, Hkv, kmax, Ts*D]`` bfloat16 of the rows of ``block_table``
    (``seq_lens [B]`` int32 tokens each) from an indexer cache's ``ksum``
    ([pages, Ts, Hkv, D] float32, contiguous): ``IndexCache.block_inputs``'s
    kflat, on the device, without reading a value on the host."""
    who = "paged_kflat"
    require_device(who, ksum.device)
    if block_size % page:
        fail(who, "block_size", f"must be a multiple of the page size ({page})", block_size)
    stride, kv_heads, dim = ksum.shape[1:]
    if stride & (stride - 1):
        fail(who, "ksum", "must have a power-of-two stem_stride (its dim 1)", stride)
    batch = block_table.shape[0]
    out = torch.empty(batch, kv_heads, kmax, stride * dim, dtype=torch.int16,
                      device=ksum.device)
    if out.numel() == 0:
        return out.view(torch.bfloat16)
    kflat_launch(ksum.contiguous(), block_table.to(torch.int32).contiguous(),
                 seq_lens.to(torch.int32).contiguous(), out, block_size, page)()
    return out.view(torch.bfloat16)


def kflat_launch(ksum: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor,
                 out: torch.Tensor, block_size: int, page: int) -> Launch:
    """The launch that fills ``out`` ([B, Hkv, kmax, Ts*D] int16) from
    contiguous arguments; works on ``meta`` tensors (``aot.py``)."""
    num_pages, stride, kv_heads, dim = ksum.shape
    batch, _, kmax, _ = out.shape
    return Launch(kflat_kernel, (kmax, kv_heads, batch),
                  (ksum, table, seq_lens, out, num_pages, max(table.shape[1], 1), kv_heads,
                   kmax, page),
                  dict(TS=stride, D=dim, BLOCK_D=pow2_at_least(dim),
                       PER_BLOCK=block_size // page), {})
