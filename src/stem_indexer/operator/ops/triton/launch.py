"""Launchers of the Triton path: per-row facts, work items, kernel configs.

How one call runs (all on the tensors' device, no host read of tensor data,
so the whole call can be captured in a CUDA graph):

1. **Row facts from the contract.** For every (batch, query block) the
   visible range s2, the candidate range [sink_end, cand_end) and the number
   of picks take = min(K, candidates) come from ``contract.visible_blocks``,
   ``contract.candidate_range``, ``contract.prompt_budget`` and
   ``contract.row_budget`` evaluated as torch operations on the device (the
   very code the CPU path runs, float32 roundings included). Rows past a
   batch's query blocks get s2 = 0 (docs/CONTRACT.md section 2). Block counts are clamped
   to Qmax/Kmax, which changes nothing for valid lengths and keeps every
   kernel in bounds for any lengths.
2. **Work items from the metadata's plan.** The plan's tiles (batch, query
   blocks [i0, i1)) are read on the device; each tile's candidate columns
   [sink_end(i0), cand_end(i1-1)) are cut into ``BLOCK_N`` key chunks and its
   rows into row blocks of ``block_g`` query heads by ``block_i`` query
   blocks, per KV head. A running total gives every item a number; a fixed
   number of persistent programs (``nprog``, from the device's SM count)
   takes items round-robin and finds each item's tile by binary search. Only
   rows that see key blocks and only their candidate columns become work, so
   varlen and causal batches spread evenly over the programs.
3. **Scores live in the output.** ``score_kernel`` writes each candidate's
   32-bit ranking key into its own slot of ``sparse_indices`` (a row's
   candidate columns are inside the row), so no score buffer exists at all;
   memory is the outputs plus O(B * Qmax) row facts and O(plan) item tables.
4. **Selection.** ``select_kernel`` turns each row's keys into the picks,
   exactly: radix select of the take-th largest key, ties to the lower block
   index, ascending scatter; then forced blocks, -1 padding and the length.

Exactness: scores are float32 sums of exact bf16 products (order may differ
from the CPU path's matmul: docs/CONTRACT.md section 5 covers that; for integer-valued
inputs every order gives the same float32 and outputs are bit-identical),
scaled by ``contract.score_scale`` then biased, in two float32 roundings
(fp fusion is off so no FMA merges them); keys reproduce
``contract.rank_keys`` (bf16 rounding to nearest even for precision 2, -0.0
as +0.0, NaN as -inf); budgets are the contract's own tensors.

``kernels.py`` is imported once: its kernels are compiled for the GPU, or
interpreted on the CPU when ``TRITON_INTERPRET=1`` was set before Triton
jitted them (Triton decides that per process). CPU tensors are accepted
only by interpreted kernels.

``kernel_launches`` is the one place that turns inputs and a ``Config`` into
kernel arguments; the launcher runs its launches, and ``aot.py`` compiles
the very same ones for a GPU target without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from ... import contract, metadata as md
from ...contract import IndexerParams, ceil_div
from . import kernels

__all__ = ["stem_indexer_triton", "row_facts", "work_items", "kernel_launches", "Launch",
           "Config", "default_config", "device_arch", "INTERPRETED"]

# Whether Triton interprets these kernels (TRITON_INTERPRET=1 when they were jitted).
INTERPRETED = isinstance(kernels.select_kernel, InterpretedFunction)
# Header slots: magic, version, then the fields of ``metadata.Header`` in order.
_NUM_TILES_SLOT = 2 + [f.name for f in dataclasses.fields(md.Header)].index("num_tiles")
# CUDA's limit on a grid's x dimension; larger selection grids are split.
MAX_GRID = 2**31 - 1


@dataclass(frozen=True)
class Config:
    """Block sizes and launch widths of one call.

    ``block_m`` rows per score tile (query heads x query blocks, powers of
    two), ``block_n`` key blocks, ``block_k`` the reduction step (Df is
    padded to a multiple of it); ``tma``: operand tiles through tensor
    descriptors (Hopper and later) rather than pointers; ``score_maxnreg``:
    the score kernel's register cap (None: the compiler's). ``rows`` query
    blocks per selection program, ``block_c`` candidates held in registers
    per row, ``block_w`` the width of the selection's scatter and writes.
    """

    block_m: int
    block_n: int
    block_k: int
    tma: bool
    nprog: int
    score_warps: int
    score_stages: int
    score_maxnreg: int | None
    rows: int
    block_c: int
    block_w: int
    select_warps: int


def pow2_at_least(x: int) -> int:
    """The least power of two >= ``x`` (1 for ``x <= 1``)."""
    return 1 << max(0, (max(1, x) - 1).bit_length())


def require_device(who: str, device: torch.device) -> None:
    """The Triton kernels take CUDA tensors, or CPU ones under the interpreter."""
    if device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"{who}: the Triton kernels take {device.type} tensors only under the Triton "
            "interpreter; set TRITON_INTERPRET=1 before Triton is imported")


def _block_k(df: int) -> int:
    """The largest tensor-core step that divides Df, else 64 (Df gets padded)."""
    return next((bk for bk in (64, 32, 16) if df % bk == 0),
                64 if df >= 64 else max(16, pow2_at_least(df)))


def default_config(g: int, qmax: int, kmax: int, df: int, *, arch: int | None,
                   sms: int = 1) -> Config:
    """Kernel configuration for GQA group ``g`` and the given dims.

    ``arch``: the GPU's compute capability as an int (90 for sm_90), or
    None for the interpreter. GPU: tensor-core sized GEMM tiles with pointer
    loads, ``nprog`` two persistent score programs per SM, four pipeline
    stages from sm_90 (three before). Rows of up to 8192 candidates kept in
    registers, one row per selection program (two when rows are short), a
    warp per 1024 keys: a selection pass costs a compare per key and a
    reduction across the program's warps, which fewer warps make cheaper.
    ``aot.py`` shows that these compile without register spills on sm_80 and
    sm_90. On an H200 this configuration gave outputs identical to the CPU
    path on the benchmark shapes (integer data), while the TMA loads with
    128 registers per thread (``tma=True, score_maxnreg=128``, 35% faster
    scores) did not: they stay off until that is understood
    (``benchmarks/gpu/gpu_triton_diagnose.py``, benchmarks/RESULTS.md). The four
    stages and the warp per 1024 keys each took about 5% off their kernel
    (``gpu_check.py --variants``).
    Interpreter: the smallest legal tiles, so that tests exercise several
    programs, row blocks, key chunks and the chunked selection.
    """
    if arch is None:
        return Config(block_m=32, block_n=32, block_k=_block_k(df), tma=True, nprog=3,
                      score_warps=4, score_stages=1, score_maxnreg=None, rows=4, block_c=64,
                      block_w=64, select_warps=4)
    block_c = min(pow2_at_least(kmax), 8192)
    return Config(block_m=128 if g * min(qmax, md.TILE_ROWS_MAX) >= 128 else 64,
                  block_n=128, block_k=_block_k(df), tma=False, nprog=2 * sms,
                  score_warps=8, score_stages=4 if arch >= 90 else 3, score_maxnreg=None,
                  rows=2 if block_c <= 64 else 1, block_c=block_c, block_w=min(block_c, 1024),
                  select_warps=max(1, min(8, block_c // 1024)))


def _row_block(group: int, cfg: Config) -> tuple[int, int]:
    """(query heads, query blocks) of a score tile's rows."""
    block_g = min(pow2_at_least(group), cfg.block_m)
    return block_g, cfg.block_m // block_g


