"""Plan once, run without the host: ``stem_attention`` in two halves.

``stem_plan`` does all of a call's host work for one batch shape: the
argument checks, the path (dense or sparse, and why), the kernel, the visible
block pairs, the indexer's metadata, the rows ``exact_tail`` widens, the
masks of padded tokens, the lengths on the device. ``stem_run(q, k, v, plan)``
is tensor work and kernel calls only: it reads nothing on the host (no
``.item()``, ``int(tensor)``, ``bool(tensor)`` or ``.tolist()``), and it
compiles with ``torch.compile(fullgraph=True, dynamic=True)`` to the same
result, bit for bit: its steps are custom ops (``stem_indexer::``
``planned_inputs``, ``planned_indexer``, ``planned_attention``,
``planned_dense``) that trust the plan's checked values instead of checking
them again, joined by integer tensor work (the exact tail's rows).

One plan serves every layer of a forward pass that shares its lengths,
heads and settings (``stem_attention`` keeps the last few plans it made, so
the transformers integration plans once per forward, not once per layer).

    plan = stem_plan(q_lens, kv_lens, num_heads=32, num_kv_heads=8, head_dim=128,
                     device="cuda", dtype=torch.bfloat16, preset="default")
    for layer in layers:
        out = stem_run(q, k, v, plan)   # the same result as stem_attention(q, k, v, ...)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..operator import contract
from ..operator.api import stem_indexer_metadata
from .checks import _check_inference, check_call_options
from ..operator.contract import DEFAULT_EXACT_TAIL, IndexerParams, ceil_div, check_bool, fail
from .dense import _dense
from .probe import selection_miss
from .dispatch import (StemInfo, TailRows, _backend_for, _dense_lists, _visible_pairs,
                       apply_tail, check_triton_lengths, dense_reason, tail_plan)
from .prepare import (DEFAULT_OAM_LAMBDA, Lengths, check_lens_values, indexer_inputs,
                      lens_argument, valid_tokens)

__all__ = ["StemPlan", "stem_plan", "stem_run"]


@dataclass(frozen=True, eq=False)
class PlanSettings:
    """What every plan's run takes besides its lengths (``StemPlan``, and
    ``paged.PagedPlan``): the layer's heads, the tensors it runs on, the
    indexer's parameters and the attention's scales, each checked."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    device: torch.device
    dtype: torch.dtype
    params: IndexerParams
    scale: float
    softcap: float | None
    indexer_scale: float
    oam: bool
    oam_lambda: float


