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
* bfloat16, ``bf16="amx"``: K^T and V of each (batch, KV head) packed once
  into the VNNI layout, then torch's ``at::native::cpublas::brgemm`` (oneDNN's
  AMX micro-kernel, the one behind torch's own CPU flash attention):
  bfloat16 products, float32 accumulation, probabilities rounded to bfloat16
  before P V as torch's flash kernel does. The default where oneDNN can pack
  for AMX (``cpublas::could_pack``), D and the block size are even;
* bfloat16, ``bf16="widen"``: Q and each step's K/V pieces widened to float32
  in thread scratch, then ``sgemm_`` (float32 probabilities). The default
  elsewhere (AVX2 / AVX-512 CPUs without AMX).

The AMX micro-kernel is C++: an exception it threw could not unwind through
the C kernel, OpenMP and ctypes, and would abort the process. So before the
first AMX call for a (D, block size), a child process makes every call of
the shapes the kernel will make (``amx_probe``; a clean result is remembered
in the cache directory); where the child does not finish cleanly, bfloat16
is widened instead, with one warning and the reason in ``status()`` (and
``bf16="amx"`` is refused). The CPU indexer's bfloat16 scores use the same
micro-kernel and the same probe (``native.bf16_scores_available``).

The GEMMs come from ``libtorch_cpu.so`` (MKL's BLAS and the cpublas functions
are exported on x86 builds; the C++ names encode their parameter types, so a
torch whose signatures differ simply does not resolve them). Where they are
missing (aarch64, builds without MKL) or the C file cannot be built (see
``native.status``), ``available()`` is False and callers keep their torch path.
Rows are shared by torch's threads (``torch.get_num_threads()``); MKL runs
single-threaded inside each.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import threading

import torch

from .. import _env
from .._files import write_atomic
from . import native

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int

LIB = native.Library("sparse_attention", {
    "stem_sparse_attention": (_int, [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                                     _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _int,
                                     ctypes.c_double, ctypes.c_double, _int, _int, _ptr, _int,
                                     _int]),
})

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
BF16_MODES = ("auto", "amx", "widen")
ISAS = {"auto": -1, "scalar": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3}
_MODE_SGEMM, _MODE_WIDEN, _MODE_AMX = 0, 1, 2
_BFLOAT16 = 15  # c10::ScalarType::BFloat16
# MKL (C names), then at::native::cpublas (C++ names: brgemm for bfloat16 with
# B in VNNI, brgemm_release, could_pack).
_MKL = ("sgemm_", "MKL_Set_Num_Threads_Local")
_CPUBLAS = ("_ZN2at6native7cpublas6brgemmEllllllbPKN3c108BFloat16ES5_Pfb",
            "_ZN2at6native7cpublas14brgemm_releaseEb",
            "_ZN2at6native7cpublas10could_packEN3c1010ScalarTypeE")
_ERR_MEMORY = 1


def _address(lib: ctypes.CDLL, name: str) -> int | None:
    try:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    except AttributeError:
        return None


