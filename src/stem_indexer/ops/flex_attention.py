"""Block-sparse attention through FlexAttention: the indexer's lists as a ``BlockMask``.

``block_mask`` turns ``(sparse_indices, sparse_seq_len)`` into a
``torch.nn.attention.flex_attention.BlockMask`` straight from the lists (no
(B, H, Qb, Kb) membership tensor): a listed block that every valid query
token of its row sees whole goes to the *full* lists, where FlexAttention
evaluates no mask at all; only the others (the causal diagonal, a key tail)
go to the *partial* lists, with the token mask as ``mask_mod`` (valid keys,
right-down causal). The mask is for the forward pass (no transposed q-block
lists are built).

``flex_attention_forward`` runs compiled FlexAttention with it (inductor's
Triton kernel on CUDA, its C++ template on CPU). Eager FlexAttention ignores
the block lists and evaluates ``mask_mod`` densely, so it is never used here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

from ..contract import ceil_div

_compiled = None


def available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def block_mask(sparse_indices: torch.Tensor, sparse_seq_len: torch.Tensor, *, block_size: int,
               causal: bool = True, q_len: int, kv_len: int, q_lens: torch.Tensor | None = None,
               kv_lens: torch.Tensor | None = None) -> "BlockMask":
    """A FlexAttention ``BlockMask`` for the indexer's selection.

    Args:
        sparse_indices: [B, Hq, ceil(q_len/block_size), W] int: each row's key
            blocks, ascending, valid for the first ``sparse_seq_len`` entries
            (the indexer's output; W is at most ceil(kv_len/block_size)).
        sparse_seq_len: [B, Hq, ceil(q_len/block_size)] int.
        block_size: tokens per block, for queries and keys alike.
        causal: right-down aligned token mask: query t of a sequence with
            ``q_lens[b]`` queries and ``kv_lens[b]`` keys sees key j iff
            ``j <= t + kv_lens[b] - q_lens[b]``.
        q_len, kv_len: the padded sequence lengths of the query and key tensors.
        q_lens, kv_lens: [B] valid tokens per batch (default ``q_len``,
            ``kv_len``); keys at or past ``kv_lens[b]`` are masked.

    The lists are read on the device of ``sparse_indices`` (no host sync).
    """
    from torch.nn.attention.flex_attention import BlockMask

    device = sparse_indices.device
    batch, heads, qb, _ = sparse_indices.shape
    kb = ceil_div(kv_len, block_size)
    q_lens = _lengths(q_lens, batch, q_len, device)
    kv_lens = _lengths(kv_lens, batch, kv_len, device)
    offset = kv_lens - q_lens

    width = min(sparse_indices.shape[-1], kb)
    slot = torch.arange(width, device=device)
    idx = sparse_indices[..., :width].long()
    listed = slot < sparse_seq_len[..., None].long()
    first_query = (torch.arange(qb, device=device) * block_size)[None, None, :, None]
    whole = (idx + 1) * block_size <= kv_lens[:, None, None, None]
    if causal:
        whole &= (idx + 1) * block_size - 1 <= first_query + offset[:, None, None, None]
    full, full_num = _compact(idx, listed & whole, kb)
    partial, partial_num = _compact(idx, listed & ~whole, kb)

    def mask_mod(b, h, q_idx, kv_idx):
        visible = kv_idx < kv_lens[b]
        if causal:
            visible = visible & (kv_idx <= q_idx + offset[b])
        return visible

    return BlockMask.from_kv_blocks(partial_num, partial, full_num, full, BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(q_len, kv_len),
                                    compute_q_blocks=False)


def _lengths(lens, batch: int, default: int, device) -> torch.Tensor:
    if lens is None:
        return torch.full((batch,), default, dtype=torch.int64, device=device)
    return torch.as_tensor(lens, device=device).to(torch.int64)


def _compact(idx: torch.Tensor, keep: torch.Tensor, kb: int):
    """The kept entries of each row moved to its front (order kept), padded
    with 0 to ``kb`` columns (FlexAttention's list width); and their count.
    A running count gives each kept entry its place: no sort."""
    place = torch.where(keep, keep.cumsum(-1) - 1, kb)  # dropped entries: a spare column
    out = torch.zeros(*idx.shape[:-1], kb + 1, dtype=torch.int32, device=idx.device)
    out.scatter_(-1, place, torch.where(keep, idx, 0).to(torch.int32))
    return out[..., :kb], keep.sum(dim=-1, dtype=torch.int32)


# FlexAttention kernel options on CUDA, chosen on an H200 with
# benchmarks/gpu_flex_tune.py: TMA loads and 128 x 128 tiles (the Stem block)
# took the 128K prefill's sparse attention from 81.9 to 76.2 ms.
CUDA_KERNEL_OPTIONS: dict | None = dict(USE_TMA=True, BLOCK_M=128, BLOCK_N=128, num_warps=8,
                                        num_stages=2)


def flex_attention_forward(q, k, v, mask, scale: float, softcap: float | None = None,
                           return_lse: bool = False, kernel_options: dict | None = None):
    """Compiled FlexAttention of q [B,Hq,Sq,D], k/v [B,Hkv,Skv,D] under ``mask``:
    ``(out, lse)``, lse float32 [B, Hq, Sq] (natural log) or None when not
    asked for (inductor's CPU template cannot give it). ``softcap`` caps the
    scaled scores as ``softcap * tanh(score / softcap)`` (a score_mod)."""
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)
    if kernel_options is None and q.is_cuda:
        kernel_options = CUDA_KERNEL_OPTIONS
    out = _compiled(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale,
                    enable_gqa=q.shape[1] != k.shape[1], return_lse=return_lse,
                    kernel_options=kernel_options)
    return out if return_lse else (out, None)
