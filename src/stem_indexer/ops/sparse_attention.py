"""CPU block-sparse attention in C (``csrc/sparse_attention.c``) over torch's MKL.

``sparse_attention`` computes, for every row (b, h, i), softmax attention of
query block i of head h restricted to the key blocks listed for the row, with
the token mask (keys ``j < kv_len``; with ``causal``, right-down aligned:
query ``t`` sees key ``j`` iff ``j <= t + kv_len - q_len``). Query tokens with
no visible key and positions ``t >= q_len`` get zeros. Padded positions of q,
k and v (past ``q_len`` / ``kv_len``) are never read into a valid output, so
NaN or inf there cannot leak.

Each row multiplies its query block by its listed key blocks where they lie in
K and V (adjacent blocks in one GEMM), with an online softmax in float32:

* float32: MKL ``sgemm_``, float32 throughout;
* bfloat16, ``bf16="gemm"``: MKL ``cblas_gemm_bf16bf16f32`` (bfloat16
  products, float32 accumulation; the probabilities are rounded to bfloat16
  before P V, as in torch's CPU flash kernel). The default where the CPU has
  bfloat16 hardware (``avx512_bf16`` or ``amx_bf16``): MKL runs it on AMX /
  AVX512-BF16 there;
* bfloat16, ``bf16="convert"``: K/V pieces and Q widened to float32 in thread
  scratch, then ``sgemm_`` (float32 probabilities). The default elsewhere
  (MKL's bfloat16 GEMM has no hardware to run on).

The GEMMs come from ``libtorch_cpu.so``, which exports MKL's BLAS on x86
builds; where it does not (aarch64, builds without MKL) or the C file cannot be
built (see ``native.status``), ``available()`` is False and callers keep their
torch path. Rows are shared by torch's threads (``torch.get_num_threads()``),
MKL runs single-threaded inside each.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

import torch

from . import native

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int

LIB = native.Library("sparse_attention", {
    "stem_sparse_attention": (_int, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
                                     _i64, _ptr, _i64, _ptr, _ptr, _ptr, _int, ctypes.c_double,
                                     _int, _int, _ptr, _int, _int]),
})

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
BF16_MODES = ("auto", "gemm", "convert")
ISAS = {"auto": -1, "scalar": 0, "avx2": 1, "avx512": 2}
_SYMBOLS = ("sgemm_", "cblas_gemm_bf16bf16f32", "MKL_Set_Num_Threads_Local")
_ERR_MEMORY, _ERR_ARGS = 1, 2


@functools.lru_cache(maxsize=1)
def _blas() -> tuple[tuple[int, int, int] | None, str]:
    """Addresses of MKL's sgemm_, cblas_gemm_bf16bf16f32 and
    MKL_Set_Num_Threads_Local in torch's library, or None and why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"no MKL in torch on {platform.machine()}"
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                     for name in _SYMBOLS), f"MKL from {path}"
    except (OSError, AttributeError) as err:
        return None, f"torch's library exports no MKL BLAS ({err})"


@functools.lru_cache(maxsize=1)
def bf16_hardware() -> bool:
    """The CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def available() -> bool:
    """The kernel can run here (C library built and MKL's BLAS found)."""
    return _blas()[0] is not None and native.load(LIB) is not None


def status() -> str:
    """Whether the kernel is in use, and why (builds it on first call)."""
    blas, why = _blas()
    if blas is None:
        return "torch fallback: " + why
    return native.status(LIB) + f"; {why}"


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                     lengths: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor,
                     block_size: int, causal: bool, scale: float, *, bf16: str = "auto",
                     isa: str = "auto") -> torch.Tensor:
    """Block-sparse attention of q [B, Hq, Sq, D] on k, v [B, Hkv, Skv, D].

    Requires (checked here only where cheap; the caller checks the rest):

    * CPU tensors, one dtype among ``DTYPES`` (float32, bfloat16); Hq a
      multiple of Hkv (query head h uses KV head h // (Hq / Hkv)); q, k, v are
      made contiguous if they are not;
    * idx: integer [B, Hq, ceil(Sq / block_size), W]; each row's first
      ``lengths[b, h, i]`` entries ascending, distinct, in
      ``[0, ceil(Skv / block_size))`` (entries past the length are ignored);
    * lengths: integer [B, Hq, ceil(Sq / block_size)], each in [0, W];
    * q_lens, kv_lens: integer [B], ``q_lens <= Sq``, ``kv_lens <= Skv``.

    ``bf16``: how bfloat16 is multiplied (``"gemm"``, ``"convert"``, see the
    module doc; ``"auto"`` picks by hardware). ``isa``: the instruction set of
    the softmax (``"auto"``, or ``"avx512"`` / ``"avx2"`` / ``"scalar"`` to
    test the others on one machine). Returns [B, Hq, Sq, D] in q's dtype.
    """
    blas, why = _blas()
    lib = native.load(LIB)
    if blas is None or lib is None:
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
    q, k, v = (t.contiguous() for t in (q, k, v))
    idx, lengths, q_lens, kv_lens = (t.to(torch.int64).contiguous()
                                     for t in (idx, lengths, q_lens, kv_lens))
    out = torch.empty_like(q)
    convert = bf16 == "convert" or (bf16 == "auto" and not bf16_hardware())
    table = (ctypes.c_void_p * 3)(*blas)
    code = lib.stem_sparse_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), batch, hq, hkv, sq, skv, dim,
        block_size, idx.data_ptr(), idx.shape[3], lengths.data_ptr(), q_lens.data_ptr(),
        kv_lens.data_ptr(), int(bool(causal)), float(scale), DTYPES[q.dtype], int(convert),
        table, ISAS[isa], torch.get_num_threads())
    if code == _ERR_MEMORY:
        raise MemoryError("sparse_attention: no memory for the kernel's scratch")
    if code != 0:
        raise ValueError(f"sparse_attention: arguments refused by the kernel (isa={isa!r} "
                         f"may not run on this CPU; shapes {tuple(q.shape)}, {tuple(k.shape)})")
    return out