def device_arch(device: torch.device) -> tuple[int, int]:
    """(compute capability as an int, SM count) of a CUDA device."""
    return _arch_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _arch_of(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major * 10 + props.minor, props.multi_processor_count


def row_facts(q_lens: torch.Tensor, kv_lens: torch.Tensor, prompt_lens: torch.Tensor,
              qmax: int, kmax: int, params: IndexerParams) -> torch.Tensor:
    """(B, Qmax, 4) int32 per query block: s2, sink_end, cand_end, take.

    Device tensors in, device tensor out; the semantics are the contract's.
    """
    bs = params.stem_block_size
    qb = ceil_div(q_lens.to(torch.int64), bs).clamp(0, qmax)[:, None]
    kb = ceil_div(kv_lens.to(torch.int64), bs).clamp(0, kmax)[:, None]
    p = ceil_div(prompt_lens.to(torch.int64), bs)[:, None]
    i = torch.arange(qmax, device=q_lens.device)[None, :]
    s2 = contract.visible_blocks(i, qb, kb, params.causal)
    s2 = torch.where(i < qb, s2, 0)  # rows past Qb are empty
    sink_end, cand_end = contract.candidate_range(s2, params.initial_blocks, params.window_size)
    ks = contract.prompt_budget(p, params)
    budget = contract.row_budget(i + (kb - qb), p, ks, params.alpha)
    take = torch.minimum(budget, cand_end - sink_end)
    return torch.stack([s2, sink_end, cand_end, take], dim=-1).to(torch.int32).contiguous()


def work_items(metadata: torch.Tensor, facts: torch.Tensor, batch: int, kv_heads: int,
               group: int, cfg: Config):
    """The plan's tiles and their work items (see the module docstring).

    Returns ``(plan, item_end, tile_lo, tile_mblocks, tile_nchunks)``, all on
    the metadata's device, each with one entry per tile slot of the metadata.
    """
    qmax = facts.shape[1]
    lens_end = md.HEADER_SIZE + 2 * batch
    cap = (metadata.numel() - lens_end) // md.TILE_FIELDS
    plan = metadata[lens_end:lens_end + cap * md.TILE_FIELDS].view(cap, md.TILE_FIELDS)
    num_tiles = metadata[_NUM_TILES_SLOT]
    slots = torch.arange(cap, device=metadata.device)
    tiles = plan.to(torch.int64)
    b = tiles[:, 0].clamp(0, batch - 1)
    i0 = tiles[:, 1].clamp(0, qmax)
    i1 = torch.maximum(tiles[:, 2].clamp(max=qmax), i0)
    first = facts[b, i0.clamp(max=qmax - 1)].to(torch.int64)
    last = facts[b, (i1 - 1).clamp(min=0)].to(torch.int64)
    lo, hi = first[:, 1], last[:, 2]
    block_g, block_i = _row_block(group, cfg)
    mblocks = ceil_div(group, block_g) * ceil_div(i1 - i0, block_i)
    nchunks = ceil_div((hi - lo).clamp(min=0), cfg.block_n)
    items = torch.where(slots < num_tiles, kv_heads * mblocks * nchunks, 0)
    item_end = torch.cumsum(items, 0)
    as32 = dict(dtype=torch.int32)
    return (plan.contiguous(), item_end.contiguous(), lo.to(**as32).contiguous(),
            mblocks.clamp(min=1).to(**as32).contiguous(),
            nchunks.clamp(min=1).to(**as32).contiguous())


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel[grid](*args, **constexprs, **options)``."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict
    options: dict

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options)


