"""Metadata: the work plan the metadata op builds and the main op consumes.

Size (docs/CONTRACT.md section 6, kept from the NPU operator)::

    M = AlignUp(16 + B * kv_heads * (36 + 72) * 16, 4096)   int32 elements

Layout (version 2), all int32::

    [0, 16)                header (see ``Header``)
    [16, 16 + B)           q_seq_lens the plan was built for
    [16 + B, 16 + 2B)      kv_seq_lens the plan was built for
    [16 + 2B, ...)         tiles, 4 int32 each: (batch, q_block_begin,
                           q_block_end, key_blocks_visible_to_last_row)
    rest                   zero

A tile is a run of query blocks of one batch whose scores (for every query
head, against every key block its last row sees) and float32 query copy fit
a fixed budget. Rows that see no key block at all get no tile.
When the metadata's fixed size cannot hold that many tiles (extreme shapes:
tens of thousands of query blocks), tiles grow to fit and the backend runs
each in budget-sized steps; the tiles then still partition the rows. The
plan follows from the header and the lengths (the plan policy below), so the
main op recomputes it and compares (``read_plan``): the stored plan is what
the backends run, and its agreement with the inputs is checked on every call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import contract
from .contract import StemIndexerInputError, ceil_div

HEADER_SIZE = 16
AIC_CORE_NUM = 36
AIV_CORE_NUM = 72
CORE_STRIDE = 16
ALIGN_SIZE = 4096

MAGIC = 0x5354454D  # "STEM"
INT32_MAX = 2**31 - 1
VERSION = 2
TILE_FIELDS = 4

# Plan policy. Work budget of one tile: score elements (query rows x the key
# blocks its last row sees, all query heads). The CPU path keeps one float32 score
# buffer of this size and temporaries that are fractions of it.
TILE_ELEMENTS = 1 << 24
# At most this many query blocks per tile, so that the causal triangle a tile
# spans beyond its first row's visible range stays small.
TILE_ROWS_MAX = 64
# Bytes of the float32 operand copies of one tile (its query rows, one chunk
# of key blocks): the tile's rows and the key chunk are sized to fit.
OPERAND_BYTES = 32 << 20


def tile_rows(q_heads: int, dim_qkflat: int, width):
    """Query blocks per tile for rows ``width`` key blocks wide (int or tensor)."""
    by_scores = TILE_ELEMENTS // (q_heads * width)
    by_operand = max(1, OPERAND_BYTES // (4 * q_heads * dim_qkflat))
    if isinstance(by_scores, torch.Tensor):
        return by_scores.clamp(min=1, max=min(TILE_ROWS_MAX, by_operand))
    return max(1, min(by_scores, TILE_ROWS_MAX, by_operand))


def metadata_size(batch, kv_heads):
    """Number of int32 elements of the metadata tensor (works on SymInts)."""
    raw = HEADER_SIZE + batch * kv_heads * (AIC_CORE_NUM + AIV_CORE_NUM) * CORE_STRIDE
    return ceil_div(raw, ALIGN_SIZE) * ALIGN_SIZE


def check_size(metadata: torch.Tensor, batch, kv_heads) -> None:
    """docs/CONTRACT.md section 4: ``metadata`` has the metadata op's size for
    this batch and these KV heads (static: fakes too)."""
    expected = metadata_size(batch, kv_heads)
    if metadata.numel() != expected:
        contract.fail("stem_indexer", "metadata", f"must have {expected} elements for batch "
                      f"{batch} and {kv_heads} kv heads (the metadata op's size)",
                      metadata.numel())


@dataclass(frozen=True)
class Header:
    """What a metadata tensor was built for. Field order is the storage order."""

    batch: int
    q_heads: int
    kv_heads: int
    causal: int
    stem_block_size: int
    dim_qkflat: int
    window_size: int
    num_tiles: int

    @classmethod
    def recording(cls, batch, q_heads, kv_heads, causal, stem_block_size, dim_qkflat,
                  window_size, num_tiles) -> "Header":
        """The header as stored: values past int32 saturate at INT32_MAX.

        That loses nothing: lengths are int32, so every block size or window
        of at least INT32_MAX tokens/blocks plans and selects alike.
        """
        values = (batch, q_heads, kv_heads, int(causal), stem_block_size, dim_qkflat,
                  window_size, num_tiles)
        return cls(*(min(v, INT32_MAX) for v in values))

    # header slots: 0 magic, 1 version, 2..9 the fields above, 10..15 reserved
    def to_list(self) -> list[int]:
        fields = [self.batch, self.q_heads, self.kv_heads, self.causal,
                  self.stem_block_size, self.dim_qkflat, self.window_size, self.num_tiles]
        return [MAGIC, VERSION, *fields] + [0] * (HEADER_SIZE - 2 - len(fields))

    @classmethod
    def from_tensor(cls, metadata: torch.Tensor) -> "Header":
        h = metadata[:HEADER_SIZE].tolist()
        if h[0] != MAGIC or h[1] != VERSION:
            raise StemIndexerInputError(
                "stem_indexer: metadata was not built by npu_stem_indexer_metadata "
                f"(version {VERSION}); got magic {h[0]:#x}, version {h[1]}"
            )
        return cls(*h[2:10])


def _plan(q_lens: torch.Tensor, kv_lens: torch.Tensor, q_heads: int, kv_heads: int,
          causal: bool, block_size: int, dim_qkflat: int, capacity: int) -> torch.Tensor:
    """Tiles (num_tiles, 4) int64 for host lengths; see the module docstring."""
    qb = ceil_div(q_lens.to(torch.int64), block_size)
    kb = ceil_div(kv_lens.to(torch.int64), block_size)
    live = (qb > 0) & (kb > 0)
    # First query block that sees any key block (all of them when not causal).
    first = (qb - kb).clamp(min=0) if causal else torch.zeros_like(qb)
    rows = torch.where(live, qb - first, 0)
    width = kb.clamp(min=1)
    per_tile = tile_rows(q_heads, dim_qkflat, width)
    per_tile = torch.minimum(per_tile, rows.clamp(min=1))
    while int(ceil_div(rows, per_tile).sum()) > capacity:  # only for extreme shapes
        per_tile = torch.minimum(per_tile * 2, rows.clamp(min=1))
    counts = ceil_div(rows, per_tile)

    batch = torch.repeat_interleave(torch.arange(len(qb)), counts)
    starts = torch.cumsum(counts, 0) - counts
    nth = torch.arange(int(counts.sum())) - starts[batch]
    i0 = first[batch] + nth * per_tile[batch]
    i1 = torch.minimum(i0 + per_tile[batch], qb[batch])
    kend = contract.visible_blocks(i1 - 1, qb[batch], kb[batch], causal)
    return torch.stack([batch, i0, i1, kend], dim=1)


def build_metadata(q_lens: torch.Tensor, kv_lens: torch.Tensor, q_heads: int, kv_heads: int,
                   causal: bool, stem_block_size: int, dim_qkflat: int,
                   window_size: int) -> torch.Tensor:
    """The metadata tensor (CPU, int32) for host copies of the lengths."""
    batch = q_lens.shape[0]
    size = metadata_size(batch, kv_heads)
    lens_end = HEADER_SIZE + 2 * batch
    tiles = _plan(q_lens, kv_lens, q_heads, kv_heads, causal, stem_block_size, dim_qkflat,
                  (size - lens_end) // TILE_FIELDS)
    header = Header.recording(batch, q_heads, kv_heads, causal, stem_block_size, dim_qkflat,
                              window_size, tiles.shape[0])

    out = torch.zeros(size, dtype=torch.int32)
    out[:HEADER_SIZE] = torch.tensor(header.to_list(), dtype=torch.int32)
    out[HEADER_SIZE:HEADER_SIZE + batch] = q_lens
    out[HEADER_SIZE + batch:lens_end] = kv_lens
    out[lens_end:lens_end + tiles.numel()] = tiles.flatten().to(torch.int32)
    return out


def read_plan(metadata: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor,
              q_heads: int, kv_heads: int, causal: bool, stem_block_size: int,
              dim_qkflat: int, window_size: int) -> torch.Tensor:
    """Check that ``metadata`` was built for these inputs; return its tiles.

    All tensors are host (CPU) copies. The plan is a function of the header's
    fields and the lengths alone, so it is recomputed here and the stored copy
    serves as a checksum: a metadata tensor built for other inputs, or whose
    header or plan was altered, is rejected (``StemIndexerInputError`` naming
    the first mismatch), never used.
    """
    batch = q_lens.shape[0]
    expected_size = metadata.numel()  # checked by check_size
    header = Header.from_tensor(metadata)
    wanted = Header.recording(batch, q_heads, kv_heads, causal, stem_block_size, dim_qkflat,
                              window_size, header.num_tiles)
    for field in ("batch", "q_heads", "kv_heads", "causal", "stem_block_size", "dim_qkflat",
                  "window_size"):
        got, value = getattr(header, field), getattr(wanted, field)
        if got != value:
            raise StemIndexerInputError(
                f"stem_indexer: metadata was built for {field}={got}, but this call has "
                f"{field}={value}; rebuild it with npu_stem_indexer_metadata")
    for name, lens, start in (("q_seq_lens", q_lens, HEADER_SIZE),
                              ("kv_seq_lens", kv_lens, HEADER_SIZE + batch)):
        if not torch.equal(metadata[start:start + batch], lens):
            raise StemIndexerInputError(
                f"stem_indexer: metadata was built for other {name}; "
                "rebuild it with npu_stem_indexer_metadata")
    lens_end = HEADER_SIZE + 2 * batch
    tiles = _plan(q_lens, kv_lens, q_heads, kv_heads, causal, stem_block_size, dim_qkflat,
                  (expected_size - lens_end) // TILE_FIELDS)
    stored = metadata[lens_end:lens_end + tiles.numel()]
    if (metadata[:HEADER_SIZE].tolist() != dataclasses.replace(
            wanted, num_tiles=tiles.shape[0]).to_list()
            or not torch.equal(stored, tiles.flatten().to(torch.int32))):
        raise StemIndexerInputError(
            "stem_indexer: metadata work plan does not match its header (corrupted?); "
            "rebuild it with npu_stem_indexer_metadata")
    return tiles
