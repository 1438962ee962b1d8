"""Which kernel runs a checked call, and running it.

``_run`` runs block-sparse attention on the kernel that ``_backend`` picks
(see ``attention.py``'s docstring for the backends); the pieces of
``stem_attention``'s path that ``plan.py`` plans with (the visible pairs,
the dense lists, the rows ``exact_tail`` widens) live here beside it.
``plan.py`` decides the path: dense attention where the budget keeps every
block (``contract.dense_is_exact``), more than ``dense_above`` of the
visible block pairs (``contract.budget_pairs``), or there are too few query
blocks, else indexer inputs -> indexer -> (the rows of the prompt's last
``exact_tail`` tokens widened to every block, ``apply_tail``) -> block-sparse
attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..operator import contract
from .checks import check_backend_fits
from ..operator.contract import IndexerParams, ceil_div, fail
from ..operator.ops import flex_attention as flex, native
from ..operator.ops.gather_attention import gather_attention

# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #


def _native():
    """The native kernel's module, or None where it is not built."""
    from ..operator.ops import sparse_attention
    return sparse_attention if sparse_attention.available() else None


def _native_status() -> str:
    from ..operator.ops import sparse_attention
    return sparse_attention.status()


def attention_path(device_type: str, dtype: torch.dtype) -> tuple[str, str | None]:
    """The kernel ``backend="auto"`` runs for tensors of this device type and
    dtype, and why it is a slower fallback (None: it is not)."""
    if device_type == "cpu":
        kernel = _native()
        if kernel is None:
            return "gather", f"the native kernel is not in use: {_native_status()}"
        if dtype in kernel.DTYPES:
            return "native", None
        if dtype == torch.float64:  # the references' precision: no kernel is faster
            return "gather", None
        return "gather", ("the native kernel takes float32 and bfloat16, not "
                          f"{str(dtype).removeprefix('torch.')}")
    if device_type == "cuda" and flex.available():
        return "flex", None
    return "gather", None


def _backend(backend: str, q: torch.Tensor) -> str:
    """``_backend_for`` q's device and dtype."""
    return _backend_for(backend, q.device, q.dtype)