@functools.lru_cache(maxsize=1)
def _torch_blas() -> tuple[dict[str, int | None] | None, str]:
    """Addresses of the BLAS functions in torch's library (None where absent),
    or None and why the kernel cannot run."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"no MKL in torch on {platform.machine()}"
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
    except OSError as err:
        return None, f"cannot open {path} ({err})"
    found = {name: _address(lib, name) for name in _MKL + _CPUBLAS}
    if found["sgemm_"] is None:
        return None, f"{path} exports no sgemm_ (torch built without MKL)"
    amx = "with" if all(found[n] for n in _CPUBLAS) else "without"
    return found, f"MKL from {path}, {amx} cpublas::brgemm"


def amx_available() -> bool:
    """torch's oneDNN can pack bfloat16 for AMX here (an AMX CPU, oneDNN
    enabled): asked at each call, as ``torch.backends.mkldnn`` may change."""
    found = _torch_blas()[0]
    if not found or not all(found[n] for n in _CPUBLAS):
        return False
    could_pack = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_int8)(found[_CPUBLAS[2]])
    return bool(could_pack(_BFLOAT16))


def available() -> bool:
    """The kernel can run here (C library built and MKL's sgemm_ found)."""
    return _torch_blas()[0] is not None and native.load(LIB) is not None


def status() -> str:
    """Whether the kernel is in use, and why (builds it on first call); the
    (D, block size) pairs for which the AMX micro-kernel failed its probe."""
    found, why = _torch_blas()
    if found is None:
        return "torch fallback: " + why
    failed = [f"AMX micro-kernel unusable for D={d}, block {bs}, bfloat16 widened instead "
              f"({reason})" for (d, bs), reason in sorted(_probed.items()) if reason]
    return "; ".join([native.status(LIB) + f"; {why}", *failed])


def report_fallback() -> None:
    """Warn (once per process) that CPU attention runs without this kernel."""
    native.report_fallback("attention", status())


# --------------------------------------------------------------------------- #
# The AMX micro-kernel's probe
# --------------------------------------------------------------------------- #

STEP_KEYS = 512  # as csrc/sparse_attention.c
AMX_PROBE_SECONDS = 120
_probed: dict[tuple[int, int], str | None] = {}  # (D, block size) -> why unusable, or None
_probe_lock = threading.Lock()

# Run by the child: argv[1] libtorch_cpu.so, argv[2] brgemm, argv[3]
# brgemm_release, then the calls as "M,N,K,lda,ldb,ldc,add_C;..." and the
# buffer sizes A, B, C (elements). Prints "ok" when every call returned.
PROBE_CODE = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
i64, ptr, b = ctypes.c_int64, ctypes.c_void_p, ctypes.c_bool
brgemm = getattr(lib, sys.argv[2])
brgemm.restype, brgemm.argtypes = None, [i64] * 6 + [b, ptr, ptr, ptr, b]
release = getattr(lib, sys.argv[3])
release.restype, release.argtypes = None, [b]
na, nb, nc = (int(x) for x in sys.argv[5:8])
a, bb, c = (ctypes.c_uint16 * na)(), (ctypes.c_uint16 * nb)(), (ctypes.c_float * nc)()
for call in sys.argv[4].split(";"):
    m, n, k, lda, ldb, ldc, add = (int(x) for x in call.split(","))
    brgemm(m, n, k, lda, ldb, ldc, bool(add), a, bb, c, True)
release(True)
print("ok")
"""


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


def amx_probe(dim: int, block_size: int) -> str | None:
    """Why the AMX micro-kernel cannot be used for (D, block size), or None:
    its calls made in a child process (once per pair in this process)."""
    key = (dim, block_size)
    with _probe_lock:
        if key not in _probed:
            _probed[key] = _run_probe(dim, block_size)
        return _probed[key]


def _run_probe(dim: int, block_size: int) -> str | None:
    return probe(*_probe_calls(dim, block_size))


def probe(calls: list[tuple[int, ...]], sizes: tuple[int, int, int]) -> str | None:
    """Why torch's brgemm cannot be used for these ``calls`` (M, N, K, lda,
    ldb, ldc, add_C; B in VNNI pairs), or None: they are made in a child
    process on zero buffers of ``sizes`` (A, B, C elements), where an
    exception that aborts harms nothing. A clean result is remembered in the
    native kernels' cache directory (where it is this user's alone), keyed by
    torch's library, this CPU and the calls, so that later processes skip it."""
    found = _torch_blas()[0]
    if not found or not all(found[n] for n in _CPUBLAS[:2]):
        return "torch exports no cpublas::brgemm"
    memo = _probe_memo(calls, sizes)
    if memo is not None and not native._untrusted(memo.parent) and not native._untrusted(memo):
        try:
            if memo.read_text() == "ok\n":
                return None
        except OSError:
            pass
    why = _probe_child(calls, sizes)
    if why is None and memo is not None and not native._untrusted(memo.parent):
        try:
            write_atomic(memo, "ok\n")
        except OSError:
            pass
    return why


def _probe_memo(calls, sizes):
    """Where a clean probe of these calls is remembered (None: nowhere)."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        st = os.stat(lib)
    except OSError:
        return None
    key = repr((torch.__version__, lib, st.st_size, st.st_mtime_ns, native._cpu_flags(),
                PROBE_CODE, calls, sizes)).encode()
    return _env.cache_dir() / f"brgemm-probe-{hashlib.sha256(key).hexdigest()[:16]}.ok"


def _probe_child(calls, sizes) -> str | None:
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    cmd = [sys.executable, "-c", PROBE_CODE, path, _CPUBLAS[0], _CPUBLAS[1],
           ";".join(",".join(map(str, c)) for c in calls), *map(str, sizes)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=AMX_PROBE_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"probe failed to run ({err})"
    if proc.returncode == 0 and proc.stdout.strip().endswith("ok"):
        return None
    how = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
           else f"exit status {proc.returncode}")
    tail = " ".join(proc.stderr.strip().splitlines()[-3:])[-300:]
    return f"its probe {how}" + (f": {tail}" if tail else "")


def _mode(dtype: torch.dtype, bf16: str, dim: int, block_size: int) -> int:
    if dtype == torch.float32:
        return _MODE_SGEMM
    amx_fits = dim % 2 == 0 and block_size % 2 == 0
    if bf16 == "amx" and not (amx_fits and amx_available()):
        raise ValueError("sparse_attention: bf16='amx' needs an AMX CPU with torch's oneDNN "
                         f"enabled and even D and block size (D={dim}, block={block_size})")
    if bf16 == "amx" or (bf16 == "auto" and amx_fits and amx_available()):
        why = amx_probe(dim, block_size)
        if why is None:
            return _MODE_AMX
        if bf16 == "amx":
            raise ValueError(f"sparse_attention: bf16='amx' unusable here: {why}")
        native.report_fallback("attention AMX", status())
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

    ``bf16``: how bfloat16 is multiplied (``"amx"`` or ``"widen"``, see the
    module doc; ``"auto"`` picks by hardware). ``isa``: the instruction set of
    the softmax (``"auto"``, or one of ``ISAS`` to test the others on one
    machine). Returns [B, Hq, Sq, D] in q's dtype; with ``lse`` also the
    float32 log-sum-exp [B, Hq, Sq] (natural log) of the scores each query
    attended (-inf where it saw none, and at padded positions).
    """
    found = _torch_blas()[0]
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
    table = (ctypes.c_void_p * 4)(found["sgemm_"], found[_CPUBLAS[0]], found[_CPUBLAS[1]],
                                  found["MKL_Set_Num_Threads_Local"])
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
