"""Block-sparse causal attention over a paged KV cache: Triton kernel and launcher.

``paged_sparse_attention`` attends the packed new query tokens of ``B`` rows
(the requests of one engine step) to the key blocks each (row, query head,
query block) lists, reading keys and values through the row's block table
from a paged cache. Its semantics are those of ``ops/gather_attention.py``
with absolute positions: a query at position ``p`` sees the keys of its
listed blocks at positions ``kp <= p`` and ``kp < seq_len``; scores
``q . k * scale``, soft-capped when asked, softmax over the visible keys,
float32 accumulation; a query that sees no key gets 0.

Inputs (see ``paged_sparse_attention`` for the shapes):

* ``rows`` [B, 4] int32 per row: (q_start, context, seq_len, first_block).
  The row's queries are positions [context, seq_len), tokens q_start, ...
  of ``query``; its query block ``i`` is the absolute block first_block + i.
* ``block_table`` [B, W]: token position ``p`` of row ``b`` is at page
  ``block_table[b, p // page]``, offset ``p % page``.
* ``indices`` [B, Hq, Qmax, Kw] / ``lengths`` [B, Hq, Qmax]: the absolute
  key blocks of each (row, head, query block), ascending, -1 padded.

``paged_attention_kernel``: one program per (row, query block, query tile of
``BLOCK_M`` positions, query head), the head fastest so that the heads of one
query tile, which read the same pages, run side by side. A program whose
tile holds no query of its row (past the row's end, before its context, or a
query block the row does not have) does nothing. Otherwise it walks the
listed key blocks in ``BLOCK_N``-key tiles, each tile anchored in one key
block (a block is ``ceil(block_size / BLOCK_N)`` tiles, the last masked at
the block's end, so a tile never straddles two blocks and any block size
works), as one flat loop over (list entry, tile of the block). In a valid
list (ascending, ending at or before the query block) every block before
the last is a whole block in the past of every query of the tile, and the
last one is cut at the tile's last query (causal) and at seq_len, so tiles
wholly in the causal future or past seq_len are never visited; any other
list is masked key by key all the same, only visiting more tiles. Per key
tile: page ids from the table (clamped to the cache, so no
table content leads out of bounds; slots of keys that are masked out are
never read), a gather of K and V rows by (page, offset) through all four
strides of each cache (NHD and HND layouts alike), scores by ``tl.dot``,
the soft cap as ``softcap * tanh(s / softcap)`` with tanh from ``exp``, the
causal and length mask, and an online softmax in base 2 (``log2(e)`` folded
into the scale) with a running max and sum; a row whose running max is still
-inf (nothing visible yet) uses 0 in its place, so masked tiles add exact
zeros and never NaN. The head dim is padded to ``BLOCK_D``, a power of two,
with masked loads and stores.

Precision: float32 accumulation always. Dots use ``input_precision="ieee"``:
float32 inputs get float32 products (no TF32), bfloat16/float16 inputs take
the tensor cores with float32 accumulation, the probabilities rounded to the
input dtype for the second dot. ``UPCAST`` (set under the interpreter, whose
16-bit ``tl.dot`` is not exact) converts both dots' operands to float32.

Loops: on a GPU the key-tile loop is a ``range`` loop that Triton can
pipeline (``num_stages``); under the interpreter (``FOR_LOOP`` off) it is a
``while`` loop, as the interpreter of Triton 3.6 cannot take a tensor as a
``range`` bound with NumPy 2. Both run the same tile function.

The launcher reads no tensor value on the host (grid from shapes only), so a
call can be captured in a CUDA graph; ``paged_launch`` builds the launch from
the arguments alone and works on ``meta`` tensors, which is what an
ahead-of-time compile needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...contract import ceil_div, check_int, fail
from . import launch

__all__ = ["paged_sparse_attention", "paged_launch", "paged_attention_kernel", "PagedConfig",
           "default_paged_config", "paged_kernel_supports", "MAX_HEAD_DIM"]

WHO = "paged_sparse_attention"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The largest head dim whose tiles the GPU configuration is known to fit.
MAX_HEAD_DIM = 256


# --------------------------------------------------------------------------- #
# Kernel
# --------------------------------------------------------------------------- #


@triton.jit
def _tanh(x):
    """tanh from exp, stable for any |x|: sign(x) * (1 - e) / (1 + e), e = exp(-2|x|)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """a @ b, float32 result; float32 operands under ``UPCAST``."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _tile_mask(rows, d, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row mask broadcast over the head dim, the padded columns masked too."""
    if HEAD_D == BLOCK_D:
        return tl.broadcast_to(rows[:, None], (rows.shape[0], BLOCK_D))
    return rows[:, None] & (d[None, :] < HEAD_D)


