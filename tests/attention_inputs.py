"""Inputs shared by the attention tests (``test_attention.py``, ``test_flash.py``)."""

from __future__ import annotations

import torch

# Blocks small enough that a few hundred tokens are past the budget's
# keep-everything range (56 blocks), so Stem really drops blocks.
SMALL = dict(stem_block_size=16, stem_stride=4)


def qkv(batch, hq, hkv, sq, skv, dim, seed, dtype=torch.float32):
    """Random q [batch, hq, sq, dim], k and v [batch, hkv, skv, dim]."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, hq, sq, dim, generator=gen).to(dtype),
            torch.randn(batch, hkv, skv, dim, generator=gen).to(dtype),
            torch.randn(batch, hkv, skv, dim, generator=gen).to(dtype))
