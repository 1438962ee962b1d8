"""Upstream of the indexer: Q/K/V -> ``qflat``, ``kflat``, ``vbias`` (docs/CONTRACT.md section 7).

All functions are vectorised torch code (no per-token Python loops) and run on
whatever device the inputs live on.

Conventions shared by every function here:

* ``q`` is ``[B, Hq, Sq, D]``, ``k`` and ``v`` are ``[B, Hkv, Skv, D]``;
* optional per-batch lengths (``q_lens``, ``kv_lens``: a 1-D integer tensor
  or a sequence of ints, one entry per batch) mark the valid tokens of each
  sequence as positions ``[0, len)``; everything past ``len`` is padding and
  never influences a result;
* a block is ``block_size`` tokens (Bs); it is viewed as ``[R, Ts, D]`` with
  ``Ts = stride`` and ``R = Bs / Ts``, token ``t = r*Ts + s``; the ``Ts``
  representative vectors of a block are the sums over ``r``;
* the last block of a sequence may be partial (a tail block): its padded
  positions contribute zero to every sum.

Block representations (``block_representation``):
``rep[b, h, i, s*D:(s+1)*D] = sum_r x[b, h, i*Bs + r*Ts + s]``; with
``reverse=True`` (keys) the groups are stored in reversed order, slot
``Ts-1-s`` holding group ``s``, so that ``dot(qflat, kflat)`` pairs query group
``s`` with key group ``Ts-1-s`` (the stride-Ts antidiagonal score). Sums are
taken in float32 and rounded once to the output dtype (bfloat16 for the op).

Output-Aware Metric (``output_aware_bias``), per (batch, KV head), with ``L``
the valid length:

* runs: run ``m`` is tokens ``[m*Ts, (m+1)*Ts)``; the valid runs are the
  ``n = ceil(L / Ts)`` runs holding at least one valid token. A partial last
  run (``L % Ts != 0``) is a valid run whose norm is the largest over its
  valid tokens only;
* ``l_m = log(max_t ||v_t||_2 + eps)`` over the run's valid tokens;
* ``z_m = (l_m - mean) / (std + eps)``, mean and unbiased std over the ``n``
  valid runs (statistics in float64). With ``n < 2`` the unbiased std is
  undefined: every ``z`` is then 0 and the bias is 0 (one run carries no
  information about which blocks stand out);
* ``vbias[j] = lambda * (1/R) * sum over the R runs of block j of relu(z_m)``:
  the mean over the block's R runs, where runs past the valid length count as
  0 (as padded positions contribute zero to kflat's sums). Blocks past the
  valid length get 0.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence, Union

import torch

from ..operator.contract import ceil_div, check_int, fail, is_finite

__all__ = [
    "StemInputs",
    "stem_inputs",
    "block_representation",
    "output_aware_bias",
    "bias_from_run_max",
    "represent",
    "value_bias",
    "valid_tokens",
    "indexer_inputs",
    "seq_lens_tensor",
    "lens_argument",
    "check_lens_values",
]

_EPS = 1e-6
DEFAULT_OAM_LAMBDA = 0.3

# Per-batch token counts: a 1-D integer tensor, a sequence of ints, or None
# (every sequence the tensor's full length).
Lengths = Union[torch.Tensor, Sequence[int], None]


class StemInputs(NamedTuple):
    """The indexer's tensor inputs, ready for ``stem_indexer``."""

    qflat: torch.Tensor  #: (B, Hq, ceil(Sq/Bs), Ts*D) bfloat16
    kflat: torch.Tensor  #: (B, Hkv, ceil(Skv/Bs), Ts*D) bfloat16, reversed groups
    vbias: torch.Tensor  #: (B, Hkv, ceil(Skv/Bs)) float32
    q_seq_lens: torch.Tensor  #: (B,) int32 query tokens per batch
    kv_seq_lens: torch.Tensor  #: (B,) int32 KV tokens per batch