@triton.jit
def _key_tile(q, qpos, m_i, l_i, acc, t, idx_row, table_row, k_base, v_base,
              kstop, jmax, W, NUM_PAGES, st_w, sk_p, sk_o, sk_d, sv_p, sv_o, sv_d,
              qk_scale, cap_in, cap_out,
              BS: tl.constexpr, PAGE: tl.constexpr, HEAD_D: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TPB: tl.constexpr,
              SOFTCAP: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of the flat loop: tile ``t % TPB`` of list entry ``t // TPB``.

    Keys at or past ``kstop`` (the tile's last query + 1, at most seq_len),
    past the key block's end or before position 0 are masked; returns the
    running (max, sum, accumulator) with the tile's keys added.
    """
    j = tl.load(idx_row + t // TPB)
    j = tl.minimum(tl.maximum(j, -1), jmax)  # garbage cannot overflow positions
    kp = j * BS + (t % TPB) * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = (kp >= 0) & (kp < tl.minimum((j + 1) * BS, kstop))
    slot = kp // PAGE
    page = tl.load(table_row + slot * st_w, mask=kmask & (slot < W), other=0)
    page = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1).to(tl.int64)
    off = (kp % PAGE).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = _tile_mask(kmask, d, HEAD_D, BLOCK_D)
    k = tl.load(k_base + (page * sk_p + off * sk_o)[:, None] + d[None, :] * sk_d,
                mask=mask, other=0.0)
    s = _dot(q, tl.trans(k), UPCAST)
    if SOFTCAP:
        s = _tanh(s * cap_in) * cap_out
    else:
        s = s * qk_scale
    visible = kmask[None, :] & (kp[None, :] <= qpos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    v = tl.load(v_base + (page * sv_p + off * sv_o)[:, None] + d[None, :] * sv_d,
                mask=mask, other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, idx_ptr, len_ptr, rows_ptr,
    scale, softcap, T, HQ, GROUP, QMAX, KW, NUM_PAGES, W,
    sq_t, sq_h, sq_d, sk_p, sk_o, sk_h, sk_d, sv_p, sv_o, sv_h, sv_d,
    so_t, so_h, so_d, st_b, st_w,
    BS: tl.constexpr, PAGE: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr, FOR_LOOP: tl.constexpr,
):
    """Block-sparse attention of one query tile of one head (see module doc).

    Program ``pid`` is ((row * QMAX + query block) * tiles + tile) * HQ + head.
    ``idx``/``len``/``rows`` contiguous int32; every other tensor through its
    strides. ``softcap`` is read only when ``SOFTCAP``.
    """
    TILES: tl.constexpr = (BS + BLOCK_M - 1) // BLOCK_M
    TPB: tl.constexpr = (BS + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0).to(tl.int64)
    h = (pid % HQ).to(tl.int32)
    rest = pid // HQ
    tile = (rest % TILES).to(tl.int32)
    rest = rest // TILES
    i = (rest % QMAX).to(tl.int32)
    b = rest // QMAX
    q_start = tl.load(rows_ptr + 4 * b)
    context = tl.load(rows_ptr + 4 * b + 1)
    seq_len = tl.load(rows_ptr + 4 * b + 2)
    block_start = (tl.load(rows_ptr + 4 * b + 3) + i) * BS
    tile_start = block_start + tile * BLOCK_M
    # Queries [lo, hi) of this tile: inside the query block and the row's queries.
    lo = tl.maximum(tile_start, context)
    hi = tl.minimum(tl.minimum(tile_start + BLOCK_M, block_start + BS), seq_len)
    if hi > lo:
        qpos = tile_start + tl.arange(0, BLOCK_M)
        token = (q_start + qpos - context).to(tl.int64)
        qmask = (qpos >= lo) & (qpos < hi) & (token >= 0) & (token < T)
        d = tl.arange(0, BLOCK_D)
        qtile = _tile_mask(qmask, d, HEAD_D, BLOCK_D)
        q = tl.load(q_ptr + token[:, None] * sq_t + h * sq_h + d[None, :] * sq_d,
                    mask=qtile, other=0.0)
        row = (b * HQ + h) * QMAX + i
        n = tl.minimum(tl.maximum(tl.load(len_ptr + row), 0), KW)
        idx_row = idx_ptr + row * KW
        jmax = (seq_len + BS - 1) // BS
        # Tiles of the last listed block that reach a visible key.
        last = tl.load(idx_row + tl.maximum(n - 1, 0), mask=n > 0, other=-1)
        last = tl.minimum(tl.maximum(last, -1), jmax)
        need = tl.minimum(tl.maximum(tl.minimum((last + 1) * BS, hi) - last * BS, 0), BS)
        total = tl.where(n > 0, (n - 1) * TPB + (need + BLOCK_N - 1) // BLOCK_N, 0)

        kvh = (h // GROUP).to(tl.int64)
        table_row = table_ptr + b * st_b
        k_base = k_ptr + kvh * sk_h
        v_base = v_ptr + kvh * sv_h
        qk_scale = scale * 1.4426950408889634
        cap_in = scale / softcap
        cap_out = softcap * 1.4426950408889634
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if FOR_LOOP:
            for t in range(0, total):
                m_i, l_i, acc = _key_tile(
                    q, qpos, m_i, l_i, acc, t, idx_row, table_row, k_base, v_base, hi, jmax,
                    W, NUM_PAGES, st_w, sk_p, sk_o, sk_d, sv_p, sv_o, sv_d, qk_scale, cap_in,
                    cap_out, BS, PAGE, HEAD_D, BLOCK_D, BLOCK_N, TPB, SOFTCAP, UPCAST)
        else:
            t = 0
            while t < total:
                m_i, l_i, acc = _key_tile(
                    q, qpos, m_i, l_i, acc, t, idx_row, table_row, k_base, v_base, hi, jmax,
                    W, NUM_PAGES, st_w, sk_p, sk_o, sk_d, sv_p, sv_o, sv_d, qk_scale, cap_in,
                    cap_out, BS, PAGE, HEAD_D, BLOCK_D, BLOCK_N, TPB, SOFTCAP, UPCAST)
                t += 1
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * so_t + h * so_h + d[None, :] * so_d,
                 out.to(out_ptr.dtype.element_ty), mask=qtile)


# --------------------------------------------------------------------------- #
# Configuration
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class PagedConfig:
    """Tiles and launch widths of ``paged_attention_kernel``.

    ``block_m`` query positions per program (inside one query block),
    ``block_n`` keys per tile (inside one key block); both powers of two, at
    least 16 for a GPU (``tl.dot``'s smallest tile). ``num_warps`` and
    ``num_stages`` as Triton takes them.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _pow2_at_most(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _block_d(head_dim: int) -> int:
    return max(16, launch.pow2_at_least(head_dim))


def default_paged_config(block_size: int, head_dim: int, dtype: torch.dtype,
                         arch: int | None) -> PagedConfig:
    """Kernel configuration for ``block_size``, ``head_dim`` and ``dtype``.

    ``arch``: the GPU's compute capability as an int (90 for sm_90), or None
    for the interpreter, which gets 16 x 16 tiles so that tests cover several
    query and key tiles per block. GPU, by padded head dim (``BLOCK_D``):

    ========  =====================
    BLOCK_D   16-bit inputs
    ========  =====================
    <= 64     64 x 64, 4 warps
    128       64 x 64, 8 warps
    256       32 x 32, 8 warps
    ========  =====================

    (query positions x keys per tile), then ``block_m`` at most the largest
    power of two not above the block size and ``block_n`` at most the largest
    power of two dividing it, neither under 16 (``tl.dot``'s smallest tile:
    a smaller block is one masked tile), 4 warps for 16 x 16 tiles; 2
    pipeline stages, 3 from sm_90. Float32 inputs, whose products run on CUDA
    cores with the operands in registers, take 32 x 16 tiles (16 x 16 for
    16-token blocks), 8 warps (4 for 32 x 16 tiles with head dims up to 32)
    and 2 stages. For head dims 16 to 256 and block sizes 16 to 128 all of
    these compile for sm_80 and sm_90 without register spills (about 170
    registers a thread for bfloat16 and head dim 128) and use at most 80 KB
    of shared memory.
    """
    if arch is None:
        return PagedConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    block_d = _block_d(head_dim)
    if dtype == torch.float32:
        block_m = max(16, min(32, _pow2_at_most(block_size)))
        return PagedConfig(block_m=block_m, block_n=16, num_stages=2,
                           num_warps=4 if block_d <= 32 and block_m == 32 else 8)
    block_m, block_n, warps = ((64, 64, 4) if block_d <= 64 else (64, 64, 8) if block_d <= 128
                               else (32, 32, 8))
    block_m = max(16, min(block_m, _pow2_at_most(block_size)))
    block_n = max(16, min(block_n, block_size & -block_size))
    return PagedConfig(block_m=block_m, block_n=block_n,
                       num_warps=4 if block_m * block_n <= 256 else warps,
                       num_stages=3 if arch >= 90 else 2)


def paged_kernel_supports(block_size: int, head_dim: int) -> str | None:
    """None when the GPU kernel runs ``block_size`` and ``head_dim``, else why not.

    Any block size works (key and query tiles are masked at block ends; a
    block size that is not a multiple of the tiles only wastes lanes); the
    head dim is bounded by the tiles the default configuration keeps within
    registers and shared memory.
    """
    if block_size < 1:
        return f"block_size must be >= 1; got {block_size}"
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        return f"head dim must be in [1, {MAX_HEAD_DIM}]; got {head_dim}"
    return None


# --------------------------------------------------------------------------- #
# Launcher
# --------------------------------------------------------------------------- #


def _check_tensor(name: str, t, dim: int, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        fail(WHO, name, "must be a torch.Tensor", type(t).__name__)
    if t.dim() != dim:
        fail(WHO, name, f"must have {dim} dims", tuple(t.shape))
    if t.dtype not in dtypes:
        fail(WHO, name, "must have dtype " + " or ".join(str(d) for d in dtypes), t.dtype)


def _check_shape(name: str, t: torch.Tensor, shape: tuple, what: str) -> None:
    if tuple(t.shape) != tuple(shape):
        fail(WHO, name, f"must have shape {tuple(shape)} ({what})", tuple(t.shape))


def _check_config(config: PagedConfig) -> None:
    if not isinstance(config, PagedConfig):
        fail(WHO, "config", "must be a PagedConfig or None", type(config).__name__)
    low = 1 if launch.INTERPRETED else 16
    for name in ("block_m", "block_n"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low \
                or value & (value - 1):
            fail(WHO, f"config.{name}", f"must be a power of two >= {low}", value)
    for name in ("num_warps", "num_stages"):
        check_int(WHO, f"config.{name}", getattr(config, name), 1)


def _check_args(query, key_cache, value_cache, block_table, indices, lengths, rows,
                block_size, scale, softcap) -> None:
    """Types, shapes, dtypes and devices of the arguments (never their values)."""
    _check_tensor("query", query, 3, DTYPES)
    _check_tensor("key_cache", key_cache, 4, (query.dtype,))
    _check_tensor("value_cache", value_cache, 4, (query.dtype,))
    int32 = (torch.int32,)
    for name, t, dim in (("block_table", block_table, 2), ("indices", indices, 4),
                         ("lengths", lengths, 3), ("rows", rows, 2)):
        _check_tensor(name, t, dim, int32)
    check_int(WHO, "block_size", block_size, 1)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        fail(WHO, "scale", "must be a finite float", repr(scale))
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not 0 < softcap < math.inf):
        fail(WHO, "softcap", "must be None or a finite float > 0", repr(softcap))
    _, hq, dim = query.shape
    hkv = key_cache.shape[2]
    if key_cache.shape[1] < 1 or key_cache.shape[0] < 1:
        fail(WHO, "key_cache", "must have at least one page of at least one token",
             tuple(key_cache.shape))
    _check_shape("key_cache", key_cache, (*key_cache.shape[:3], dim), "head dim of query")
    if hkv < 1 or hq % hkv:
        fail(WHO, "key_cache", f"must have a KV head count dividing the {hq} query heads", hkv)
    _check_shape("value_cache", value_cache, key_cache.shape, "as key_cache")
    batch = rows.shape[0]
    _check_shape("rows", rows, (batch, 4), "(q_start, context, seq_len, first_block) per row")
    _check_shape("block_table", block_table, (batch, block_table.shape[1]), "one row per row")
    qmax, kw = indices.shape[2], indices.shape[3]
    _check_shape("indices", indices, (batch, hq, qmax, kw), "[B, Hq, Qmax, Kw]")
    _check_shape("lengths", lengths, (batch, hq, qmax), "[B, Hq, Qmax] of indices")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_table", block_table), ("indices", indices), ("lengths", lengths),
                    ("rows", rows)):
        if t.device != query.device:
            fail(WHO, name, f"must be on the device of query ({query.device})", t.device)


def paged_launch(query, key_cache, value_cache, block_table, indices, lengths, rows, out, *,
                 block_size: int, scale: float, softcap: float | None,
                 config: PagedConfig) -> launch.Launch:
    """The kernel launch that fills ``out`` [T, Hq, D] (see the module doc).

    Reads shapes and strides only, so it works on any device, ``meta``
    included (what an ahead-of-time compile needs).
    """
    tokens, hq, dim = query.shape
    num_pages, page, hkv, _ = key_cache.shape
    batch, qmax = indices.shape[0], indices.shape[2]
    tiles = ceil_div(block_size, config.block_m)
    grid = (batch * qmax * tiles * hq,)
    if grid[0] > launch.MAX_GRID:
        fail(WHO, "indices", f"must give at most {launch.MAX_GRID} programs "
             f"(B * Qmax * {tiles} tiles * Hq)", grid[0])
    indices, lengths, rows = indices.contiguous(), lengths.contiguous(), rows.contiguous()
    args = (query, key_cache, value_cache, out, block_table, indices, lengths, rows,
            float(scale), float(softcap or 1.0), tokens, hq, hq // hkv, qmax, indices.shape[3],
            num_pages, block_table.shape[1], *query.stride(), *key_cache.stride(),
            *value_cache.stride(), *out.stride(), *block_table.stride())
    constexprs = dict(BS=block_size, PAGE=page, HEAD_D=dim, BLOCK_D=_block_d(dim),
                      BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                      SOFTCAP=softcap is not None, UPCAST=launch.INTERPRETED,
                      FOR_LOOP=not launch.INTERPRETED)
    return launch.Launch(paged_attention_kernel, grid, args, constexprs,
                         dict(num_warps=config.num_warps, num_stages=config.num_stages))


def paged_sparse_attention(query, key_cache, value_cache, block_table, indices, lengths, rows,
                           *, block_size: int, scale: float, softcap: float | None = None,
                           config: PagedConfig | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Block-sparse causal attention of ``query`` over a paged KV cache.

    ``query`` [T, Hq, D] bfloat16, float16 or float32: the packed new tokens
    of B rows. ``key_cache``/``value_cache`` [num_pages, page, Hkv, D], any
    strides (an [num_pages, Hkv, page, D] cache passes as ``.transpose(1, 2)``),
    Hq a multiple of Hkv; query head h reads KV head h // (Hq // Hkv).
    ``block_table`` [B, W] int32 page ids; entries no visible key needs are
    never read, and any page id read is clamped to the cache. ``indices``
    [B, Hq, Qmax, Kw] and ``lengths`` [B, Hq, Qmax] int32: each (row, head,
    query block)'s ascending absolute key blocks. ``rows`` [B, 4] int32:
    (q_start, context, seq_len, first_block = context // block_size) per row.

    Returns ``out`` [T, Hq, D] in query's dtype, the given ``out`` (any
    strides) or a new tensor from ``torch.empty``: every token of every row
    is written, exactly once; tokens of no row (padding) are left as they
    were, uninitialised in a new tensor. ``config``: tiles and warps
    (default: ``default_paged_config`` for the device).

    Tensors must be CUDA tensors, or CPU tensors under the Triton interpreter
    (``TRITON_INTERPRET=1``). No tensor value is read on the host: the call
    can be captured in a CUDA graph. Argument errors raise
    ``StemIndexerInputError`` naming the argument and the rule.
    """
    _check_args(query, key_cache, value_cache, block_table, indices, lengths, rows,
                block_size, scale, softcap)
    if out is not None:
        _check_tensor("out", out, 3, (query.dtype,))
        _check_shape("out", out, query.shape, "as query")
        if out.device != query.device:
            fail(WHO, "out", f"must be on the device of query ({query.device})", out.device)
    if config is not None:
        _check_config(config)
    device = query.device
    launch.require_device(WHO, device)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=device)
    if config is None:
        arch = None if launch.INTERPRETED else launch.device_arch(device)[0]
        config = default_paged_config(block_size, query.shape[2], query.dtype, arch)
    run = paged_launch(query, key_cache, value_cache, block_table, indices, lengths, rows, out,
                       block_size=block_size, scale=scale, softcap=softcap, config=config)
    if run.grid[0] > 0 and query.shape[0] > 0:
        run()
    return out
