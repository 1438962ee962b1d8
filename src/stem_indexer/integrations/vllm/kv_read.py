"""Keys and values read back from vLLM's paged CPU cache, in any layout.

vLLM's CPU backend packs each (page, KV head) block of its cache
``[num_pages, kv_heads, page, 2 * head_size]`` for the instruction set it
runs (``layer.isa``): on ``vec`` the keys are stored transposed, on ``amx``
both halves are tile-packed. Rather than restate each packing,
``PageReader.probe`` asks vLLM's own writer where it puts each element. It
writes one page whose elements are small integers (one base-16 digit of the
token's offset in the page, or of the dimension, per pass: exact in every
float dtype; keys below 16, values from 16), reads each block back, and keeps
for every (offset, dimension) of the keys and of the values the one place
that holds it. Where those places are a strided view of the block, with
the offset and the dimension each split at most once into an outer and an
inner index (the ``vec`` layout: keys transposed, values row-major; the
``amx`` layout: keys in tiles of 16 offsets by pairs of dimensions, values
in pairs of offsets), pages are read through that view, a plain strided
copy; otherwise element by element. A packing
that is not such a one-to-one placement, the same for every head (a
quantised cache, say), is refused with the reason, and nothing is read back
from it.

Plain torch: the writer is passed in (``write(key, value, key_cache,
value_cache, slots)``, as ``vllm._custom_ops.cpu_attn_reshape_and_cache``
with the layer's isa).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["PageReader"]

_BASE = 16


def _digits(n: int) -> int:
    """Base-16 digits of the numbers 0 .. n - 1."""
    count = 1
    while _BASE ** count < n:
        count += 1
    return count


@dataclass(frozen=True)
class PageReader:
    """Where vLLM's writer puts each key and value element of a page, for one
    (layout, dtype, page, heads, head size)."""

    page: int
    heads: int
    dim: int
    dtype: torch.dtype
    #: [page * dim] int64: the place, in a (page, head) block of
    #: ``2 * page * dim`` elements, of the key element (offset t, dimension d)
    #: at ``t * dim + d``
    key_at: torch.Tensor
    #: the same for the values
    value_at: torch.Tensor
    #: ``(offset, sizes, strides)`` where ``key_at`` is a strided view of the
    #: block: ``sizes`` ``(page // a, a, dim // b, b)`` split the offset t and
    #: the dimension d into (t // a, t % a, d // b, d % b), and ``key_at`` is
    #: ``offset`` plus those four indices times ``strides``; else None
    key_view: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None
    #: the same for the values
    value_view: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None

    @classmethod
    def probe(cls, write: Callable, page: int, heads: int, dim: int,
              dtype: torch.dtype) -> "PageReader":
        """Ask ``write`` where it puts each element (see the module
        docstring). Raises ``ValueError`` saying why where the packing is not
        a one-to-one placement of the elements."""
        size = 2 * page * dim
        offset = torch.arange(page)[:, None, None].expand(page, heads, dim)
        dimension = torch.arange(dim)[None, None, :].expand(page, heads, dim)
        slots = torch.arange(page, dtype=torch.int64)
        role = None  # per place: 0 a key's, 1 a value's, -1 none
        decoded = {"t": torch.zeros(heads, size, dtype=torch.int64),
                   "d": torch.zeros(heads, size, dtype=torch.int64)}
        for name, index in (("t", offset), ("d", dimension)):
            for k in range(_digits(page if name == "t" else dim)):
                digit = (index // _BASE ** k) % _BASE
                kv = torch.full((1, heads, page, 2 * dim), -1.0, dtype=dtype)
                key_cache, value_cache = kv.view(1, heads, 2 * page, dim).chunk(2, dim=2)
                write(digit.to(dtype).contiguous(), (digit + _BASE).to(dtype).contiguous(),
                      key_cache, value_cache, slots)
                got = kv.view(heads, size).to(torch.int64)
                if not bool(((got >= -1) & (got < 2 * _BASE)).all()):
                    raise ValueError("the writer stores values other than those it was given")
                now = torch.where(got < 0, -1, got // _BASE)
                if role is None:
                    role = now
                elif not torch.equal(role, now):
                    raise ValueError("the writer puts elements in different places for "
                                     "different values")
                decoded[name] += (got % _BASE) * _BASE ** k
        places = []
        for which in (0, 1):
            at = torch.full((heads, page * dim), -1, dtype=torch.int64)
            for h in range(heads):
                where = (role[h] == which).nonzero().flatten()
                element = decoded["t"][h, where] * dim + decoded["d"][h, where]
                if where.numel() != page * dim or torch.unique(element).numel() != page * dim:
                    raise ValueError(f"the writer's {('keys', 'values')[which]} do not take "
                                     "one place per element")
                at[h, element] = where
            if not bool((at == at[:1]).all()):
                raise ValueError("the writer packs the heads differently")
            places.append(at[0].clone())
        return cls(page, heads, dim, dtype, places[0], places[1],
                   _strided(places[0], page, dim), _strided(places[1], page, dim))

    def read(self, kv_cache: torch.Tensor, pages: torch.Tensor,
             values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The keys and values of whole ``pages`` of ``kv_cache``, each
        ``[len(pages) * page, heads, dim]`` (page after page, in token order);
        the values None unless ``values``."""
        k, v = self.read_heads(kv_cache, pages, values)
        return k.transpose(0, 1), None if v is None else v.transpose(0, 1)

    def read_heads(self, kv_cache: torch.Tensor, pages: torch.Tensor,
                   values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``read``, head-major: each ``[heads, len(pages) * page, dim]``,
        contiguous (what an attention kernel takes)."""
        if (kv_cache.dim() != 4 or tuple(kv_cache.shape[1:]) != (self.heads, self.page,
                                                                  2 * self.dim)
                or kv_cache.dtype != self.dtype):
            raise ValueError(f"PageReader.read: kv_cache must be [pages, {self.heads}, "
                             f"{self.page}, {2 * self.dim}] {self.dtype}; got "
                             f"{tuple(kv_cache.shape)} {kv_cache.dtype}")
        pages = pages.to(torch.int64)
        flat = kv_cache.view(kv_cache.shape[0], self.heads, -1)
        n = pages.shape[0]
        # The pages' blocks gathered whole (contiguous copies), then each half
        # put in token order by one strided copy (a gather through the
        # strided view and then a reshape made two strided copies).
        blocks = flat.index_select(0, pages)

        def tokens(at: torch.Tensor, view) -> torch.Tensor:
            if view is not None:
                offset, sizes, strides = view
                x = blocks.as_strided((n, self.heads, *sizes),
                                      (blocks.stride(0), blocks.stride(1), *strides),
                                      blocks.storage_offset() + offset)
            else:
                x = blocks[:, :, at].view(n, self.heads, self.page, self.dim)
            out = torch.empty((self.heads, n, *x.shape[2:]), dtype=x.dtype, device=x.device)
            out.copy_(x.transpose(0, 1))
            return out.view(self.heads, n * self.page, self.dim)

        return (tokens(self.key_at, self.key_view),
                tokens(self.value_at, self.value_view) if values else None)


def _strided(at: torch.Tensor, page: int, dim: int):
    """``(offset, sizes, strides)`` (``PageReader.key_view``) where ``at`` is
    a strided view of the block with the offset and the dimension each split
    once at a power of two (the smallest splits that fit), else None."""
    grid = at.view(page, dim)
    offset = int(grid[0, 0])

    def step(t: int, d: int) -> int:
        return int(grid[t, d]) - offset if t < page and d < dim else 0

    t, d = torch.arange(page), torch.arange(dim)
    for a in (x for x in (2**i for i in range(page.bit_length())) if page % x == 0):
        for b in (x for x in (2**i for i in range(dim.bit_length())) if dim % x == 0):
            strides = (step(a, 0), step(1, 0) if a > 1 else 0, step(0, b),
                       step(0, 1) if b > 1 else 0)
            expect = (offset + (t // a * strides[0] + t % a * strides[1])[:, None]
                      + (d // b * strides[2] + d % b * strides[3])[None, :])
            if torch.equal(grid, expect):
                return offset, (page // a, a, dim // b, b), strides
    return None