def _backend_for(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """``backend``, or for ``"auto"`` the kernel of ``attention_path``; a
    fallback is reported once (a warning; ``stem_indexer.status()``)."""
    if backend != "auto":
        return backend
    chosen, why = attention_path(device.type, dtype)
    if why is not None and _native() is None:
        from ..operator.ops import sparse_attention
        sparse_attention.report_fallback()
    elif why is not None:
        native.report_once(f"attention {device.type} {dtype}", "block-sparse attention "
                           f"on {device.type} {str(dtype).removeprefix('torch.')} runs "
                           f"torch operations on gathered blocks ({why}): slower")
    return chosen


class Path(NamedTuple):
    """One line of ``status()``: what runs ``op`` for ``device`` and ``dtype``."""

    op: str
    device: str
    dtype: str
    runs: str
    fallback: str | None  # why this is a slower path (None: it is not)


_RUNS = {"native": "the native kernel (ops/sparse_attention.py)",
         "flex": "compiled FlexAttention (ops/flex_attention.py)",
         "gather": "torch operations on gathered blocks (ops/gather_attention.py)"}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def paths() -> list[Path]:
    """The path each op takes on CPU and CUDA, per dtype (the indexer's
    inputs are bfloat16 whatever attention's dtype is): what ``status()``
    prints. Builds the native kernels if they are not yet built."""
    from ..operator.ops.library import indexer_path

    rows = []
    for device in ("cpu", "cuda"):
        runs, why = indexer_path(device)
        rows.append(Path("indexer", device, "bfloat16", runs, why))
        for dtype in _DTYPES:
            kernel, why = attention_path(device, dtype)
            rows.append(Path("attention", device, str(dtype).removeprefix("torch."),
                             _RUNS[kernel], why))
        rows.append(_paged_path(device, why=indexer_path(device)[1]))
    return rows


def _paged_path(device: str, why: str | None) -> Path:
    """The paged entry point's row of ``paths`` (``paged.py``)."""
    if device == "cuda" and why is None:
        return Path("paged", device, "any", "Triton: kflat from the pages, the indexer's "
                    "kernels, attention through the block table (ops/triton/paged_*.py)", None)
    return Path("paged", device, "any", "the pages gathered with torch operations, then the "
                "indexer and attention rows above (paged.py)", why if device == "cuda" else None)


def status() -> str:
    """Which implementation runs each op on each device and dtype, which of
    them are slower fallbacks and why, and the native kernels' state: a
    printable report (``stem_indexer.status()``)."""
    cuda = "usable" if torch.cuda.is_available() else "not usable here"
    lines = [f"torch {torch.__version__}; CUDA {cuda}"]
    for row in paths():
        mark = f"  [fallback: {row.fallback}]" if row.fallback else ""
        lines.append(f"{row.op:9} {row.device:4} {row.dtype:8} {row.runs}{mark}")
    passes = " (its linear passes on AVX-512)" if native.select_vector() else ""
    lines += [f"native selection: {native.status(native.SELECT_ROWS)}{passes}",
              f"native attention: {_native_status()}",
              f"bfloat16 scores: {native.bf16_scores_status()}",
              f"native indexer-cache write: {native.status(native.INDEX_CACHE)}"]
    return "\n".join(lines)


def _padding_zeroed(x: torch.Tensor, lens: torch.Tensor, blocks: int, bs: int) -> torch.Tensor:
    """x [B,H,S,D] padded to ``blocks * bs`` positions, every position at or
    past ``lens[b]`` zero (a copy only where there is padding)."""
    seq = x.shape[2]
    if seq == blocks * bs and bool((lens == seq).all()):
        return x
    out = x.new_zeros(*x.shape[:2], blocks * bs, x.shape[3])
    for b, n in enumerate(lens.tolist()):
        out[b, :, :n] = x[b, :, :n]
    return out

@dataclass(frozen=True)
class _Call:
    """A checked block-sparse attention problem: q/k/v and the lists on one
    device, the per-batch lengths on the host. A plan's call also has the
    lengths on the device and the mask of valid queries there (None: no
    padding), so that its run copies nothing from the host."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    idx: torch.Tensor
    lengths: torch.Tensor
    qlen: torch.Tensor
    kvlen: torch.Tensor
    bs: int
    causal: bool
    scale: float
    softcap: float | None
    on_device: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

def _flex(c: _Call, want_lse: bool):
    qmax, kmax = ceil_div(c.q.shape[2], c.bs), ceil_div(c.k.shape[2], c.bs)
    device = c.q.device
    if want_lse and device.type == "cpu":
        fail("block_sparse_attention", "backend", "'flex' cannot return the log-sum-exp on CPU "
             "(inductor's CPU FlexAttention lacks it); use 'native' or 'gather'", "'flex'")
    qlen, kvlen = (c.qlen.to(device), c.kvlen.to(device)) if c.on_device is None \
        else c.on_device[:2]
    mask = flex.block_mask(c.idx, c.lengths, block_size=c.bs, causal=c.causal,
                           q_len=qmax * c.bs, kv_len=kmax * c.bs, q_lens=qlen, kv_lens=kvlen)
    out, lse = flex.flex_attention_forward(_padding_zeroed(c.q, c.qlen, qmax, c.bs),
                                           _padding_zeroed(c.k, c.kvlen, kmax, c.bs),
                                           _padding_zeroed(c.v, c.kvlen, kmax, c.bs), mask,
                                           c.scale, c.softcap, want_lse)
    sq = c.q.shape[2]
    return out[:, :, :sq], None if lse is None else lse[:, :, :sq]

def check_triton_lengths(who: str, qlen: torch.Tensor, kvlen: torch.Tensor, bs: int,
                         causal: bool, want_lse: bool) -> None:
    """Refuse, naming why, a call of these host lengths that backend "triton"
    (``ops/triton/paged_attention.py``) cannot run. Its query blocks are
    aligned to the keys' blocks: a query block of the call is one of the
    kernel's when every batch's keys before its queries are whole blocks."""
    why = None
    offset = kvlen - qlen
    bad = ((offset < 0) | (offset % bs != 0)).nonzero()
    if not causal:
        why = "is causal only"
    elif want_lse:
        why = "cannot return the log-sum-exp"
    elif bad.numel():
        b = int(bad[0, 0])
        why = (f"needs kv_lens - q_lens to be a whole number of blocks ({bs} tokens) in every "
               f"batch; batch {b} has {int(offset[b])}")
    if why is not None:
        fail(who, "backend", f"'triton' {why}; use 'auto'", "'triton'")

def _triton(c: _Call, want_lse: bool):
    """The paged Triton kernel on contiguous tensors: the keys and values
    cut into one page per block, the queries packed (copies: the kernel reads
    one token stride)."""
    from ..operator.ops.triton.paged_attention import paged_sparse_attention

    check_triton_lengths("block_sparse_attention", c.qlen, c.kvlen, c.bs, c.causal, want_lse)
    batch, hq, sq, dim = c.q.shape
    hkv, skv = c.k.shape[1], c.k.shape[2]
    kmax = ceil_div(skv, c.bs)
    device = c.q.device

    def pages(x):  # [B, Hkv, S, D] -> [B * kmax, bs, Hkv, D]
        x = torch.nn.functional.pad(x.transpose(1, 2), (0, 0, 0, 0, 0, kmax * c.bs - skv))
        return x.reshape(batch * kmax, c.bs, hkv, dim)

    qlen, kvlen = ((c.qlen.to(device), c.kvlen.to(device)) if c.on_device is None
                   else c.on_device[:2])
    context = (kvlen - qlen).to(torch.int64)
    rows = torch.stack([torch.arange(batch, device=device) * sq, context,
                        kvlen.to(torch.int64), context // c.bs], 1).to(torch.int32)
    table = torch.arange(batch * kmax, device=device, dtype=torch.int32).view(batch, kmax)
    out = paged_sparse_attention(c.q.transpose(1, 2).reshape(batch * sq, hq, dim), pages(c.k),
                                 pages(c.v), table, c.idx.to(torch.int32),
                                 c.lengths.to(torch.int32), rows, block_size=c.bs,
                                 scale=c.scale, softcap=c.softcap)
    return out.view(batch, sq, hq, dim).transpose(1, 2), None

def _run(c: _Call, backend: str, want_lse: bool = False):
    """``(out, lse)`` of a checked call (lse None unless ``want_lse``); padded
    query positions zero (and -inf)."""
    if backend == "native":
        check_backend_fits("block_sparse_attention", backend, c.q.device, c.q.dtype)
        native = _native()
        if native is None:
            fail("block_sparse_attention", "backend", "'native' is not available here "
                 f"({_native_status()})", "'native'")
        out, lse = native.sparse_attention(c.q, c.k, c.v, c.idx, c.lengths, c.qlen, c.kvlen,
                                           c.bs, c.causal, c.scale, c.softcap, lse=True)
    elif backend == "flex":
        out, lse = _flex(c, want_lse)
    elif backend == "triton":
        out, lse = _triton(c, want_lse)
    else:
        out, lse = gather_attention(c.q, c.k, c.v, c.idx, c.lengths, c.qlen, c.kvlen, c.bs,
                                    c.causal, c.scale, c.softcap)
    lse = lse.float() if want_lse else None
    if c.on_device is not None:
        pad_q = None if c.on_device[2] is None else ~c.on_device[2]
    else:
        pad_q = torch.arange(c.q.shape[2])[None, :] >= c.qlen[:, None]
        pad_q = pad_q.to(c.q.device) if bool(pad_q.any()) else None
    if pad_q is not None:
        pad_q = pad_q[:, None, :]
        out = out.masked_fill(pad_q[..., None], 0)
        lse = None if lse is None else lse.masked_fill(pad_q, -math.inf)
    return out.to(c.q.dtype), lse


# --------------------------------------------------------------------------- #
# The Stem pipeline
# --------------------------------------------------------------------------- #


class StemInfo(NamedTuple):
    """What one ``stem_attention`` call did (``return_info=True``).

    ``path`` is ``"sparse"`` (the indexer chose the blocks) or ``"dense"``,
    with ``reason``: ``"decode"`` (fewer than ``min_q_blocks`` query blocks),
    ``"budget keeps every block"`` (short sequences), ``"budget keeps most
    blocks"`` (more than ``dense_above`` of the visible pairs) or ``"miss
    check"`` (``miss_check`` found the selection missing attention, and every
    batch attended every block it can see). ``backend`` is the
    kernel that ran (``"native"``, ``"flex"``, ``"gather"`` or ``"sdpa"``).
    ``density`` = ``kept_pairs / visible_pairs``: attended (query block, key
    block) pairs over the causally visible ones, all batches and heads.
    """

    path: str
    reason: str
    backend: str
    kept_pairs: int
    visible_pairs: int

    @property
    def density(self) -> float:
        return self.kept_pairs / self.visible_pairs if self.visible_pairs else 1.0

    def encode(self) -> torch.Tensor:
        """As an int64 tensor, the form a custom op can return."""
        return torch.tensor([_PATHS.index(self.path), _REASONS.index(self.reason),
                             _KERNELS.index(self.backend), self.kept_pairs, self.visible_pairs])

    @classmethod
    def decode(cls, code: torch.Tensor) -> "StemInfo":
        path, reason, backend, kept, visible = code.tolist()
        return cls(_PATHS[path], _REASONS[reason], _KERNELS[backend], kept, visible)

_PATHS = ("sparse", "dense")

_REASONS = ("", "decode", "budget keeps every block", "budget keeps most blocks", "miss check")

_KERNELS = ("native", "flex", "gather", "sdpa", "triton")

def dense_reason(qlen: torch.Tensor, kvlen: torch.Tensor, prompt: torch.Tensor,
                 params: IndexerParams, min_q_blocks: int, dense_above: float) -> str:
    """Why a call of these host int64 lengths runs dense attention (one of
    ``_REASONS``), or "" when the indexer runs: fewer than ``min_q_blocks``
    query blocks, a budget that keeps every block (``contract.dense_is_exact``)
    or more than ``dense_above`` of the visible pairs (``contract.budget_pairs``)."""
    if int(ceil_div(qlen, params.stem_block_size).max()) < min_q_blocks:
        return "decode"
    if contract.dense_is_exact(qlen, kvlen, prompt, params):
        return "budget keeps every block"
    if dense_above < 1.0:
        kept, seen = contract.budget_pairs(qlen, kvlen, prompt, params)
        if seen and kept > dense_above * seen:
            return "budget keeps most blocks"
    return ""

def _visible_pairs(qlen, kvlen, params: IndexerParams) -> int:
    """Visible (query block, key block) pairs per query head, over the batch."""
    bs = params.stem_block_size
    total = 0
    for q_len, kv_len in zip(qlen.tolist(), kvlen.tolist()):
        qb, kb = ceil_div(q_len, bs), ceil_div(kv_len, bs)
        if qb and kb:
            total += int(contract.visible_blocks(torch.arange(qb), qb, kb, params.causal).sum())
    return total

def _dense_lists(qlen, kvlen, bs: int, causal: bool, hq: int, qmax: int, kmax: int, device):
    """Lists of every key block each row's tokens can see: block-sparse
    attention on them is dense attention (with its log-sum-exp)."""
    i = torch.arange(qmax)
    lengths = torch.stack([torch.where(i < ceil_div(q_len, bs),
                                       contract.reach_blocks(i, q_len, kv_len, bs, causal), 0)
                           for q_len, kv_len in zip(qlen, kvlen)])
    lengths = lengths[:, None].expand(-1, hq, -1).to(device)
    idx = torch.arange(kmax, device=device).expand(*lengths.shape, kmax)
    return torch.where(idx < lengths[..., None], idx, -1), lengths

class TailRows(NamedTuple):
    """The rows ``exact_tail`` widens in one batch: query blocks
    ``rows.start .. rows.stop - 1`` of batch ``batch``, each listing the key
    blocks ``0 .. reach - 1`` (``reach`` [len(rows)] int64)."""

    batch: int
    rows: range
    reach: torch.Tensor


def tail_plan(qlen, kvlen, prompt, tail: int, bs: int, causal: bool) -> tuple[TailRows, ...]:
    """Host work of ``exact_tail``: for each batch (host int lengths), the
    query blocks holding the prompt's last ``tail`` tokens
    (``contract.tail_rows``) and the key blocks each one's tokens can see
    (``contract.reach_blocks``). Empty when ``tail`` is 0."""
    if tail <= 0:
        return ()
    plan = []
    for b, (ql, kl, p) in enumerate(zip(qlen.tolist(), kvlen.tolist(), prompt.tolist())):
        r = contract.tail_rows(ql, kl, p, tail, bs)
        if r:
            reach = contract.reach_blocks(torch.arange(r.start, r.stop), torch.tensor(ql),
                                          torch.tensor(kl), bs, causal)
            plan.append(TailRows(b, r, reach))
    return tuple(plan)


def apply_tail(idx: torch.Tensor, lengths: torch.Tensor, plan: tuple[TailRows, ...],
               kmax: int):
    """The indexer's lists with the rows of ``plan`` (``tail_plan``) widened
    to every key block they can see: those rows are then dense attention.
    Tensor work only; the lists are copied (and made ``kmax`` wide) only
    where a row changes."""
    if not plan:
        return idx, lengths
    wide = idx.new_full((*idx.shape[:3], max(kmax, idx.shape[3])), -1)
    wide[..., :idx.shape[3]] = idx
    lengths = lengths.clone()
    blocks = torch.arange(wide.shape[3], device=wide.device)
    for b, r, reach in plan:
        reach = reach.to(wide.device)  # a plan's are there already
        listed = torch.where(blocks < reach[:, None], blocks, -1)
        wide[b, :, r.start:r.stop] = listed.to(wide.dtype)
        lengths[b, :, r.start:r.stop] = reach.to(lengths.dtype)
    return wide, lengths
