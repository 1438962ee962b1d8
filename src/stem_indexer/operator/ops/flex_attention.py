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
the block lists and evaluates ``mask_mod`` densely (the whole score matrix),
so it is never used here: the compiled function has dynamic shapes (one
compilation serves every sequence length) and a call that would exceed the
recompile limit raises instead of running eagerly.

On CUDA the Triton kernel's tiles must divide the BlockMask's block size and
be powers of two of at least 16; ``cuda_kernel_options`` picks them (and TMA,
stages, warps) from the block size, head dims, dtype and device.
``block_mask`` builds the mask on the Stem blocks themselves where such a
tile exists, and otherwise (a block size that is not a multiple of 16) on
coarser blocks of ``lcm(block_size, 16)`` tokens whose ``mask_mod`` looks up
the exact selection (a (B, H, Qb, Kb) membership table; reported once).
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

from ..contract import ceil_div, fail

_compiled = None


def available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def choose_mask_block_size(block_size: int, device_type: str) -> int:
    """The BlockMask block size ``block_mask`` uses for Stem blocks of
    ``block_size`` tokens on a device of ``device_type``: the Stem block
    itself, except on CUDA when no Triton tile (a power of two >= 16) divides
    it; then ``lcm(block_size, 16)``, a whole number of Stem blocks."""
    if device_type == "cuda" and _tile(block_size) < MIN_TILE:
        return block_size * MIN_TILE // math.gcd(block_size, MIN_TILE)
    return block_size


def block_mask(sparse_indices: torch.Tensor, sparse_seq_len: torch.Tensor, *, block_size: int,
               causal: bool = True, q_len: int, kv_len: int, q_lens: torch.Tensor | None = None,
               kv_lens: torch.Tensor | None = None,
               mask_block_size: int | None = None) -> "BlockMask":
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
        mask_block_size: the BlockMask's block size: ``block_size`` (the
            lists as they are) or a multiple of it (coarse blocks, each
            listed where any of its Stem block pairs is, with the exact
            selection in ``mask_mod``). Default
            ``choose_mask_block_size(block_size, device)``: the Stem block
            unless the CUDA kernel cannot tile it.

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
    grid = mask_block_size or choose_mask_block_size(block_size, device.type)
    if not isinstance(grid, int) or isinstance(grid, bool) or grid < block_size \
            or grid % block_size:
        fail("block_mask", "mask_block_size", f"must be a multiple of block_size ({block_size})",
             grid)
    if grid != block_size:
        return _coarse_block_mask(idx, listed, block_size=block_size, grid=grid,
                                  causal=causal, q_len=q_len, kv_len=kv_len, kv_lens=kv_lens,
                                  offset=offset)
    first_query = (torch.arange(qb, device=device) * block_size)[None, None, :, None]
    whole = (idx + 1) * block_size <= kv_lens[:, None, None, None]
    if causal:
        whole &= (idx + 1) * block_size - 1 <= first_query + offset[:, None, None, None]
    full, full_num = _compact(idx, listed & whole, kb)
    partial, partial_num = _compact(idx, listed & ~whole, kb)
    return BlockMask.from_kv_blocks(partial_num, partial, full_num, full, BLOCK_SIZE=block_size,
                                    mask_mod=_mask_mod(kv_lens, offset, causal),
                                    seq_lengths=(q_len, kv_len), compute_q_blocks=False)


