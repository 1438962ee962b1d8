"""Launchers of the Triton path: per-row facts, work items, kernel configs.

How one call runs (all on the tensors' device, no host read of tensor data,
so the whole call can be captured in a CUDA graph):

1. **Row facts from the contract.** For every (batch, query block) the
   visible range s2, the candidate range [sink_end, cand_end) and the number
   of picks take = min(K, candidates) come from ``contract.visible_blocks``,
   ``contract.candidate_range``, ``contract.prompt_budget`` and
   ``contract.row_budget`` evaluated as torch operations on the device (the
   very code the CPU path runs, float32 roundings included). Rows past a
   batch's query blocks get s2 = 0 (SPEC section 3). Block counts are clamped
   to Qmax/Kmax, which changes nothing for valid lengths and keeps every
   kernel in bounds for any lengths.
2. **Work items from the metadata's plan.** The plan's tiles (batch, query
   blocks [i0, i1)) are read on the device; each tile's candidate columns
   [sink_end(i0), cand_end(i1-1)) are cut into ``BLOCK_N`` key chunks and its
   G*(i1-i0) (query block, query head) rows into ``BLOCK_M`` row blocks, per
   KV head. A running total gives every item a number; a fixed number of
   persistent programs (``NPROG``, from the device's SM count) takes items
   round-robin and finds each item's tile by binary search. Only rows that
   see key blocks and only their candidate columns become work, so varlen
   and causal batches spread evenly over the programs.
3. **Scores live in the output.** ``score_kernel`` writes each candidate's
   32-bit ranking key into its own slot of ``sparse_indices`` (a row's
   candidate columns are inside the row), so no score buffer exists at all;
   memory is the outputs plus O(B * Qmax) row facts and O(plan) item tables.
4. **Selection.** ``select_kernel`` turns each row's keys into the picks,
   exactly: bisection for the take-th largest key, ties to the lower block
   index, ascending scatter; then forced blocks, -1 padding and the length.

Exactness: scores are float32 sums of exact bf16 products (order may differ
from the CPU path's matmul: SPEC section 5 covers that; for integer-valued
inputs every order gives the same float32 and outputs are bit-identical),
scaled by ``contract.score_scale`` then biased, in two float32 roundings
(fp fusion is off so no FMA merges them); keys reproduce
``contract.rank_keys`` (bf16 rounding to nearest even for precision 2, -0.0
as +0.0, NaN as -inf); budgets are the contract's own tensors.

Kernels come from ``kernels.py``, loaded once per mode: compiled for CUDA
tensors, interpreted (Triton's CPU interpreter) for CPU tensors or when
``TRITON_INTERPRET=1``. Each mode gets its own module instance, so both can
live in one process whatever ``TRITON_INTERPRET`` said at import time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
# Imported here, under the caller's own TRITON_INTERPRET, never inside
# ``_interpret_env``: Triton fixes the form of its library functions at import.
import triton  # noqa: F401

from ... import contract, metadata as md
from ...contract import IndexerParams, ceil_div

__all__ = ["stem_indexer_triton", "row_facts", "work_items", "kernels_module", "Config"]

_KERNELS_FILE = Path(__file__).with_name("kernels.py")
# Header slots: magic, version, then the fields of ``metadata.Header`` in order.
_NUM_TILES_SLOT = 2 + [f.name for f in dataclasses.fields(md.Header)].index("num_tiles")
_ENV = "TRITON_INTERPRET"


@contextlib.contextmanager
def _interpret_env(interpret: bool):
    """TRITON_INTERPRET as ``interpret`` while ``triton.jit`` decorates."""
    before = os.environ.get(_ENV)
    os.environ[_ENV] = "1" if interpret else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[_ENV]
        else:
            os.environ[_ENV] = before


def kernels_module(interpret: bool):
    """``kernels.py`` with its kernels jitted for the interpreter or the GPU."""
    name = f"{__package__}._kernels_{'interpreted' if interpret else 'compiled'}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, _KERNELS_FILE)
        module = importlib.util.module_from_spec(spec)
        with _interpret_env(interpret):
            spec.loader.exec_module(module)
        sys.modules[name] = module
    return module


def _interpreting(device: torch.device) -> bool:
    return device.type != "cuda" or os.environ.get(_ENV, "0").lower() in ("1", "true", "on")


@dataclass(frozen=True)
class Config:
    """Block sizes and launch widths of one call."""

    block_m: int
    block_n: int
    block_k: int
    nprog: int
    score_warps: int
    score_stages: int
    rows: int
    block_c: int
    block_w: int
    select_warps: int


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (max(1, x) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_config(device: torch.device, g: int, qmax: int, kmax: int, df: int,
                   interpret: bool) -> Config:
    """GPU: tensor-core sized GEMM tiles, rows of up to 8192 candidates kept in
    registers. Interpreter: the smallest legal tiles, so that tests exercise
    several programs, row blocks, key chunks and the chunked selection."""
    if interpret:
        return Config(block_m=32, block_n=32, block_k=64, nprog=3, score_warps=4,
                      score_stages=1, rows=4, block_c=64, block_w=64, select_warps=4)
    block_m = 128 if g * min(qmax, md.TILE_ROWS_MAX) >= 128 else 64
    block_k = 64 if df >= 64 else max(16, _pow2_at_least(df))
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    block_c = min(_pow2_at_least(kmax), 8192)
    rows = max(1, min(8, 4096 // block_c))
    return Config(block_m=block_m, block_n=128, block_k=block_k, nprog=2 * sms,
                  score_warps=8, score_stages=3, rows=rows, block_c=block_c,
                  block_w=min(block_c, 1024),
                  select_warps=8 if rows * block_c >= 8192 else 4)


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
    mblocks = ceil_div(group * (i1 - i0), cfg.block_m)
    nchunks = ceil_div((hi - lo).clamp(min=0), cfg.block_n)
    items = torch.where(slots < num_tiles, kv_heads * mblocks * nchunks, 0)
    item_end = torch.cumsum(items, 0)
    as32 = dict(dtype=torch.int32)
    return (plan.contiguous(), item_end.contiguous(), lo.to(**as32).contiguous(),
            mblocks.clamp(min=1).to(**as32).contiguous(),
            nchunks.clamp(min=1).to(**as32).contiguous())


def _host_checks(q_seq_lens, kv_seq_lens, num_prompt_tokens, metadata, qflat, kflat,
                 params: IndexerParams) -> None:
    """Value checks of SPEC section 7 on host copies (one device sync)."""
    _, nq, qmax, df = qflat.shape
    nk, kmax = kflat.shape[1], kflat.shape[2]
    q_lens, kv_lens = q_seq_lens.cpu(), kv_seq_lens.cpu()
    prompt = None if num_prompt_tokens is None else num_prompt_tokens.cpu()
    contract.check_lengths(q_lens, kv_lens, prompt, qmax, kmax, params.stem_block_size)
    md.read_plan(metadata.cpu(), q_lens, kv_lens, nq, nk, params.causal,
                 params.stem_block_size, df, params.window_size)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def stem_indexer_triton(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, num_prompt_tokens,
                        metadata, params: IndexerParams, *, config: Config | None = None,
                        poison: int | None = None):
    """``npu_stem_indexer`` on the Triton kernels; inputs already shape-checked.

    The value checks that need the lengths on the host (ranges, prompt >= kv,
    metadata built for these inputs) run here, except while a CUDA graph is
    being captured: a capture cannot read device memory on the host, so a
    captured call trusts its inputs (and stays in bounds whatever they hold).
    """
    device = qflat.device
    expected = md.metadata_size(qflat.shape[0], kflat.shape[1])
    if metadata.numel() != expected:  # a shape check: it runs while capturing too
        raise contract.StemIndexerInputError(
            f"stem_indexer: metadata must have {expected} elements for batch "
            f"{qflat.shape[0]} and {kflat.shape[1]} kv heads; got {metadata.numel()}")
    if not _capturing(device):
        _host_checks(q_seq_lens, kv_seq_lens, num_prompt_tokens, metadata, qflat, kflat, params)
    batch, nq, qmax, df = qflat.shape
    nk, kmax = kflat.shape[1], kflat.shape[2]
    if kmax == 0:  # no key block anywhere: every row is empty
        return (torch.empty((batch, nq, qmax, 0), dtype=torch.int32, device=device),
                torch.zeros((batch, nq, qmax), dtype=torch.int32, device=device))
    interpret = _interpreting(device)
    cfg = config or default_config(device, nq // nk, qmax, kmax, df, interpret)
    kern = kernels_module(interpret)

    prompt = kv_seq_lens if num_prompt_tokens is None else num_prompt_tokens
    facts = row_facts(q_seq_lens, kv_seq_lens, prompt, qmax, kmax, params)
    plan, item_end, tile_lo, tile_mblocks, tile_nchunks = work_items(
        metadata, facts, batch, nk, nq // nk, cfg)
    cap = plan.shape[0]

    indices = torch.empty((batch, nq, qmax, kmax), dtype=torch.int32, device=device)
    seq_len = torch.empty((batch, nq, qmax), dtype=torch.int32, device=device)
    if poison is not None:
        indices.fill_(poison)
        seq_len.fill_(poison)
    qflat, kflat, vbias = qflat.contiguous(), kflat.contiguous(), vbias.contiguous()
    shift = 16 if params.topk_score_precision == 2 else 0

    if cap > 0:
        kern.score_kernel[(cfg.nprog,)](
            qflat, kflat, vbias, indices, plan, item_end, tile_lo, tile_mblocks,
            tile_nchunks, facts, contract.score_scale(params), batch, nq, nk, nq // nk, qmax,
            kmax, cap, cfg.nprog, DF=df,
            LOG_CAP=max(1, math.ceil(math.log2(cap))) + 1, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SHIFT=shift, UPCAST=interpret,
            num_warps=cfg.score_warps, num_stages=cfg.score_stages, enable_fp_fusion=False)
    kern.select_kernel[(batch * nq * _cdiv(qmax, cfg.rows),)](
        indices, seq_len, facts, nq, qmax, kmax,
        ROWS=cfg.rows, BLOCK_C=cfg.block_c, BLOCK_W=cfg.block_w, SHIFT=shift,
        num_warps=cfg.select_warps)
    return indices, seq_len


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