def _operand(t: torch.Tensor, df: int) -> torch.Tensor:
    """qflat/kflat contiguous, 16-byte aligned, Df zero-padded to ``df``
    (zeros add nothing to a dot product)."""
    t = t.contiguous()
    if t.shape[-1] != df:
        t = torch.nn.functional.pad(t, (0, df - t.shape[-1]))
    return t if t.data_ptr() % 16 == 0 else t.clone()


def kernel_launches(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, prompt_lens, metadata,
                    params: IndexerParams, cfg: Config, indices, seq_len) -> list[Launch]:
    """The launches that fill ``indices``/``seq_len``, in order.

    Works on any device, ``meta`` included (then only the arguments' types
    and sizes mean anything, which is all ``aot.py`` needs).
    """
    batch, nq, qmax, _ = qflat.shape
    nk, kmax = kflat.shape[1], kflat.shape[2]
    group = nq // nk
    facts = row_facts(q_seq_lens, kv_seq_lens, prompt_lens, qmax, kmax, params)
    plan, item_end, tile_lo, tile_mblocks, tile_nchunks = work_items(
        metadata, facts, batch, nk, group, cfg)
    shift = 16 if params.topk_score_precision == 2 else 0
    df = ceil_div(qflat.shape[-1], cfg.block_k) * cfg.block_k
    q, k = _operand(qflat, df), _operand(kflat, df)
    block_g, block_i = _row_block(group, cfg)
    if cfg.tma:
        q = TensorDescriptor.from_tensor(q, [1, block_g, block_i, cfg.block_k])
        k = TensorDescriptor.from_tensor(k, [1, 1, cfg.block_n, cfg.block_k])
    launches = []
    cap = plan.shape[0]
    if cap > 0:
        launches.append(Launch(
            kernels.score_kernel, (cfg.nprog,),
            (q, k, vbias.contiguous(), indices, plan, item_end, tile_lo, tile_mblocks,
             tile_nchunks, facts, contract.score_scale(params), shift, batch, nq, nk, group,
             qmax, kmax, cap, cfg.nprog),
            dict(DF=df, BLOCK_G=block_g, BLOCK_I=block_i, BLOCK_N=cfg.block_n,
                 BLOCK_K=cfg.block_k, TMA=cfg.tma, UPCAST=INTERPRETED),
            dict(num_warps=cfg.score_warps, num_stages=cfg.score_stages,
                 maxnreg=cfg.score_maxnreg, enable_fp_fusion=False)))
    programs = batch * nq * ceil_div(qmax, cfg.rows)
    for first in range(0, programs, MAX_GRID):
        launches.append(Launch(
            kernels.select_kernel, (min(MAX_GRID, programs - first),),
            (indices, seq_len, facts, shift, nq, qmax, kmax, first),
            dict(ROWS=cfg.rows, BLOCK_C=cfg.block_c, BLOCK_W=cfg.block_w),
            dict(num_warps=cfg.select_warps)))
    return launches


