"""The argument checks of the attention functions (``attention.py``,
``flash.py``, ``integrations/transformers.py``): each bad argument raises
``StemIndexerInputError`` naming the function, the argument and the rule.
Shapes, types and devices only (fine while tracing), except the selection's
values (``_selection_values``), read where the lists lie."""

from __future__ import annotations

import math

import torch

from ..operator.contract import (IndexerParams, check_bool, check_dense_above, check_exact_tail,
                                 check_int, default_dense_above, fail)
from .prepare import DEFAULT_OAM_LAMBDA, check_oam_lambda, is_finite

BACKENDS = ("auto", "native", "flex", "gather", "triton")

# No model has this many attention heads; more, and more than tokens, is a
# tensor in another layout.
MAX_HEADS = 1024


def _check_scale(who: str, name: str, scale, dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not is_finite(scale):
        fail(who, name, "must be a finite number or None", scale)
    return float(scale)

def _check_softcap(who: str, softcap) -> float | None:
    if softcap is None:
        return None
    if (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
            or not (is_finite(softcap) and softcap > 0)):
        fail(who, "softcap", "must be None or a finite number > 0", softcap)
    return float(softcap)

def _check_backend(who: str, backend) -> None:
    if backend not in BACKENDS:
        fail(who, "backend", f"must be one of {', '.join(map(repr, BACKENDS))}", repr(backend))

def check_backend_fits(who: str, backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """A backend asked for by name runs on q's device and dtype: the native
    kernel reads CPU memory (a CUDA tensor's pointer would crash it) and
    multiplies float32 or bfloat16 only; the Triton kernel runs CUDA tensors
    (CPU ones under the Triton interpreter) of 16- or 32-bit floats. (Static:
    fine while tracing.)"""
    if backend == "triton":
        check_triton_device(who, device)
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            fail(who, "backend", f"'triton' runs bfloat16, float16 and float32 (q is {dtype}); "
                 "use 'auto' or 'gather'", "'triton'")
    if backend != "native":
        return
    if torch.device(device).type != "cpu":
        fail(who, "backend", f"'native' runs on CPU tensors only (q is on {device}); use "
             "'auto', 'flex' or 'gather'", "'native'")
    from ..operator.ops.sparse_attention import DTYPES
    if dtype not in DTYPES:
        fail(who, "backend", f"'native' runs on float32 and bfloat16 only (q is {dtype}); use "
             "'auto' or 'gather'", "'native'")

def check_triton_device(who: str, device: torch.device) -> None:
    """Triton is installed, and runs tensors of ``device``: CUDA ones, or CPU
    ones under the Triton interpreter."""
    try:
        from ..operator.ops.triton import launch
    except ImportError as exc:
        fail(who, "backend", f"'triton' needs Triton ({exc}); use 'auto'", "'triton'")
    if torch.device(device).type != "cuda" and not launch.INTERPRETED:
        fail(who, "backend", f"'triton' runs CUDA tensors (here {device}), or CPU tensors "
             "under the Triton interpreter (TRITON_INTERPRET=1); use 'auto'", "'triton'")

def _check_inference(who: str, *tensors: torch.Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        fail(who, "q, k, v", "must not require grad: this function is inference-only (call it "
             "under torch.no_grad() or torch.inference_mode())", "requires_grad=True")

def check_stem_options(who: str, *, causal: bool = True, preset: str = "default",
                       oam: bool = True, oam_lambda: float = DEFAULT_OAM_LAMBDA,
                       indexer_scale: float | None = None, min_q_blocks: int = 2,
                       exact_tail: int = 0, backend: str = "auto",
                       **indexer_params) -> tuple[IndexerParams, float | None]:
    """The checks of ``stem_attention``'s options that need no tensor (the
    indexer's parameters and preset, the OAM, the dense threshold, the exact
    tail, the backend), in one place for every caller that fixes them ahead
    of the call (``integrations.transformers.register``). Returns the
    indexer's parameters and ``indexer_scale`` as a float (or None)."""
    params = IndexerParams.from_kwargs(who, preset=preset, causal=causal, **indexer_params)
    check_bool(who, "oam", oam)
    check_oam_lambda(oam_lambda, who)
    check_int(who, "min_q_blocks", min_q_blocks, 0)
    check_exact_tail(who, exact_tail)
    _check_backend(who, backend)
    if indexer_scale is not None:
        indexer_scale = _check_scale(who, "indexer_scale", indexer_scale, 1)
    return params, indexer_scale

def check_call_options(who: str, device: torch.device, dtype: torch.dtype, head_dim: int, *,
                       scale, softcap, dense_above, backend: str = "auto", **options):
    """``stem_attention``'s keywords checked for tensors of this device, dtype
    and head dim (``stem_attention`` and ``stem_plan`` alike): ``(params,
    indexer_scale, scale, softcap, dense_above)``, each default resolved."""
    params, indexer_scale = check_stem_options(who, backend=backend, **options)
    check_backend_fits(who, backend, device, dtype)
    scale = _check_scale(who, "scale", scale, head_dim)
    softcap = _check_softcap(who, softcap)
    check_dense_above(who, dense_above)
    if dense_above is None:
        dense_above = default_dense_above(device, dtype)
    return params, indexer_scale, scale, softcap, dense_above

def _check_layout(who: str, q, k, layout: str) -> None:
    """Refuse shapes that can only be another layout's (more heads than any
    model has, and more than tokens)."""
    heads, tokens = (q.shape[1], q.shape[2]) if layout == "[B, H, S, D]" else (q.shape[2],
                                                                               q.shape[1])
    if heads > MAX_HEADS and heads > tokens:
        other = "[B, S, H, D]" if layout == "[B, H, S, D]" else "[B, H, S, D]"
        fail(who, "q", f"is read as {layout}, which gives {heads} heads of {tokens} tokens: is "
             f"it {other}? (stem_attention takes [B, H, S, D], stem_attn_func [B, S, H, D])",
             f"shape {tuple(q.shape)}")

def _check_selection(who, sparse_indices, sparse_seq_len, batch, hq, qmax, device) -> None:
    """The selection's types, shapes and device (static: fine while tracing)."""
    for name, t, nd in (("sparse_indices", sparse_indices, 4),
                        ("sparse_seq_len", sparse_seq_len, 3)):
        if not isinstance(t, torch.Tensor):
            fail(who, name, "must be a torch.Tensor", type(t).__name__)
        if t.dim() != nd:
            fail(who, name, f"must be {nd}-D", f"shape {tuple(t.shape)}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            fail(who, name, "must have an integer dtype", t.dtype)
        if t.device != device:
            fail(who, name, f"must be on q's device ({device})", t.device)
    if tuple(sparse_indices.shape[:3]) != (batch, hq, qmax):
        fail(who, "sparse_indices", f"must have shape (B, Hq, ceil(Sq/block_size), W) with "
             f"(B, Hq, ceil(Sq/block_size)) = {(batch, hq, qmax)}", tuple(sparse_indices.shape))
    if tuple(sparse_seq_len.shape) != (batch, hq, qmax):
        fail(who, "sparse_seq_len", f"must have shape {(batch, hq, qmax)}",
             tuple(sparse_seq_len.shape))

def _selection_values(who, sparse_indices, sparse_seq_len, kmax):
    """The selection's values checked (on its device); lists sorted ascending.

    Returns (indices int64 [B,Hq,Qmax,W], lengths int64 [B,Hq,Qmax]) with W
    the longest list and entries past each row's length -1.
    """
    device = sparse_indices.device
    width = sparse_indices.shape[3]
    lengths = sparse_seq_len.detach().to(torch.int64)
    _first_bad(who, "sparse_seq_len", (lengths < 0) | (lengths > width), lengths,
               f"must be in [0, {width}] (sparse_indices' last dim)")
    width = int(lengths.max()) if lengths.numel() else 0
    idx = sparse_indices[..., :width].detach().to(torch.int64)
    listed = torch.arange(width, device=device) < lengths[..., None]
    _first_bad(who, "sparse_indices", listed & ((idx < 0) | (idx >= kmax)), idx,
               f"must be a key block in [0, {kmax})")
    idx = torch.where(listed, idx, kmax)
    if not bool((idx[..., 1:] >= idx[..., :-1]).all()):  # the indexer's lists are sorted
        idx = idx.sort(dim=-1).values
    dup = torch.zeros_like(listed)
    dup[..., 1:] = listed[..., 1:] & (idx[..., 1:] == idx[..., :-1])
    _first_bad(who, "sparse_indices", dup, idx, "must not list a key block twice")
    return torch.where(listed, idx, -1), lengths

def _first_bad(who: str, name: str, bad: torch.Tensor, values: torch.Tensor, rule: str) -> None:
    if bool(bad.any()):
        at = bad.nonzero()[0].tolist()
        fail(who, f"{name}[{', '.join(map(str, at))}]", rule, int(values[tuple(at)]))
