"""CPU block-sparse attention in C (``csrc/sparse_attention.c``) over torch's BLAS.

``sparse_attention`` computes, for every row (b, h, i), softmax attention of
query block i of head h restricted to the key blocks listed for the row, with
the token mask (keys ``j < kv_len``; with ``causal``, right-down aligned:
query ``t`` sees key ``j`` iff ``j <= t + kv_len - q_len``). Query tokens with
no visible key and positions ``t >= q_len`` get zeros. Padded positions of q,
k and v (past ``q_len`` / ``kv_len``), and keys a query does not see, never
reach its output, so NaN or inf there cannot leak. NaN and inf in what a
query sees act as in dense softmax attention over its visible keys (on every
instruction set): a NaN or +inf score, or only -inf scores, make its output
NaN; NaN and inf in V reach the dimensions they are in.

Each row multiplies its query block by its listed key blocks (adjacent blocks
in one GEMM) with an online softmax in float32. How the products are made:

* float32: MKL's ``sgemm_`` on Q, K, V where they lie;
* bfloat16, ``bf16="brgemm"``: K^T and V of each (batch, KV head) packed
  once into the VNNI layout, then torch's ``at::native::cpublas::brgemm``
  (oneDNN's micro-kernel, the one behind torch's own CPU flash attention: AMX
  tiles, or AVX512-BF16's vdpbf16ps): bfloat16 products, float32
  accumulation, probabilities rounded to bfloat16 before P V as torch's flash
  kernel does. The default on CPUs whose bfloat16 dot products are faster
  than float32 GEMMs (``torch_blas.bf16_brgemm`` and
  ``torch_blas.bf16_products_pay``: AMX, AMD's AVX512-BF16) where D and the
  block size are even;
* bfloat16, ``bf16="widen"``: products in float32 by ``sgemm_`` (float32
  probabilities), Q widened per row; K and V widened once per (batch, KV
  head) into shared float32 buffers where its rows read each key at least
  twice on average (prefill), else each step's pieces in thread scratch
  (``_widen_mode``). The default elsewhere (AVX2 CPUs, Intel CPUs with
  AVX512-BF16 but no AMX; odd D or block size).

The micro-kernel is tried in a child process before the first such call
for a (D, block size), with every call of the shapes the kernel will make
(``brgemm_probe``, through ``torch_blas.probe``); where the child does not
finish cleanly, bfloat16 is widened instead, with one warning and the reason
in ``status()`` (and ``bf16="brgemm"`` is refused). The CPU indexer's bfloat16
scores use the same micro-kernel and the same probe
(``native.bf16_scores_available``).

The GEMMs come from ``libtorch_cpu.so`` (``torch_blas.py``). Where they are
missing (aarch64, builds without MKL) or the C file cannot be built (see
``native.status``), ``available()`` is False and callers keep their torch path.
Rows are shared by torch's threads (``torch.get_num_threads()``); MKL runs
single-threaded inside each.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from . import native, torch_blas

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int

LIB = native.Library("sparse_attention", {
    "stem_sparse_attention": (_int, [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                                     _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _int,
                                     ctypes.c_double, ctypes.c_double, _int, _int, _ptr, _int,
                                     _int]),
    "stem_sparse_attention_paged": (_int, [_ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr,
                                           _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _ptr,
                                           _i64, _ptr, _ptr, _ptr, _int, ctypes.c_double,
                                           ctypes.c_double, _int, _ptr, _int, _int]),
})

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
BF16_MODES = ("auto", "brgemm", "widen")
ISAS = {"auto": -1, "scalar": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3}
_MODE_SGEMM, _MODE_WIDEN, _MODE_BRGEMM, _MODE_PACK32 = 0, 1, 2, 3
_ERR_MEMORY = 1


def available() -> bool:
    """The kernel can run here (C library built and MKL's sgemm_ found)."""
    return torch_blas.symbols()[0] is not None and native.load(LIB) is not None


def status() -> str:
    """Whether the kernel is in use, and why (builds it on first call); the
    (D, block size) pairs for which the bfloat16 micro-kernel failed its probe."""
    found, why = torch_blas.symbols()
    if found is None:
        return "torch fallback: " + why
    failed = [f"bfloat16 micro-kernel unusable for D={d}, block {bs}, bfloat16 widened instead "
              f"({reason})" for (d, bs), reason in sorted(_probed.items()) if reason]
    pays, reason = torch_blas.bf16_products_pay()
    widened = [] if pays else [f"bfloat16 widened to float32 by default ({reason})"]
    return "; ".join([native.status(LIB) + f"; {why}", *widened, *failed])


def report_fallback() -> None:
    """Warn (once per process) that CPU attention runs without this kernel."""
    native.report_fallback("attention", status())


# --------------------------------------------------------------------------- #
# The bfloat16 micro-kernel's probe
# --------------------------------------------------------------------------- #

STEP_KEYS = 512  # as csrc/sparse_attention.c
_probed: dict[tuple[int, int], str | None] = {}  # (D, block size) -> why unusable, or None
_probe_lock = threading.Lock()


def _probe_calls(dim: int, block_size: int) -> tuple[list[tuple[int, ...]], tuple[int, int, int]]:
    """The brgemm calls csrc/sparse_attention.c makes for (D, block size):
    S = Q K^T over 1 .. step_keys / bs whole blocks of the packed chunk, and
    O += P V over as many, for every count of valid query rows 1 .. bs; and
    the buffer sizes (A, B, C) that cover them all."""
    step_blocks = 1 if block_size >= STEP_KEYS else STEP_KEYS // block_size
    step_keys = step_blocks * block_size
    ld_s = (step_keys + 15) // 16 * 16 + 16
    ld_p = (step_keys + 31) // 32 * 32 + 32
    calls = []
    for m in range(1, block_size + 1):
        for blocks in range(1, step_blocks + 1):
            n = blocks * block_size
            calls.append((m, n, dim, dim, step_keys, ld_s, 0))  # S = Q K^T
            calls.append((m, dim, n, ld_p, dim, dim, 1))  # O += P V
    sizes = (block_size * max(dim, ld_p), step_keys * dim + 64,
             block_size * max(ld_s, dim))
    return calls, sizes


def brgemm_probe(dim: int, block_size: int) -> str | None:
    """Why the bfloat16 micro-kernel cannot be used for (D, block size), or None:
    its calls made in a child process (once per pair in this process)."""
    key = (dim, block_size)
    with _probe_lock:
        if key not in _probed:
            _probed[key] = _run_probe(dim, block_size)
        return _probed[key]


def _run_probe(dim: int, block_size: int) -> str | None:
    return torch_blas.probe(*_probe_calls(dim, block_size))


def _unpackable(dim: int, block_size: int) -> str | None:
    """Why bfloat16 cannot take the micro-kernel for (D, block size) on this
    CPU and torch, before any probe (None where it may)."""
    fns, why = torch_blas.bf16_brgemm()
    if fns is None:
        return why
    if dim % 2 or block_size % 2:
        return f"D and block size must be even (D={dim}, block={block_size})"
    return None


def bf16_packed(dim: int, block_size: int) -> str | None:
    """Why ``bf16="auto"`` would widen bfloat16 for (D, block size) here, or
    None where it takes the packed micro-kernel (probed once)."""
    return _unpackable(dim, block_size) or brgemm_probe(dim, block_size)


def _mode(dtype: torch.dtype, bf16: str, dim: int, block_size: int) -> int:
    if dtype == torch.float32:
        return _MODE_SGEMM
    refused = _unpackable(dim, block_size)
    if bf16 == "brgemm" and refused:
        raise ValueError("sparse_attention: bf16='brgemm' needs torch's bfloat16 micro-kernel "
                         f"and even D and block size ({refused})")
    if bf16 == "auto" and not torch_blas.bf16_products_pay()[0]:
        return _MODE_WIDEN  # the faster here (status() says why)
    if bf16 == "brgemm" or (bf16 == "auto" and not refused):
        why = brgemm_probe(dim, block_size)
        if why is None:
            return _MODE_BRGEMM
        if bf16 == "brgemm":
            raise ValueError(f"sparse_attention: bf16='brgemm' unusable here: {why}")
        native.report_fallback("attention bfloat16 micro-kernel", status())
    return _MODE_WIDEN


def _widen_mode(lengths: torch.Tensor, block_size: int, kv_heads: int, skv: int) -> int:
    """How ``bf16="widen"`` widens K and V: once per (batch, KV head) where
    its rows read each key at least twice on average, else piece by piece."""
    read = int(lengths.sum()) * block_size
    return _MODE_PACK32 if read >= 2 * lengths.shape[0] * kv_heads * skv else _MODE_WIDEN


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                     lengths: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor,
                     block_size: int, causal: bool, scale: float, softcap: float | None = None,
                     *, lse: bool = False, bf16: str = "auto",
                     isa: str = "auto") -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention of q [B, Hq, Sq, D] on k, v [B, Hkv, Skv, D].

    Requires (checked here only where cheap; the caller checks the rest):

    * CPU tensors, one dtype among ``DTYPES`` (float32, bfloat16); Hq a
      multiple of Hkv (query head h uses KV head h // (Hq / Hkv)); q, k, v are
      made contiguous if they are not;
    * idx: integer [B, Hq, ceil(Sq / block_size), W]; each row's first
      ``lengths[b, h, i]`` entries ascending, distinct, in
      ``[0, ceil(Skv / block_size))`` (entries past the length are ignored);
    * lengths: integer [B, Hq, ceil(Sq / block_size)], each in [0, W];
    * q_lens, kv_lens: integer [B], ``q_lens <= Sq``, ``kv_lens <= Skv``;
    * scale: any finite number; softcap: None or > 0 (scaled scores become
      ``softcap * tanh(score / softcap)`` before the softmax).

    ``bf16``: how bfloat16 is multiplied (``"brgemm"`` or ``"widen"``, see the
    module doc; ``"auto"`` picks by hardware). ``isa``: the instruction set of
    the softmax (``"auto"``, or one of ``ISAS`` to test the others on one
    machine). Returns [B, Hq, Sq, D] in q's dtype; with ``lse`` also the
    float32 log-sum-exp [B, Hq, Sq] (natural log) of the scores each query
    attended (-inf where it saw none, and at padded positions).
    """
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"sparse_attention: q, k, v must share a dtype among {list(DTYPES)}; "
                        f"got {q.dtype}, {k.dtype}, {v.dtype}")
    lib, blas = _prepare("sparse_attention", q, idx, lengths, block_size, bf16, isa)
    mode = _mode(q.dtype, bf16, q.shape[3], block_size)
    q, k, v = (t.contiguous() for t in (q, k, v))
    idx, lengths, q_lens, kv_lens = _int64(idx, lengths, q_lens, kv_lens)
    if mode == _MODE_WIDEN:
        mode = _widen_mode(lengths, block_size, k.shape[1], k.shape[2])
    out = torch.empty_like(q)
    lse_out = torch.empty(q.shape[:3], dtype=torch.float32) if lse else None
    code = lib.stem_sparse_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
        None if lse_out is None else lse_out.data_ptr(), q.shape[0], q.shape[1], k.shape[1],
        q.shape[2], k.shape[2], q.shape[3], block_size, idx.data_ptr(), idx.shape[3],
        lengths.data_ptr(), q_lens.data_ptr(), kv_lens.data_ptr(), int(bool(causal)), float(scale),
        float(softcap or 0.0), DTYPES[q.dtype], mode, blas, ISAS[isa], torch.get_num_threads())
    _raise_for("sparse_attention", code, f"shapes {tuple(q.shape)}, {tuple(k.shape)}")
    return (out, lse_out) if lse else out


def _prepare(who: str, q: torch.Tensor, idx: torch.Tensor, lengths: torch.Tensor,
             block_size: int, bf16: str, isa: str):
    """The library and the GEMM table, after the checks both entry points
    share."""
    found = torch_blas.symbols()[0]
    lib = native.load(LIB)
    if found is None or lib is None:
        raise RuntimeError(f"{who}: kernel unavailable ({status()})")
    if bf16 not in BF16_MODES or isa not in ISAS:
        raise ValueError(f"{who}: bf16 in {BF16_MODES}, isa in {list(ISAS)}; "
                         f"got {bf16!r}, {isa!r}")
    if q.dim() != 4:
        raise ValueError(f"{who}: q must be [B, Hq, Sq, D]; got {tuple(q.shape)}")
    batch, hq, sq, _ = q.shape
    qmax = -(-sq // block_size)
    if idx.shape[:3] != (batch, hq, qmax) or lengths.shape != (batch, hq, qmax):
        raise ValueError(f"{who}: idx {tuple(idx.shape)} / lengths "
                         f"{tuple(lengths.shape)} do not match {(batch, hq, qmax)}")
    blas = (ctypes.c_void_p * 4)(found["sgemm_"], found[torch_blas.CPUBLAS[0]],
                                 found[torch_blas.CPUBLAS[1]], found[torch_blas.MKL[1]])
    return lib, blas


def _int64(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(torch.int64).contiguous() for t in tensors)


def _raise_for(who: str, code: int, what: str) -> None:
    if code == _ERR_MEMORY:
        raise MemoryError(f"{who}: no memory for the kernel's scratch")
    if code != 0:
        raise ValueError(f"{who}: arguments refused by the kernel (the isa asked for may not "
                         f"run on this CPU; {what})")


# --------------------------------------------------------------------------- #
# Keys and values packed straight from a paged cache
# --------------------------------------------------------------------------- #

#: ``(offset, sizes, strides)`` of keys or values in one (page, KV head)
#: block: sizes ``(page // a, a, D // b, b)``, element (t, d) at ``offset +
#: (t // a, t % a, d // b, d % b) . strides`` (``kv_read.PageReader.key_view``)
View = tuple[int, tuple[int, ...], tuple[int, ...]]


def paged_refused(page: int, dim: int, block_size: int, key_view: View | None,
                  value_view: View | None, dtype: torch.dtype = torch.bfloat16,
                  bf16: str = "auto") -> str | None:
    """Why ``sparse_attention_paged`` with ``bf16`` cannot read keys and
    values straight from pages of this layout, or None where it can. The
    cache must be bfloat16 (``dtype``) and each half a strided view of the
    page. ``"widen"`` reads any such view (``"auto"`` widens where the
    micro-kernel does not take the pages); ``"brgemm"`` must pass
    ``_brgemm_refused``."""
    if dtype != torch.bfloat16:
        return f"the cache is {dtype}, not bfloat16"
    if key_view is None or value_view is None:
        return "the keys or values are not a strided view of the page"
    if bf16 not in BF16_MODES:
        raise ValueError(f"paged_refused: bf16 in {BF16_MODES}; got {bf16!r}")
    if bf16 == "brgemm":
        return _brgemm_refused(page, dim, block_size, key_view, value_view)
    return None


def paged_products(page: int, dim: int, block_size: int, key_view: View,
                   value_view: View, bf16: str = "auto") -> str:
    """How ``sparse_attention_paged`` with ``bf16`` multiplies for this
    layout here, and why (for logs)."""
    mode, why = _paged_mode(page, dim, block_size, key_view, value_view, bf16)
    if mode == _MODE_BRGEMM:
        return "bfloat16 products on torch's micro-kernel" + (" (as asked)" if why else "")
    return f"float32 products, the pages widened once per KV head ({why})"


def _paged_mode(page: int, dim: int, block_size: int, key_view: View, value_view: View,
                bf16: str) -> tuple[int, str]:
    """The kernel's mode for ``sparse_attention_paged`` and why ("as asked"
    where ``bf16`` named it; "" where ``"auto"`` took the micro-kernel)."""
    if bf16 == "widen":
        return _MODE_PACK32, "as asked"
    pays, reason = torch_blas.bf16_products_pay()
    if bf16 == "auto" and not pays:
        return _MODE_PACK32, reason
    refused = _brgemm_refused(page, dim, block_size, key_view, value_view)
    if refused is None:
        return _MODE_BRGEMM, "as asked" if bf16 == "brgemm" else ""
    if bf16 == "brgemm":
        raise ValueError("sparse_attention_paged: keys and values cannot be packed for the "
                         f"micro-kernel from these pages ({refused})")
    native.report_fallback("paged attention bfloat16 micro-kernel", refused)
    return _MODE_PACK32, refused


def _brgemm_refused(page: int, dim: int, block_size: int, key_view: View,
                    value_view: View) -> str | None:
    """Why the micro-kernel's pack cannot take keys and values straight from
    pages of this layout, or None where it can. The pack goes 16 tokens at a
    time, by runs (csrc ``pack_kinds``): each half must hold either the
    micro-kernel's 32-bit words in runs (vLLM's ``amx`` layout: keys in tiles
    of 16 tokens by pairs of dimensions, values in tiles of dimensions by
    pairs of tokens) or its 16-bit elements in runs along the same axis
    (vLLM's ``vec`` layout: keys transposed, values row-major), and the
    micro-kernel must take it here (``bf16_packed``)."""
    (_, (_, ka, _, kb), (k0, k1, _, k3)), (_, (_, va, _, vb), (_, v1, v2, v3)) = (key_view,
                                                                                    value_view)
    if page % 16:
        return f"pages of {page} tokens are not whole runs of 16"
    words = ka % 16 == 0 and k1 == 2 and kb % 2 == 0 and k3 == 1
    if not words and not (k0 == 1 if ka == 1 else ka % 16 == 0 and k1 == 1):
        return "the keys lie neither in words of 16 tokens nor in runs of 16 tokens"
    words = va % 2 == 0 and v1 == 1 and v3 == 2
    if not words and not (v2 == 1 if vb == 1 else v3 == 1):
        return "the values lie neither in words of a pair of tokens nor in runs of dimensions"
    step = (1 if block_size >= STEP_KEYS else STEP_KEYS // block_size) * block_size
    if step % 16:
        return f"the kernel's steps of {step} keys are not whole runs of 16"
    return _unpackable(dim, block_size) or brgemm_probe(dim, block_size)


def sparse_attention_paged(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                           page: int, key_view: View, value_view: View, idx: torch.Tensor,
                           lengths: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor,
                           block_size: int, causal: bool, scale: float,
                           softcap: float | None = None, *, lse: bool = False,
                           bf16: str = "auto",
                           isa: str = "auto") -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``sparse_attention`` in bfloat16 with the keys and values read from a
    paged cache by the kernel's own packing (no copy of them in token order):
    for the micro-kernel (``bf16="brgemm"``), or widened to float32 once per
    (batch, KV head) (``"widen"``); ``"auto"`` takes the micro-kernel where
    ``sparse_attention``'s would and the layout allows it (``paged_products``
    says which).

    ``cache [num_pages, Hkv, ...]`` bfloat16: the (page, KV head) block
    ``cache[p, h]`` is contiguous and holds a page's keys and values where
    ``key_view`` and ``value_view`` say (each ``View``; as
    ``kv_read.PageReader.probe`` finds them for vLLM's layouts). ``table [B,
    W]`` integer: the page of each sequence's tokens ``[n * page, (n + 1) *
    page)``, for ``n < ceil(kv_len / page)`` (entries past them are not
    read). The layout must pass ``paged_refused`` for ``bf16``. Otherwise as
    ``sparse_attention`` (with Skv the largest ``kv_len``)."""
    who = "sparse_attention_paged"
    if q.dtype != torch.bfloat16 or cache.dtype != torch.bfloat16:
        raise TypeError(f"{who}: q and cache must be bfloat16; got {q.dtype}, {cache.dtype}")
    lib, blas = _prepare(who, q, idx, lengths, block_size, bf16, isa)
    batch, _, _, dim = q.shape
    if page < 1:
        raise ValueError(f"{who}: page must be at least 1; got {page}")
    why = paged_refused(page, dim, block_size, key_view, value_view, cache.dtype, bf16)
    if why:
        raise ValueError(f"{who}: keys and values cannot be packed from these pages ({why})")
    if cache.dim() < 3 or not cache[:1, :1].is_contiguous() or cache.stride(-1) != 1:
        raise ValueError(f"{who}: cache must be [num_pages, Hkv, ...] with each (page, head) "
                         f"block contiguous; got {tuple(cache.shape)} strides {cache.stride()}")
    num_pages, hkv = cache.shape[:2]
    block = cache[0, 0].numel()
    for name, (offset, sizes, strides) in (("key_view", key_view), ("value_view", value_view)):
        last = offset + sum((n - 1) * st for n, st in zip(sizes, strides))
        if (sizes[0] * sizes[1] != page or sizes[2] * sizes[3] != dim or offset < 0
                or min(strides) < 0 or last >= block):
            raise ValueError(f"{who}: {name} {sizes} must cover {page} tokens by {dim} "
                             f"dimensions inside a block of {block} elements, strides "
                             f"not negative")
    if table.dim() != 2 or table.shape[0] != batch or table.dtype.is_floating_point:
        raise ValueError(f"{who}: table must be integer [{batch}, W]; got "
                         f"{tuple(table.shape)} {table.dtype}")
    if q_lens.shape != (batch,) or kv_lens.shape != (batch,):
        raise ValueError(f"{who}: q_lens and kv_lens must be [{batch}]")
    idx, lengths, q_lens, kv_lens, table = _int64(idx, lengths, q_lens, kv_lens, table)
    need = -(-kv_lens // page)
    if bool((kv_lens < 0).any()) or bool((need > table.shape[1]).any()):
        raise ValueError(f"{who}: kv_lens must be in [0, {table.shape[1] * page}] (the table's "
                         f"{table.shape[1]} pages of {page}); got {kv_lens.tolist()}")
    used = table[torch.arange(table.shape[1]) < need[:, None]]
    if used.numel() and not (0 <= int(used.min()) and int(used.max()) < num_pages):
        raise ValueError(f"{who}: table entries in use must be pages in [0, {num_pages})")
    views = torch.tensor([[offset, sizes[1], strides[0], strides[1], sizes[3], strides[2],
                           strides[3]] for offset, sizes, strides in (key_view, value_view)],
                         dtype=torch.int64)
    mode = _paged_mode(page, dim, block_size, key_view, value_view, bf16)[0]
    q = q.contiguous()
    out = torch.empty_like(q)
    lse_out = torch.empty(q.shape[:3], dtype=torch.float32) if lse else None
    skv = int(kv_lens.max()) if batch else 0
    code = lib.stem_sparse_attention_paged(
        q.data_ptr(), cache.data_ptr(), table.data_ptr(), table.shape[1], page, cache.stride(0),
        cache.stride(1), views.data_ptr(), out.data_ptr(),
        None if lse_out is None else lse_out.data_ptr(), batch, q.shape[1], hkv, q.shape[2],
        skv, dim, block_size, idx.data_ptr(), idx.shape[3], lengths.data_ptr(),
        q_lens.data_ptr(), kv_lens.data_ptr(), int(bool(causal)), float(scale),
        float(softcap or 0.0), mode, blas, ISAS[isa], torch.get_num_threads())
    _raise_for(who, code, f"q {tuple(q.shape)}, cache {tuple(cache.shape)}")
    return (out, lse_out) if lse else out