def stem_indexer_triton(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens,
                        metadata, params: IndexerParams, *, config: Config | None = None,
                        poison: int | None = None):
    """``npu_stem_indexer`` on the Triton kernels, for inputs the op has checked.

    The op (``library.py``) checks shapes always and values (lengths, the
    metadata's plan) outside a CUDA-graph capture; whatever the values hold,
    these kernels stay in bounds (block counts are clamped to Qmax/Kmax, plan
    tiles to the batch and its query blocks).
    """
    device = qflat.device
    require_device("stem_indexer", device)
    batch, nq, qmax, df = qflat.shape
    nk, kmax = kflat.shape[1], kflat.shape[2]
    if kmax == 0:  # no key block anywhere: every row is empty
        return (torch.empty((batch, nq, qmax, 0), dtype=torch.int32, device=device),
                torch.zeros((batch, nq, qmax), dtype=torch.int32, device=device))
    if config is None:
        arch, sms = (None, 1) if INTERPRETED else device_arch(device)
        config = default_config(nq // nk, qmax, kmax, df, arch=arch, sms=sms)

    indices = torch.empty((batch, nq, qmax, kmax), dtype=torch.int32, device=device)
    seq_len = torch.empty((batch, nq, qmax), dtype=torch.int32, device=device)
    if poison is not None:
        indices.fill_(poison)
        seq_len.fill_(poison)
    prompt = kv_seq_lens if num_prompt_tokens is None else num_prompt_tokens
    for launch in kernel_launches(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, prompt,
                                  metadata, params, config, indices, seq_len):
        launch()
    return indices, seq_len