def _check_4d(name: str, x, who: str) -> None:
    if not isinstance(x, torch.Tensor):
        fail(who, name, "must be a torch.Tensor", type(x).__name__)
    if x.dim() != 4:
        fail(who, name, "must be 4-D [B, H, S, D]", f"shape {tuple(x.shape)}")
    if not x.is_floating_point():
        fail(who, name, "must be a floating-point tensor", x.dtype)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, who: str, *,
              same_dtype: bool = False) -> tuple[int, int, int, int, int, int]:
    """q [B,Hq,Sq,D], k and v [B,Hkv,Skv,D] of one shape, one device, Hq % Hkv
    == 0, non-empty dims; returns (B, Hq, Hkv, Sq, Skv, D). Errors name
    ``who`` (the calling function) and the argument."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_4d(name, x, who)
    if k.shape != v.shape:
        fail(who, "v", f"must have the shape of k {tuple(k.shape)}", tuple(v.shape))
    for name, x in (("k", k), ("v", v)):
        if same_dtype and x.dtype != q.dtype:
            fail(who, name, f"must have q's dtype ({q.dtype})", x.dtype)
    if len({q.device, k.device, v.device}) > 1:
        fail(who, "k", "and v must be on q's device", (str(k.device), str(v.device)))
    batch, hq, sq, dim = q.shape
    kb, hkv, skv, kdim = k.shape
    if kb != batch:
        fail(who, "k", f"batch dim must equal q's ({batch})", kb)
    if kdim != dim:
        fail(who, "k", f"head dim must equal q's ({dim})", kdim)
    if hkv < 1 or hq % hkv:
        fail(who, "q", f"heads (dim 1) must be a multiple of k's heads ({hkv})", hq)
    if batch == 0 or sq == 0 or dim == 0:
        fail(who, "q", "must have non-empty batch, sequence and head dims", tuple(q.shape))
    if skv == 0:
        fail(who, "k", "must have a non-empty sequence dim", tuple(k.shape))
    return batch, hq, hkv, sq, skv, dim


def check_oam_lambda(oam_lambda: float, who: str) -> None:
    if (isinstance(oam_lambda, bool) or not isinstance(oam_lambda, (int, float))
            or not is_finite(oam_lambda)):
        fail(who, "oam_lambda", "must be a finite number", oam_lambda)


def check_blocking(block_size: int, stride: int, who: str,
                   names: tuple[str, str] = ("block_size", "stride")) -> None:
    """``block_size`` and ``stride`` (called ``names`` in errors) are positive
    ints with Bs % Ts == 0."""
    check_int(who, names[0], block_size, 1)
    check_int(who, names[1], stride, 1)
    if block_size % stride:
        fail(who, names[0], f"must be a multiple of {names[1]} ({stride})", block_size)


def lens_argument(lens: Lengths, batch: int, max_len: int, name: str, who: str) -> torch.Tensor:
    """Per-batch lengths as an int64 tensor (on ``lens``' device when it is
    one), checked for everything but their values (``check_lens_values``).

    ``lens`` is None (every sequence is ``max_len`` long), a 1-D integer
    tensor or a sequence of ints, with one entry per batch.
    """
    if lens is None:
        return torch.full((batch,), max_len, dtype=torch.int64)
    if isinstance(lens, torch.Tensor):
        if lens.dim() != 1:
            fail(who, name, "must be 1-D (one length per batch)", f"shape {tuple(lens.shape)}")
        if lens.is_floating_point() or lens.is_complex() or lens.dtype == torch.bool:
            fail(who, name, "must have an integer dtype", lens.dtype)
        t = lens.detach().to(torch.int64)
    else:
        try:
            values = [int(x) for x in lens]
        except (TypeError, ValueError):
            fail(who, name, "must be a 1-D integer tensor or a sequence of ints",
                 type(lens).__name__)
        t = torch.tensor(values, dtype=torch.int64)
    if t.shape[0] != batch:
        fail(who, name, f"must have one entry per batch ({batch})", f"{t.shape[0]} entries")
    return t


def check_lens_values(lens: torch.Tensor, max_len: int, name: str, who: str) -> torch.Tensor:
    """A host int64 copy of ``lens``, every entry in ``[0, max_len]``."""
    host = lens.to("cpu", torch.int64)
    bad = ((host < 0) | (host > max_len)).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        fail(who, f"{name}[{b}]", f"must be in [0, {max_len}] (the sequence dim)", int(host[b]))
    return host


def seq_lens_tensor(lens: Lengths, batch: int, max_len: int, name: str, device: torch.device,
                    who: str) -> torch.Tensor:
    """Per-batch lengths as an int64 tensor on ``device``, fully checked."""
    t = lens_argument(lens, batch, max_len, name, who)
    return check_lens_values(t, max_len, name, who).to(device)


def block_representation(
    x: torch.Tensor, block_size: int, stride: int, reverse: bool = False,
    lens: Lengths = None, *, scale: float | None = None, dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Block representations of ``x [B, H, S, D]``: ``[B, H, ceil(S/Bs), Ts*D]``.

    Each block of Bs tokens gives Ts vectors, vector ``s`` the float32 sum of
    the R = Bs/Ts tokens ``r*Ts + s``; they are concatenated in natural order
    (``reverse=False``, qflat) or reversed (``reverse=True``, kflat: slot
    ``Ts-1-s`` holds group ``s``). Positions at or past ``lens[b]`` and the
    padding of a tail block contribute zero. ``scale``, when given, multiplies
    the float32 sums before the single rounding to ``dtype``.
    """
    who = "block_representation"
    _check_4d("x", x, who)
    check_blocking(block_size, stride, who)
    batch, _, seq, _ = x.shape
    valid = None
    if lens is not None:
        valid = valid_tokens(seq_lens_tensor(lens, batch, seq, "lens", x.device, who), seq)
    return represent(x, block_size, stride, valid, reverse=reverse, scale=scale, dtype=dtype)