@dataclass(frozen=True, eq=False)
class StemPlan(PlanSettings):
    """What ``stem_run`` needs for one batch shape, every host value decided.

    ``info`` is the path the plan takes (``StemInfo``; a sparse plan's
    ``kept_pairs`` is 0: the indexer's picks are known only after a run).
    Tensors live on the plan's device unless named host."""

    batch: int
    q_len: int  #: the padded query length (q's sequence dim)
    kv_len: int  #: the padded key length
    return_lse: bool
    info: StemInfo
    #: the lengths (int64) on the host, and (int32) on the device
    qlen: torch.Tensor
    kvlen: torch.Tensor
    q_seq_lens: torch.Tensor
    kv_seq_lens: torch.Tensor
    #: [B, S] bool valid-token masks on the device (None: no padding)
    q_valid: torch.Tensor | None
    kv_valid: torch.Tensor | None
    #: sparse: prompt lengths (int32), metadata, valid runs of the OAM
    prompt: torch.Tensor | None = None
    metadata: torch.Tensor | None = None
    valid_runs: torch.Tensor | None = None
    tail: tuple[TailRows, ...] = ()
    #: dense through the block kernels (for the lse or the softcap): every
    #: visible block listed
    lists: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def path(self) -> str:
        return self.info.path

    def check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The shapes, dtype and device the plan was made for (metadata only:
        no value is read)."""
        want_q = (self.batch, self.num_heads, self.q_len, self.head_dim)
        want_kv = (self.batch, self.num_kv_heads, self.kv_len, self.head_dim)
        for name, x, want in (("q", q, want_q), ("k", k, want_kv), ("v", v, want_kv)):
            if tuple(x.shape) != want:
                fail("stem_run", name, f"must have the plan's shape {list(want)}",
                     f"shape {tuple(x.shape)}")
            if x.dtype != self.dtype or x.device != self.device:
                fail("stem_run", name, f"must be {self.dtype} on {self.device}, as planned",
                     f"{x.dtype} on {x.device}")
        _check_inference("stem_run", q, k, v)


def stem_plan(
    q_lens: Lengths, kv_lens: Lengths, *, num_heads: int, num_kv_heads: int, head_dim: int,
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
    q_len: int | None = None, kv_len: int | None = None, num_prompt_tokens: Lengths = None,
    causal: bool = True, scale: float | None = None, softcap: float | None = None,
    preset: str = "default", oam: bool = True, oam_lambda: float = DEFAULT_OAM_LAMBDA,
    indexer_scale: float | None = None, min_q_blocks: int = 2,
    dense_above: float | None = None, exact_tail: int = DEFAULT_EXACT_TAIL,
    backend: str = "auto", return_lse: bool = False, **indexer_params,
) -> StemPlan:
    """All host work of ``stem_attention`` for one batch shape.

    Args:
        q_lens, kv_lens: valid tokens per batch (host ints or a tensor; read
            once, here).
        num_heads, num_kv_heads, head_dim: q's and k/v's heads and head dim.
        device, dtype: those of the q, k, v the plan will run on.
        q_len, kv_len: the padded sequence dims of q and k/v (default the
            longest length).
        The rest: ``stem_attention``'s keywords, with the same defaults and
        checks.

    Returns:
        A ``StemPlan`` for ``stem_run``.
    """
    who = "stem_plan"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    qlen = lens_argument(q_lens, _batch(q_lens), 2**31 - 1, "q_lens", who).cpu()
    batch = qlen.shape[0]
    if batch == 0:
        fail(who, "q_lens", "must hold one length per batch, at least one", "[]")
    kvlen = lens_argument(kv_lens, batch, 2**31 - 1, "kv_lens", who).cpu()
    q_len = int(qlen.max()) if q_len is None else q_len
    kv_len = int(kvlen.max()) if kv_len is None else kv_len
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("q_len", q_len), ("kv_len", kv_len)):
        contract.check_int(who, name, value, 1)
    if num_heads % num_kv_heads:
        fail(who, "num_heads", f"must be a multiple of num_kv_heads ({num_kv_heads})",
             num_heads)
    qlen = check_lens_values(qlen, q_len, "q_lens", who)
    kvlen = check_lens_values(kvlen, kv_len, "kv_lens", who)
    prompt = kvlen
    if num_prompt_tokens is not None:
        prompt = lens_argument(num_prompt_tokens, batch, 2**31 - 1, "num_prompt_tokens", who)
        prompt = check_lens_values(prompt.cpu(), 2**31 - 1, "num_prompt_tokens", who)
        contract.check_prompt(prompt, kvlen, who, "kv_lens")
    params, indexer_scale, scale, softcap, dense_above = check_call_options(
        who, device, dtype, head_dim, scale=scale, softcap=softcap, dense_above=dense_above,
        causal=causal, preset=preset, oam=oam, oam_lambda=oam_lambda,
        indexer_scale=indexer_scale, min_q_blocks=min_q_blocks, exact_tail=exact_tail,
        backend=backend, **indexer_params)
    check_bool(who, "return_lse", return_lse)
    if backend == "triton":
        check_triton_lengths(who, qlen, kvlen, params.stem_block_size, params.causal,
                             return_lse)
    return build_plan(Shape(batch, num_heads, num_kv_heads, q_len, kv_len, head_dim, device,
                            dtype), qlen, kvlen, prompt, params, scale, softcap, oam,
                      float(oam_lambda), indexer_scale, min_q_blocks, backend, return_lse,
                      float(dense_above), exact_tail)


def _batch(q_lens: Lengths) -> int:
    """The batch size ``q_lens`` gives (its checks are ``lens_argument``'s)."""
    if isinstance(q_lens, torch.Tensor) and q_lens.dim() == 1:
        return q_lens.shape[0]
    try:
        return len(q_lens)
    except TypeError:
        fail("stem_plan", "q_lens", "must be a 1-D integer tensor or a sequence of ints (one "
             "length per batch)", type(q_lens).__name__)


@dataclass(frozen=True)
class Shape:
    """The tensors a plan is for."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    device: torch.device
    dtype: torch.dtype


@functools.lru_cache(maxsize=16)
def cached_plan(shape: Shape, q_lens: tuple, kv_lens: tuple, prompt: tuple,
                params: IndexerParams, *options) -> StemPlan:
    """``build_plan`` on host tuples, kept for the next call with the same
    ones (the next layer of a forward pass)."""
    as_tensor = functools.partial(torch.tensor, dtype=torch.int64)
    return build_plan(shape, as_tensor(q_lens), as_tensor(kv_lens), as_tensor(prompt), params,
                      *options)


def build_plan(shape: Shape, qlen: torch.Tensor, kvlen: torch.Tensor, prompt: torch.Tensor,
               params: IndexerParams, scale: float, softcap: float | None, oam: bool,
               oam_lambda: float, indexer_scale: float | None, min_q_blocks: int,
               backend: str, want_lse: bool, dense_above: float,
               exact_tail: int) -> StemPlan:
    """The plan of checked arguments (host int64 lengths)."""
    s, device = shape, shape.device
    bs, stride = params.stem_block_size, params.stem_stride
    visible = _visible_pairs(qlen, kvlen, params) * s.heads
    kernel = _backend_for(backend, device, s.dtype)
    reason = dense_reason(qlen, kvlen, prompt, params, min_q_blocks, dense_above)
    common = dict(batch=s.batch, num_heads=s.heads, num_kv_heads=s.kv_heads, q_len=s.q_len,
                  kv_len=s.kv_len, head_dim=s.head_dim, device=device, dtype=s.dtype,
                  params=params, scale=scale, softcap=softcap,
                  indexer_scale=scale / stride if indexer_scale is None else indexer_scale,
                  oam=oam, oam_lambda=oam_lambda, return_lse=want_lse, qlen=qlen,
                  kvlen=kvlen, q_seq_lens=qlen.to(device=device, dtype=torch.int32),
                  kv_seq_lens=kvlen.to(device=device, dtype=torch.int32),
                  q_valid=valid_tokens(qlen.to(device), s.q_len),
                  kv_valid=valid_tokens(kvlen.to(device), s.kv_len))
    qmax, kmax = ceil_div(s.q_len, bs), ceil_div(s.kv_len, bs)
    if reason and not (want_lse or softcap):
        return StemPlan(info=StemInfo("dense", reason, "sdpa", visible, visible), **common)
    if reason:
        lists = _dense_lists(qlen, kvlen, bs, params.causal, s.heads, qmax, kmax, device)
        return StemPlan(info=StemInfo("dense", reason, kernel, visible, visible),
                        lists=lists, **common)
    metadata = stem_indexer_metadata(
        common["q_seq_lens"], common["kv_seq_lens"], s.heads, s.kv_heads, causal=params.causal,
        stem_block_size=bs, dim_qkflat=stride * s.head_dim, window_size=params.window_size)
    tail = tuple(TailRows(t.batch, t.rows, t.reach.to(device))
                 for t in tail_plan(qlen, kvlen, prompt, exact_tail, bs, params.causal))
    return StemPlan(info=StemInfo("sparse", "", kernel, 0, visible), **common,
                    prompt=prompt.to(device=device, dtype=torch.int32), metadata=metadata,
                    valid_runs=ceil_div(kvlen, stride).to(device), tail=tail)




def stem_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             plan: StemPlan) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Stem attention of ``q [B, Hq, Sq, D]``, ``k, v [B, Hkv, Skv, D]`` on the
    plan made for them: ``stem_attention``'s result (and, with the plan's
    ``return_lse``, its log-sum-exp). Tensor work and kernels only."""
    plan.check_inputs(q, k, v)
    out, lse, _, _ = execute(q, k, v, plan)
    return (out, lse) if plan.return_lse else out


def execute(q, k, v, plan: StemPlan, miss_check: tuple[float, int, int, int] | None = None):
    """``(out, lse or None, lengths or None, widened)``: the run, with the
    sparse path's list lengths (for counting the kept pairs). With
    ``miss_check`` ``(miss, queries, blocks, first)``, miss > 0, each batch's
    selection is checked (``widen_missed``); ``widened`` counts the batches
    that then attended every block."""
    p = plan.params
    if plan.info.backend == "sdpa":
        out = torch.ops.stem_indexer.planned_dense(q, k, v, plan.qlen, plan.kvlen, p.causal,
                                                   plan.scale)
        return out, None, None, 0
    if plan.lists is not None:
        idx, lengths = plan.lists
    else:
        bs, stride = p.stem_block_size, p.stem_stride
        qflat, kflat, vbias = torch.ops.stem_indexer.planned_inputs(
            q, k, v, plan.q_valid, plan.kv_valid, plan.valid_runs, bs, stride,
            plan.indexer_scale, plan.oam, plan.oam_lambda)
        idx, lengths = torch.ops.stem_indexer.planned_indexer(
            qflat, kflat, vbias, plan.q_seq_lens, plan.kv_seq_lens,
            num_prompt_tokens=plan.prompt, metadata=plan.metadata, causal=p.causal,
            stem_block_size=bs, stem_stride=stride, alpha=p.alpha,
            initial_blocks=p.initial_blocks, window_size=p.window_size,
            k_block_num_rate_medium=p.k_block_num_rate_medium,
            k_block_num_bias_medium=p.k_block_num_bias_medium,
            k_block_num_rate_large=p.k_block_num_rate_large,
            k_block_num_bias_large=p.k_block_num_bias_large,
            topk_score_precision=p.topk_score_precision)
        idx, lengths = apply_tail(idx, lengths, plan.tail, ceil_div(plan.kv_len, bs))
    widened = 0
    if miss_check and miss_check[0] > 0 and plan.lists is None:
        idx, lengths, widened = widen_missed(q, k, idx, lengths, plan, *miss_check)
    out, lse = torch.ops.stem_indexer.planned_attention(
        q, k, v, idx, lengths, plan.qlen, plan.kvlen, plan.q_seq_lens, plan.kv_seq_lens,
        plan.q_valid, p.stem_block_size, p.causal, plan.scale, plan.softcap,
        plan.info.backend, plan.return_lse)
    return (out, (lse if plan.return_lse else None),
            (None if plan.lists is not None else lengths), widened)


def widen_missed(q, k, idx, lengths, plan: StemPlan, miss: float, queries: int, blocks: int,
                 first: int = 0):
    """The miss check on a run's lists (``stem_attention``'s ``miss_check``):
    each batch whose causal prefill (``q_len == kv_len``) keeps more than
    ``miss`` less of a sample of exact attention than the heaviest blocks
    would (``probe.selection_miss``) lists every block it can see instead,
    in its query blocks that start at ``first`` or later (a prompt shorter
    than that is not checked). Returns ``(idx, lengths, batches widened
    whole)``. Reads the miss on the host: not under CUDA graph capture."""
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        fail("stem_attention", "miss_check", "reads the selection's miss on the host, so it "
             "cannot run inside a CUDA graph capture; set it to 0 there", miss)
    p = plan.params
    bs = p.stem_block_size
    wide = []
    for b in range(plan.batch):
        qlen, kvlen = int(plan.qlen[b]), int(plan.kvlen[b])
        if not p.causal or qlen != kvlen or qlen <= first:
            continue
        missed, sampled, _ = selection_miss(
            q[b, :, :qlen].transpose(0, 1), k[b, :, :kvlen].transpose(0, 1),
            idx[b, :, :ceil_div(qlen, bs)], lengths[b, :, :ceil_div(qlen, bs)], context=0,
            seq_len=kvlen, block_size=bs, queries=queries, blocks=blocks, scale=plan.scale,
            softcap=plan.softcap)
        if sampled and missed > miss:
            wide.append(b)
    if not wide:
        return idx, lengths, 0
    every, every_len = _dense_lists(plan.qlen, plan.kvlen, bs, True, plan.num_heads,
                                    idx.shape[2], ceil_div(plan.kv_len, bs), idx.device)
    idx = torch.nn.functional.pad(idx, (0, every.shape[3] - idx.shape[3]), value=-1)
    batches = torch.zeros(plan.batch, 1, 1, dtype=torch.bool, device=idx.device)
    batches[wide] = True
    rows = batches & (torch.arange(idx.shape[2], device=idx.device) >= ceil_div(first, bs))
    idx = torch.where(rows[..., None], every.to(idx.dtype), idx)
    lengths = torch.where(rows, every_len.to(lengths.dtype), lengths)
    return idx, lengths, len(wide) if first == 0 else 0


# The run's floating-point work outside the kernels, as custom ops: compiled,
# the run then keeps eager's operations and summation order, so its result is
# eager's to the bit on any CPU or GPU (inductor would fuse and reorder them).

@torch.library.custom_op("stem_indexer::planned_inputs", mutates_args=())
def _planned_inputs_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       q_valid: torch.Tensor | None, kv_valid: torch.Tensor | None,
                       valid_runs: torch.Tensor, block_size: int, stride: int,
                       indexer_scale: float, oam: bool,
                       oam_lambda: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``prepare.indexer_inputs`` on a plan's masks."""
    return indexer_inputs(q, k, v, q_valid, kv_valid, valid_runs, block_size, stride,
                          indexer_scale, oam, oam_lambda)

@_planned_inputs_op.register_fake
def _(q, k, v, q_valid, kv_valid, valid_runs, block_size, stride, indexer_scale, oam,
      oam_lambda):
    width = stride * q.shape[3]
    qb, kb = ceil_div(q.shape[2], block_size), ceil_div(k.shape[2], block_size)
    return (q.new_empty(*q.shape[:2], qb, width, dtype=torch.bfloat16),
            k.new_empty(*k.shape[:2], kb, width, dtype=torch.bfloat16),
            v.new_empty(*k.shape[:2], kb, dtype=torch.float32))

@torch.library.custom_op("stem_indexer::planned_dense", mutates_args=())
def _planned_dense_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: torch.Tensor,
                      kv_lens: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Dense attention on a plan's host lengths (``dense._dense``)."""
    return _dense(q, k, v, causal, scale, q_lens, kv_lens).contiguous()

@_planned_dense_op.register_fake
def _(q, k, v, q_lens, kv_lens, causal, scale):
    return q.new_empty(q.shape)
