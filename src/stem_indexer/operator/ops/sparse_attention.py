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
  kernel does. The default on CPUs with bfloat16 dot products
  (``torch_blas.bf16_brgemm``) where D and the block size are even;
* bfloat16, ``bf16="widen"``: Q and each step's K/V pieces widened to float32
  in thread scratch, then ``sgemm_`` (float32 probabilities). The default
  elsewhere (AVX2 CPUs; odd D or block size).

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
})

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
BF16_MODES = ("auto", "brgemm", "widen")
ISAS = {"auto": -1, "scalar": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3}
_MODE_SGEMM, _MODE_WIDEN, _MODE_BRGEMM = 0, 1, 2
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
    return "; ".join([native.status(LIB) + f"; {why}", *failed])


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
    if bf16 == "brgemm" or (bf16 == "auto" and not refused):
        why = brgemm_probe(dim, block_size)
        if why is None:
            return _MODE_BRGEMM
        if bf16 == "brgemm":
            raise ValueError(f"sparse_attention: bf16='brgemm' unusable here: {why}")
        native.report_fallback("attention bfloat16 micro-kernel", status())
    return _MODE_WIDEN


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
    found = torch_blas.symbols()[0]
    lib = native.load(LIB)
    if found is None or lib is None:
        raise RuntimeError(f"sparse_attention: kernel unavailable ({status()})")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"sparse_attention: q, k, v must share a dtype among {list(DTYPES)}; "
                        f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if bf16 not in BF16_MODES or isa not in ISAS:
        raise ValueError(f"sparse_attention: bf16 in {BF16_MODES}, isa in {list(ISAS)}; "
                         f"got {bf16!r}, {isa!r}")
    batch, hq, sq, dim = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    qmax = -(-sq // block_size)
    if idx.shape[:3] != (batch, hq, qmax) or lengths.shape != (batch, hq, qmax):
        raise ValueError(f"sparse_attention: idx {tuple(idx.shape)} / lengths "
                         f"{tuple(lengths.shape)} do not match {(batch, hq, qmax)}")
    mode = _mode(q.dtype, bf16, dim, block_size)
    q, k, v = (t.contiguous() for t in (q, k, v))
    idx, lengths, q_lens, kv_lens = (t.to(torch.int64).contiguous()
                                     for t in (idx, lengths, q_lens, kv_lens))
    out = torch.empty_like(q)
    lse_out = torch.empty((batch, hq, sq), dtype=torch.float32) if lse else None
    table = (ctypes.c_void_p * 4)(found["sgemm_"], found[torch_blas.CPUBLAS[0]],
                                  found[torch_blas.CPUBLAS[1]], found[torch_blas.MKL[1]])
    code = lib.stem_sparse_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
        None if lse_out is None else lse_out.data_ptr(), batch, hq, hkv, sq, skv, dim,
        block_size, idx.data_ptr(), idx.shape[3], lengths.data_ptr(), q_lens.data_ptr(),
        kv_lens.data_ptr(), int(bool(causal)), float(scale), float(softcap or 0.0),
        DTYPES[q.dtype], mode, table, ISAS[isa], torch.get_num_threads())
    if code == _ERR_MEMORY:
        raise MemoryError("sparse_attention: no memory for the kernel's scratch")
    if code != 0:
        raise ValueError(f"sparse_attention: arguments refused by the kernel (isa={isa!r} "
                         f"may not run on this CPU; shapes {tuple(q.shape)}, {tuple(k.shape)})")
    return (out, lse_out) if lse else out