def represent(x: torch.Tensor, block_size: int, stride: int, valid: torch.Tensor | None, *,
              reverse: bool = False, scale: float | None = None,
              dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``block_representation`` on checked arguments, tensor work only:
    ``valid [B, S]`` bool marks the valid tokens (None: every one)."""
    batch, heads, seq, dim = x.shape
    nblocks = ceil_div(seq, block_size)
    ratio = block_size // stride
    if valid is not None:
        x = x.masked_fill(~valid[:, None, :, None], 0)
    pad = nblocks * block_size - seq
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    rep = x.reshape(batch, heads, nblocks, ratio, stride, dim).sum(dim=3, dtype=torch.float32)
    if reverse:
        rep = rep.flip(3)
    if scale is not None:
        rep = rep * float(scale)
    return rep.reshape(batch, heads, nblocks, stride * dim).to(dtype)


def output_aware_bias(
    v: torch.Tensor, block_size: int, stride: int, lens: Lengths = None, *,
    oam_lambda: float = DEFAULT_OAM_LAMBDA, eps: float = _EPS,
) -> torch.Tensor:
    """The Output-Aware Metric ``vbias [B, Hkv, ceil(Skv/Bs)]`` float32 of ``v``.

    See the module docstring for the exact definition (runs of ``stride``
    tokens, log of the largest value norm, standardised over the valid runs,
    relu, mean over each block's runs, times ``oam_lambda``).
    """
    who = "output_aware_bias"
    _check_4d("v", v, who)
    check_blocking(block_size, stride, who)
    check_oam_lambda(oam_lambda, who)
    batch, _, seq, _ = v.shape
    lens = seq_lens_tensor(lens, batch, seq, "lens", v.device, who)
    valid = torch.arange(seq, device=v.device) < lens[:, None]
    return value_bias(v, block_size, stride, valid, ceil_div(lens, stride), oam_lambda, eps)


def value_bias(v: torch.Tensor, block_size: int, stride: int, valid: torch.Tensor | None,
               valid_runs: torch.Tensor, oam_lambda: float = DEFAULT_OAM_LAMBDA,
               eps: float = _EPS) -> torch.Tensor:
    """``output_aware_bias`` on checked arguments, tensor work only: ``valid
    [B, S]`` bool marks the valid tokens (None: every one), ``valid_runs
    [B]`` is ``ceil(len / stride)``."""
    batch, heads, seq, _ = v.shape
    nblocks = ceil_div(seq, block_size)
    ratio = block_size // stride
    nruns = nblocks * ratio
    # float32 norms whatever v's dtype (vector_norm's dtype= refuses narrowing)
    norms = torch.linalg.vector_norm(v.float(), dim=-1)  # (B, H, S)
    if valid is not None:
        # Norms are >= 0, so zeroed padding never wins a run's max over valid tokens.
        norms = norms.masked_fill(~valid[:, None, :], 0.0)
    norms = torch.nn.functional.pad(norms, (0, nblocks * block_size - seq))
    run_max = norms.view(batch, heads, nruns, stride).amax(dim=-1)
    return bias_from_run_max(run_max, valid_runs, ratio, oam_lambda, eps)


def bias_from_run_max(run_max: torch.Tensor, valid_runs: torch.Tensor, ratio: int,
                      oam_lambda: float = DEFAULT_OAM_LAMBDA, eps: float = _EPS,
                      stat_runs: torch.Tensor | None = None) -> torch.Tensor:
    """The Output-Aware Metric from each run's largest value norm.

    ``run_max [B, H, nruns]`` float32 (``nruns`` a multiple of ``ratio`` = R,
    runs past the valid ones ignored), ``valid_runs [B]`` the valid runs per
    batch. Returns ``vbias [B, H, nruns / R]`` float32, as ``output_aware_bias``
    (which is this on the run maxima of ``v``; the vLLM backend's indexer
    cache keeps the run maxima of the pages it writes and calls this).
    ``stat_runs [B]`` (at most ``valid_runs``): standardise over the first
    ``stat_runs`` runs only (a fixed window, so that the statistic does not
    depend on how many tokens are present); None: over every valid run.
    """
    batch, heads, nruns = run_max.shape
    logs = torch.log(run_max.double() + eps)
    n = valid_runs.to(device=run_max.device, dtype=torch.int64)
    runs = torch.arange(nruns, device=run_max.device)
    run_valid = (runs < n[:, None])[:, None, :]
    if stat_runs is not None:
        n = torch.minimum(stat_runs.to(device=run_max.device, dtype=torch.int64), n)
    in_stat = (runs < n[:, None])[:, None, :]
    nf = n.to(torch.float64)[:, None, None]
    mean = torch.where(in_stat, logs, 0.0).sum(-1, keepdim=True) / nf.clamp(min=1)
    centred = torch.where(run_valid, logs - mean, 0.0)
    var = torch.where(in_stat, centred, 0.0).square().sum(-1, keepdim=True) \
        / (nf - 1).clamp(min=1)
    std = torch.where(nf >= 2, var.sqrt(), 0.0)
    z = torch.where(run_valid & (nf >= 2), centred / (std + eps), 0.0)
    per_block = torch.relu(z).view(batch, heads, nruns // ratio, ratio).sum(-1) / ratio
    return (float(oam_lambda) * per_block).to(torch.float32)


def stem_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    stem_block_size: int = 128, stem_stride: int = 16, q_lens: Lengths = None,
    kv_lens: Lengths = None, scale: float | None = None, oam: bool = True,
    oam_lambda: float = DEFAULT_OAM_LAMBDA,
) -> StemInputs:
    """Turn ``q [B,Hq,Sq,D]``, ``k, v [B,Hkv,Skv,D]`` into the indexer's inputs.

    Args:
        q, k, v: floating-point tensors on one device; ``Hq % Hkv == 0``,
            ``k`` and ``v`` of one shape, one head dim ``D`` throughout.
        stem_block_size, stem_stride: Bs and Ts of the indexer; Bs % Ts == 0.
        q_lens, kv_lens: valid tokens per batch (positions ``[0, len)``);
            None means the full sequence dim.
        scale: folded into ``qflat`` (multiplies the float32 sums before the
            bfloat16 rounding); None folds nothing. The indexer itself only
            applies 1/R^2.
        oam: compute the Output-Aware Metric; False gives an all-zero vbias.
        oam_lambda: the OAM weight lambda.

    Returns:
        ``StemInputs(qflat, kflat, vbias, q_seq_lens, kv_seq_lens)`` with the
        lengths as int32 tensors on the inputs' device.
    """
    who = "stem_inputs"
    block_size, stride = stem_block_size, stem_stride
    batch, hq, hkv, sq, skv, dim = check_qkv(q, k, v, who)
    check_blocking(block_size, stride, who, ("stem_block_size", "stem_stride"))
    q_len = seq_lens_tensor(q_lens, batch, sq, "q_lens", q.device, who)
    kv_len = seq_lens_tensor(kv_lens, batch, skv, "kv_lens", q.device, who)
    if oam:
        check_oam_lambda(oam_lambda, who)
    qflat, kflat, vbias = indexer_inputs(
        q, k, v, valid_tokens(q_len, sq), valid_tokens(kv_len, skv), ceil_div(kv_len, stride),
        block_size, stride, scale, oam, oam_lambda)
    return StemInputs(qflat, kflat, vbias, q_len.to(torch.int32), kv_len.to(torch.int32))


def valid_tokens(lens: torch.Tensor, seq: int) -> torch.Tensor | None:
    """``[B, seq]`` bool, the tokens before each batch's length (on the
    lengths' device), or None when every token is valid."""
    valid = torch.arange(seq, device=lens.device) < lens[:, None]
    return None if bool(valid.all()) else valid


def indexer_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   q_valid: torch.Tensor | None, kv_valid: torch.Tensor | None,
                   valid_runs: torch.Tensor, block_size: int, stride: int,
                   scale: float | None, oam: bool,
                   oam_lambda: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``stem_inputs``'s qflat, kflat and vbias on checked arguments, tensor
    work only: the valid-token masks (``valid_tokens``) and the valid runs
    ``ceil(kv_len / stride)`` given."""
    qflat = represent(q, block_size, stride, q_valid, scale=scale)
    kflat = represent(k, block_size, stride, kv_valid, reverse=True)
    if oam:
        vbias = value_bias(v, block_size, stride, kv_valid, valid_runs, oam_lambda)
    else:
        vbias = v.new_zeros(*k.shape[:2], ceil_div(k.shape[2], block_size),
                            dtype=torch.float32)
    return qflat, kflat, vbias

