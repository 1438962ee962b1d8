"""The functions of torch's own CPU library that the native kernels call.

``libtorch_cpu.so`` exports MKL's BLAS (``sgemm_``) and, on x86 builds,
oneDNN's bfloat16 micro-kernel behind ``at::native::cpublas::brgemm``. The
attention kernel (``sparse_attention.py``) calls both, the indexer's
bfloat16 scores (``native.py``) the micro-kernel; both find them here, and
both try the micro-kernel here first (``probe``).

The micro-kernel is C++: an exception it threw could not unwind through the
C kernels, OpenMP and ctypes, and would abort the process. So before a
kernel makes its first calls of some shapes, a child process makes every
one of them on zero buffers (``probe``); a clean result is remembered in
the native kernels' cache directory (where it is this user's alone), keyed
by torch's library, this CPU and the calls.

The C++ names encode their parameter types, so a torch whose signatures
differ simply does not resolve them. This module imports neither kernel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys

import torch

from .. import _env
from .._files import untrusted, write_atomic

# MKL (C names), then at::native::cpublas (C++ names: brgemm for bfloat16 with
# B in VNNI, brgemm_release).
MKL = ("sgemm_", "MKL_Set_Num_Threads_Local")
CPUBLAS = ("_ZN2at6native7cpublas6brgemmEllllllbPKN3c108BFloat16ES5_Pfb",
           "_ZN2at6native7cpublas14brgemm_releaseEb")
PROBE_SECONDS = 120


def _library_path() -> str:
    return os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")


def _address(lib: ctypes.CDLL, name: str) -> int | None:
    try:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    except AttributeError:
        return None


@functools.lru_cache(maxsize=1)
def symbols() -> tuple[dict[str, int | None] | None, str]:
    """Addresses of ``MKL`` and ``CPUBLAS`` in torch's library (None where
    absent), or None and why there is no BLAS to call; and a description."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"no MKL in torch on {platform.machine()}"
    path = _library_path()
    try:
        lib = ctypes.CDLL(path)
    except OSError as err:
        return None, f"cannot open {path} ({err})"
    found = {name: _address(lib, name) for name in MKL + CPUBLAS}
    if found["sgemm_"] is None:
        return None, f"{path} exports no sgemm_ (torch built without MKL)"
    brgemm = "with" if all(found[n] for n in CPUBLAS) else "without"
    return found, f"MKL from {path}, {brgemm} cpublas::brgemm"


def brgemm() -> tuple[int, int] | None:
    """The addresses of ``cpublas::brgemm`` and ``brgemm_release``, or None."""
    found = symbols()[0]
    if not found or not all(found[n] for n in CPUBLAS):
        return None
    return found[CPUBLAS[0]], found[CPUBLAS[1]]


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo: bfloat16 dot products


def bf16_brgemm() -> tuple[tuple[int, int] | None, str]:
    """torch's ``cpublas::brgemm`` and ``brgemm_release`` where its bfloat16
    micro-kernel can run (an x86-64 CPU with bfloat16 dot products: AMX
    tiles, or AVX512-BF16's vdpbf16ps), or None; and what runs, or why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"no oneDNN micro-kernel in torch on {platform.machine()}"
    if not set(cpu_flags().split()) & set(BF16_CPU_FLAGS):
        return None, "the CPU has no bfloat16 dot product instructions"
    fns = brgemm()
    if fns is None:
        return None, "torch exports no cpublas::brgemm"
    return fns, "torch's cpublas::brgemm (oneDNN)"


@functools.cache
def bf16_products_pay() -> tuple[bool, str]:
    """Whether bfloat16 dot products multiply faster than MKL's float32 GEMM
    on this CPU, and why: with AMX tiles, and on AMD's AVX512-BF16 cores
    (Zen 4 and 5: torch's bfloat16 GEMM 2.5x to 5x its float32 one), yes.
    An Intel CPU with AVX512-BF16 and no AMX (Cooper Lake, or a newer Xeon
    whose host hides AMX) issues its vdpbf16ps at half the rate of its
    float32 FMAs, the same products per cycle, and there torch's bfloat16
    GEMM measured 0.72x the speed of its float32 one (benchmarks/RESULTS.md,
    "An Intel Xeon without AMX"): no; the float32 paths run instead."""
    flags = set(cpu_flags().split())
    if "amx_bf16" in flags:
        return True, "AMX tiles"
    if "avx512_bf16" not in flags:
        return False, "the CPU has no bfloat16 dot product instructions"
    if cpu_vendor() == "GenuineIntel":
        return False, ("an Intel CPU with AVX512-BF16 but no AMX: its bfloat16 dot products "
                       "are no faster than float32 FMAs")
    return True, "AVX512-BF16"


@functools.cache
def cpu_vendor() -> str:
    """The ``vendor_id`` of /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``), or ""."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""
    return line.split(":", 1)[1].strip() if ":" in line else ""


@functools.cache
def cpu_flags() -> str:
    """The ``flags`` line of /proc/cpuinfo (where there is none, the processor's name)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


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


def probe(calls: list[tuple[int, ...]], sizes: tuple[int, int, int]) -> str | None:
    """Why torch's brgemm cannot be used for these ``calls`` (M, N, K, lda,
    ldb, ldc, add_C; B in VNNI pairs), or None: they are made in a child
    process on zero buffers of ``sizes`` (A, B, C elements), where an
    exception that aborts harms nothing; a clean result is remembered."""
    if brgemm() is None:
        return "torch exports no cpublas::brgemm"
    memo = _probe_memo(calls, sizes)
    if memo is not None and not untrusted(memo.parent) and not untrusted(memo):
        try:
            if memo.read_text() == "ok\n":
                return None
        except OSError:
            pass
    why = _probe_child(calls, sizes)
    if why is None and memo is not None and not untrusted(memo.parent):
        try:
            write_atomic(memo, "ok\n")
        except OSError:
            pass
    return why


def _probe_memo(calls, sizes):
    """Where a clean probe of these calls is remembered (None: nowhere)."""
    lib = _library_path()
    try:
        st = os.stat(lib)
    except OSError:
        return None
    key = repr((torch.__version__, lib, st.st_size, st.st_mtime_ns, cpu_flags(),
                PROBE_CODE, calls, sizes)).encode()
    return _env.cache_dir() / f"brgemm-probe-{hashlib.sha256(key).hexdigest()[:16]}.ok"


def _probe_child(calls, sizes) -> str | None:
    cmd = [sys.executable, "-c", PROBE_CODE, _library_path(), CPUBLAS[0], CPUBLAS[1],
           ";".join(",".join(map(str, c)) for c in calls), *map(str, sizes)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"probe failed to run ({err})"
    if proc.returncode == 0 and proc.stdout.strip().endswith("ok"):
        return None
    how = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
           else f"exit status {proc.returncode}")
    tail = " ".join(proc.stderr.strip().splitlines()[-3:])[-300:]
    return f"its probe {how}" + (f": {tail}" if tail else "")
