"""The indexer cache's write on the device, in one kernel a CUDA graph can hold.

``IndexCache.write`` on the CPU plans the write on the host (which pages
start afresh, what each page's count becomes) and then adds. On CUDA that
plan would read values on the host several times per layer and step, which
a CUDA graph cannot capture, and atomic adds would sum in no fixed order.
``index_write_kernel`` does the whole write on the device instead:

* one program per token; the program of a page's *first* token in the
  write owns that page (the tokens of one page are consecutive in a step:
  one sequence writes a page, in position order) and every other program
  returns at once;
* the owner walks its page's tokens in order: the page starts afresh
  (zeroed) when the first offset is 0, continues when it equals the
  page's count, and becomes unusable (count -1) otherwise, or when its
  offsets do not follow each other one by one, or when the same page
  appears elsewhere in the write; a slot below 0 ends a run;
* it adds each token's key to its stride group's float32 sums in token
  order (the CPU path's order, so the same bits), raises its run's value
  maximum, and stores the count and the tag of the page's last token.

Every page is written by one program in a fixed order: the result does not
depend on scheduling. Nothing is read on the host, so the launch can be
captured and replayed. The value norms come from torch
(``vector_norm(value.float())``, the reduction the one-shot path uses).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...contract import fail
from .launch import Launch, pow2_at_least, require_device

__all__ = ["index_write_kernel", "index_write"]


@triton.jit
def index_write_kernel(key_ptr, KEY_T, KEY_H, norm_ptr, slot_ptr, tags_ptr, ksum_ptr, vmax_ptr,
                       filled_ptr, tag_ptr, T, D, PAGE: tl.constexpr, RUNS: tl.constexpr,
                       NK: tl.constexpr, TS: tl.constexpr, BLOCK_D: tl.constexpr,
                       HAS_TAGS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    prev = tl.load(slot_ptr + tl.maximum(t - 1, 0))
    page = slot // PAGE
    owner = (slot >= 0) & ((t == 0) | (prev < 0) | (prev // PAGE != page))
    if owner:
        d = tl.arange(0, BLOCK_D)
        start = slot % PAGE
        before = tl.load(filled_ptr + page)
        ok = (start == 0) | ((before >= 0) & (start == before))
        if start == 0:  # the page starts afresh
            for r in tl.static_range(TS * NK):
                tl.store(ksum_ptr + (page * TS * NK + r) * D + d, tl.zeros([BLOCK_D],
                                                                         tl.float32),
                         mask=d < D)
            for r in tl.static_range(RUNS * NK):
                tl.store(vmax_ptr + page * RUNS * NK + r, 0.0)
        # The page's tokens, in order, while the slots stay on it.
        count = tl.full([], 0, tl.int64)
        u = t
        last_tag = tl.full([], 0, tl.int64)
        going = t < T
        while going:
            s = tl.load(slot_ptr + u)
            if s // PAGE == page:
                if s >= 0:
                    off = s % PAGE
                    ok = ok & (off == start + count)
                    group = off % TS
                    run = off // TS
                    for n in tl.static_range(NK):
                        k = tl.load(key_ptr + u * KEY_T + n * KEY_H + d, mask=d < D,
                                    other=0.0).to(tl.float32)
                        row = ksum_ptr + ((page * TS + group) * NK + n) * D + d
                        tl.store(row, tl.load(row, mask=d < D, other=0.0) + k, mask=d < D)
                        x = tl.load(norm_ptr + u * NK + n)
                        at = vmax_ptr + (page * RUNS + run) * NK + n
                        cur = tl.load(at)
                        tl.store(at, tl.where((x > cur) | (x != x), x, cur))
                    if HAS_TAGS:
                        last_tag = tl.load(tags_ptr + u)
                    count += 1
                    u += 1
                    going = u < T
                else:
                    going = False
            else:
                going = False
        # The same page anywhere else in the write (its owner then being
        # another program too): its entry cannot be trusted, whichever
        # program stores last.
        v = tl.full([], 0, tl.int64)
        while v < T:
            w = tl.load(slot_ptr + v)
            ok = ok & ((v >= t) & (v < u) | (w < 0) | (w // PAGE != page))
            v += 1
        tl.store(filled_ptr + page, tl.where(ok, start + count, -1).to(tl.int32))
        tl.store(tag_ptr + page, last_tag)


def index_write(ksum: torch.Tensor, vmax: torch.Tensor, filled: torch.Tensor,
                tag: torch.Tensor, page: int, key: torch.Tensor, norms: torch.Tensor,
                slots: torch.Tensor, tags: torch.Tensor | None) -> None:
    """Write ``key [T, Hkv, D]`` (unit stride along D), its value norms
    ``norms [T, Hkv]`` float32 and ``tags [T]`` int64 (None: 0) at ``slots
    [T]`` into an indexer cache's tensors, in one launch, reading nothing on
    the host (``IndexCache.write`` on a device)."""
    who = "IndexCache.write"
    require_device(who, ksum.device)
    if key.stride(-1) != 1:
        fail(who, "key", "must have unit stride along its last dimension", key.stride())
    if slots.shape[0] == 0:
        return
    index_write_launch(ksum, vmax, filled, tag, page, key, norms.contiguous(),
                       slots.to(torch.int64).contiguous(), tags)()


def index_write_launch(ksum, vmax, filled, tag, page: int, key, norms, slots,
                       tags) -> Launch:
    """The launch of ``index_write`` on contiguous cache tensors."""
    tokens = slots.shape[0]
    num_pages, stride, kv_heads, dim = ksum.shape
    has_tags = tags is not None
    tags = tags.to(torch.int64).contiguous() if has_tags else slots
    return Launch(index_write_kernel, (tokens,),
                  (key, key.stride(0), key.stride(1), norms, slots, tags, ksum, vmax, filled,
                   tag, tokens, dim),
                  dict(PAGE=page, RUNS=vmax.shape[1], NK=kv_heads, TS=stride,
                       BLOCK_D=pow2_at_least(dim), HAS_TAGS=has_tags), {})