def _mask_mod(kv_lens: torch.Tensor, offset: torch.Tensor, causal: bool,
              member: torch.Tensor | None = None, heads: int = 0, rows: int = 0,
              cols: int = 0, block_size: int = 1):
    """FlexAttention's ``mask_mod``: the key is valid (``kv_idx < kv_lens[b]``),
    with ``causal`` right-down visible (``kv_idx <= q_idx + offset[b]``), and
    with ``member`` (the flat [B, heads, rows, cols] table of listed Stem
    block pairs) its pair listed. The sizes stay plain ints (constants to
    the compiler: a lookup with symbolic sizes trips inductor's CPU template)."""
    def mask_mod(b, h, q_idx, kv_idx):
        if member is None:
            visible = kv_idx < kv_lens[b]
        else:
            at = ((b * heads + h) * rows + q_idx // block_size) * cols + kv_idx // block_size
            visible = (kv_idx < kv_lens[b]) & member[at]
        if causal:
            visible = visible & (kv_idx <= q_idx + offset[b])
        return visible

    return mask_mod


_COARSE_REPORTED: set[tuple[int, int]] = set()


def _coarse_block_mask(idx, listed, *, block_size: int, grid: int, causal: bool, q_len: int,
                       kv_len: int, kv_lens: torch.Tensor, offset: torch.Tensor) -> "BlockMask":
    """The selection on a grid of ``grid``-token blocks (``m = grid //
    block_size`` Stem blocks a side): a coarse block pair is listed (partial)
    where any of its m x m Stem pairs is; ``mask_mod`` keeps exactly the
    listed Stem pairs' visible tokens."""
    from torch.nn.attention.flex_attention import BlockMask

    if (block_size, grid) not in _COARSE_REPORTED:
        _COARSE_REPORTED.add((block_size, grid))
        warnings.warn(f"stem_indexer: FlexAttention's CUDA kernel cannot tile {block_size}-token "
                      f"blocks (no power of two >= {MIN_TILE} divides it); the BlockMask uses "
                      f"{grid}-token blocks and looks the selection up per token (slower). "
                      f"A block size that is a multiple of {MIN_TILE} avoids this.",
                      RuntimeWarning, stacklevel=3)
    device = idx.device
    batch, heads, qb, _ = idx.shape
    m = grid // block_size
    qc, kc = ceil_div(q_len, grid), ceil_div(kv_len, grid)
    # member[b, h, i, j]: Stem block j is listed for query block i; rows and
    # columns padded to whole coarse blocks (and a spare column for the
    # unlisted slots), so every token index of the mask has an entry.
    member = torch.zeros(batch, heads, qc * m, kc * m + 1, dtype=torch.bool, device=device)
    column = torch.where(listed, idx.clamp(0, kc * m - 1), kc * m)
    member[:, :, :qb].scatter_(-1, column, True)
    member = member[..., :kc * m].contiguous()
    coarse = member.view(batch, heads, qc, m, kc, m).any(dim=5).any(dim=3)
    blocks = torch.arange(kc, device=device).expand(batch, heads, qc, kc)
    partial, partial_num = _compact(blocks, coarse, kc)
    # One flat table indexed with plain integers (a 4-D lookup with symbolic
    # sizes trips inductor's CPU template).
    mask_mod = _mask_mod(kv_lens, offset, causal, member.flatten(), heads, qc * m, kc * m,
                         block_size)
    return BlockMask.from_kv_blocks(partial_num, partial, None, None, BLOCK_SIZE=grid,
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


# Triton's tl.dot takes tiles of at least 16 rows and columns; tiles are
# powers of two, and FlexAttention needs them to divide the BlockMask's block.
MIN_TILE = 16
MAX_TILE = 128

# FlexAttention kernel options on CUDA, chosen on an H200 with
# benchmarks/gpu/gpu_flex_tune.py: TMA loads and 128 x 128 tiles (the Stem block)
# took the 128K prefill's sparse attention from 81.9 to 76.2 ms. Used where
# they fit: sm_90, 16-bit q/k/v, head dims up to 128, blocks a multiple of 128.
CUDA_KERNEL_OPTIONS: dict = dict(USE_TMA=True, BLOCK_M=128, BLOCK_N=128, num_warps=8,
                                 num_stages=2)

# Shared memory per block (bytes) by compute capability; others get the
# smallest current figure (sm_86/89/120: 99 KiB).
_SHARED_MEMORY = {(8, 0): 163 * 1024, (8, 7): 163 * 1024, (9, 0): 227 * 1024,
                  (10, 0): 227 * 1024, (10, 3): 227 * 1024}
_SHARED_MEMORY_DEFAULT = 99 * 1024


def _tile(n: int, cap: int = MAX_TILE) -> int:
    """The largest power of two <= ``cap`` dividing ``n``."""
    t = 1
    while t * 2 <= cap and n % (t * 2) == 0:
        t *= 2
    return t


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _shared_bytes(bm: int, bn: int, stages: int, d: int, dv: int, itemsize: int) -> int:
    """What a forward tile keeps in shared memory: the Q tile and ``stages``
    K and V tiles (head dims as the kernel rounds them, to powers of two)."""
    d, dv = _pow2_at_least(d), _pow2_at_least(dv)
    return itemsize * (bm * d + stages * bn * (d + dv))


def cuda_kernel_options(q_block: int, kv_block: int, head_dim: int, v_head_dim: int,
                        dtype: torch.dtype, capability: tuple[int, int]) -> dict:
    """FlexAttention's Triton kernel options for a BlockMask of ``q_block`` x
    ``kv_block`` tokens, q/k head dim ``head_dim``, v head dim ``v_head_dim``,
    ``dtype`` and a device of compute ``capability``.

    ``BLOCK_M`` divides ``q_block`` and ``BLOCK_N`` divides ``kv_block``
    (powers of two, 16 .. 128); stages and tiles shrink until the tiles fit the
    device's shared memory; TMA only on sm_90 and newer with 16-bit inputs
    whose rows are 16-byte multiples and head dims up to 256 (TMA's box
    limit). The H200-tuned set is taken as it is where all of it fits.
    Raises ``ValueError`` when no tile divides a block (``block_mask`` never
    builds such a mask for CUDA: see ``choose_mask_block_size``).
    """
    tm, tn = _tile(q_block), _tile(kv_block)
    if tm < MIN_TILE or tn < MIN_TILE:
        raise ValueError(f"cuda_kernel_options: no tile (a power of two >= {MIN_TILE}) divides "
                         f"the BlockMask's block {q_block} x {kv_block}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    sixteen_bit = itemsize == 2
    smem = _SHARED_MEMORY.get(tuple(capability), _SHARED_MEMORY_DEFAULT)
    tma = (tuple(capability) >= (9, 0) and sixteen_bit and max(head_dim, v_head_dim) <= 256
           and (head_dim * itemsize) % 16 == 0 and (v_head_dim * itemsize) % 16 == 0)
    tuned = CUDA_KERNEL_OPTIONS
    if (tuple(capability) == (9, 0) and tma and max(head_dim, v_head_dim) <= 128
            and tm >= tuned["BLOCK_M"] and tn >= tuned["BLOCK_N"]
            and _shared_bytes(tuned["BLOCK_M"], tuned["BLOCK_N"], tuned["num_stages"],
                              head_dim, v_head_dim, itemsize) <= smem):
        return dict(tuned)
    # Otherwise inductor's own defaults for the head dim and dtype, cut to
    # the block, then fitted to shared memory.
    if max(head_dim, v_head_dim) <= 256:
        bm, bn = (128, 64) if sixteen_bit else (64, 64)
    else:
        bm, bn = (64, 32) if sixteen_bit else (32, 16)
    bm, bn, stages = min(bm, tm), min(bn, tn), 3
    while _shared_bytes(bm, bn, stages, head_dim, v_head_dim, itemsize) > smem:
        if stages > 1:
            stages -= 1
        elif bn > MIN_TILE:
            bn //= 2
        elif bm > MIN_TILE:
            bm //= 2
        else:
            break  # the smallest tiles: let the compiler say whether they fit
    warps = 8 if bm >= 128 and head_dim >= 128 else 4
    return dict(USE_TMA=tma, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)


# One compiled FlexAttention for the process, with dynamic shapes: sequence
# lengths (and batch, heads) are symbols, so a serving process that sees
# thousands of lengths compiles it once per head dim / dtype / options /
# score_mod kind, not per length. Each of those is a recompile of the one
# function, and a process serving several models (or a test suite) has more
# than Dynamo's default 8: the limit is RECOMPILE_LIMIT for this function.
# Hitting it raises: past it, Dynamo would run FlexAttention eagerly, which
# materialises the whole (Sq, Skv) score matrix. Floats (scale, softcap) stay
# constants: a model has a few, and a symbolic softcap inside score_mod does
# not lower.
RECOMPILE_LIMIT = 64
# Dynamo's settings for the call; those this torch lacks are left out at the
# call (reading torch._dynamo here would import it with this package).
_COMPILE_CONFIG = {"fail_on_recompile_limit_hit": True, "fail_on_cache_limit_hit": True,
                   "specialize_float": True, "recompile_limit": RECOMPILE_LIMIT,
                   "cache_size_limit": RECOMPILE_LIMIT}
# FlexAttention's CUDA kernel refuses head dims under 16: q/k (and v) are
# zero-padded to it there, which changes no score and no output column.
MIN_CUDA_HEAD_DIM = 16


def _compiled_flex():
    global _compiled
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention
        _compiled = torch.compile(flex_attention, dynamic=True)
    return _compiled


def _softcap_score_mod(softcap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)
    return score_mod


def flex_attention_forward(q, k, v, mask, scale: float, softcap: float | None = None,
                           return_lse: bool = False, kernel_options: dict | None = None):
    """Compiled FlexAttention of q [B,Hq,Sq,D], k/v [B,Hkv,Skv,D] under ``mask``:
    ``(out, lse)``, lse float32 [B, Hq, Sq] (natural log) or None when not
    asked for (inductor's CPU template cannot give it). ``softcap`` caps the
    scaled scores as ``softcap * tanh(score / softcap)`` (a score_mod).
    ``kernel_options`` default on CUDA: ``cuda_kernel_options`` for the
    mask's block size and these tensors."""
    dim_v = v.shape[-1]
    if q.is_cuda and q.shape[-1] < MIN_CUDA_HEAD_DIM:
        pad = MIN_CUDA_HEAD_DIM - q.shape[-1]
        q, k = (torch.nn.functional.pad(x, (0, pad)) for x in (q, k))
    if q.is_cuda and dim_v < MIN_CUDA_HEAD_DIM:
        v = torch.nn.functional.pad(v, (0, MIN_CUDA_HEAD_DIM - dim_v))
    compiled = _compiled_flex()
    score_mod = None if softcap is None else _softcap_score_mod(float(softcap))
    if kernel_options is None and q.is_cuda:
        q_block, kv_block = mask.BLOCK_SIZE
        kernel_options = cuda_kernel_options(int(q_block), int(kv_block), q.shape[-1],
                                             v.shape[-1], q.dtype,
                                             torch.cuda.get_device_capability(q.device))
    config = {k: v for k, v in _COMPILE_CONFIG.items() if hasattr(torch._dynamo.config, k)}
    with torch._dynamo.config.patch(**config):
        out = compiled(q, k, v, score_mod=score_mod, block_mask=mask, scale=float(scale),
                       enable_gqa=q.shape[1] != k.shape[1], return_lse=return_lse,
                       kernel_options=kernel_options)
    if return_lse:
        out, lse = out
        return out[..., :dim_v], lse
    return out[..., :dim_v], None
