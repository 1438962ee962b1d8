"""Native CPU kernels: plain C files in ``csrc/``, built at first use, verified, loaded.

Each kernel is one C file with no dependency (not even on torch's headers),
compiled with the system C compiler into a cache directory and called through
``ctypes``. Built with ``-fopenmp`` where the compiler has it, a kernel binds
to the ``libgomp.so.1`` torch has loaded and so runs on torch's own thread
pool (threads of a second pool would compete with torch's spinning workers
for the cores); compilers without OpenMP build it serial.

What gets loaded is checked, so that a damaged or planted file can neither
crash the process nor run:

* the cache directory must belong to the current user and be writable by
  nobody else; otherwise nothing is built or loaded there (one warning) and
  the callers fall back to torch operations;
* next to each library lies the SHA-256 of the file as this package built
  it; a library is loaded only when its digest matches (a truncated,
  replaced or foreign file is rebuilt instead) and when it has every
  function it must have;
* a build is compiled to a private temporary file, loaded from there, then
  moved into place atomically, so concurrent builders never see each
  other's half-written files.

Without a compiler, when a build fails or with ``STEM_INDEXER_NATIVE=0`` a
library is None and its callers use their torch fallback (same results,
slower). ``status()`` says, for every kernel, which and why; the first call
in a process that falls back from a kernel warns once for it
(``report_fallback``). Environment: see ``_env.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import math
import mmap
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import _env
from .._files import untrusted, write_atomic
from .._threads import thread_count
from . import torch_blas

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ("-O3", "-std=c11", "-shared", "-fPIC")
OPENMP = ("-fopenmp",)
COMPILE_SECONDS = 120
# A selection of fewer keys and output entries than this runs on one thread:
# waking a thread team would cost more than it saves.
PARALLEL_MIN_WORK = 1 << 16

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@dataclass(frozen=True)
class Library:
    """One C file of ``csrc/`` and the functions Python calls in it.

    ``functions`` maps each exported name to ``(restype, argtypes)``.
    """

    source: str
    functions: dict = field(hash=False, compare=False)
    cflags: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return CSRC / f"{self.source}.c"


SELECT_ROWS = Library("select_rows", {
    "stem_select_rows": (ctypes.c_int, [_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64,
                                        _i64, _i64, ctypes.c_int, _ptr, _i64, _i64, _i64,
                                        ctypes.c_int]),
    "stem_scores_bf16": (ctypes.c_int, [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _i64,
                                        _ptr, _i64, _i64, _ptr, _i64, _i64, _i64,
                                        ctypes.c_float, _ptr, _i64, ctypes.c_int,
                                        ctypes.c_int, ctypes.c_int, _ptr]),
    "stem_scores_dp": (ctypes.c_int, [_i64, _i64, _i64, _i64, _i64, _ptr, _i64, _i64,
                                      _ptr, _i64, _i64, _ptr, _i64, _i64, _i64,
                                      ctypes.c_float, _ptr, _i64, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_int, _ptr]),
    "stem_scores_dp_built": (ctypes.c_int, []),
    "stem_select_vector": (ctypes.c_int, [ctypes.c_int]),
    "stem_fill32": (None, [_ptr, _i64, ctypes.c_uint32, ctypes.c_int, ctypes.c_int]),
    "stem_widen_bf16": (ctypes.c_uint32, [_ptr, _i64, _i64, _i64, _ptr, ctypes.c_int]),
}, cflags=("-ffp-contract=off",))  # the scores' two roundings: never one fused multiply-add

# The indexer cache's write (stem_indexer/pipeline/index_cache.py).
INDEX_CACHE = Library("index_cache", {
    "stem_index_write_layers": (ctypes.c_int, [
        _i64, _ptr, _ptr, _ptr, _ptr, ctypes.c_int, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64,
        _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr,
        _i64]),
    "stem_stage_rows": (ctypes.c_int, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                                       _i64, _i64, _i64]),
})


def pointer(tensor: torch.Tensor | None) -> int | None:
    """A tensor's data address for a C call (None: NULL)."""
    return None if tensor is None else tensor.data_ptr()


_lock = threading.Lock()
_loaded: dict[str, tuple[ctypes.CDLL | None, str]] = {}
_warned: set[str] = set()  # kernels whose fallback was reported in this process


def load(lib: Library) -> ctypes.CDLL | None:
    """The library, built and loaded on first use; None when it cannot be used."""
    if lib.source not in _loaded:
        with _lock:
            if lib.source not in _loaded:
                _loaded[lib.source] = _load(lib)
    return _loaded[lib.source][0]


def status(lib: Library | None = None) -> str:
    """Whether ``lib`` is in use, and why (builds it on first call):
    ``"native: ..."`` or ``"torch fallback: ..."``.

    Without ``lib``, the indexer's kernels, each with its state and reason:
    ``"selection: native: ...; scores: ..."``. The attention kernel's state
    is ``sparse_attention.status()``; every kernel and the path each device
    and dtype takes, ``stem_indexer.status()``.
    """
    if lib is None:
        passes = " (its linear passes on AVX-512)" if select_vector() else ""
        return f"selection: {status(SELECT_ROWS)}{passes}; scores: {bf16_scores_status()}"
    load(lib)
    cdll, why = _loaded[lib.source]
    return ("native: " if cdll is not None else "torch fallback: ") + why


def select_vector(mode: int | None = None) -> bool:
    """Whether the selection kernel runs its gather and emit passes, and
    packs the keys of the bfloat16 score products, on AVX-512 (where the CPU
    has it; the same picks and products either way). ``mode`` forces it
    first: -1 the default, 0 never, 1 where the CPU has it."""
    lib = load(SELECT_ROWS)
    return lib is not None and lib.stem_select_vector(-2 if mode is None else mode) == 1


def report_fallback(kernel: str, why: str, stacklevel: int = 3) -> None:
    """Warn that the native ``kernel`` (``"selection"``, ``"attention"``, ...)
    is not in use and a slower path runs instead, once per process for each."""
    report_once(kernel, f"the native {kernel} kernel is not in use ({why}); running a slower "
                "path with the same results", stacklevel + 1)


def report_once(key: str, message: str, stacklevel: int = 3) -> None:
    """Warn ``message`` (a fallback: what runs instead, and why) once per
    process for ``key``; ``stem_indexer.status()`` lists every path."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(f"stem_indexer: {message} (see stem_indexer.status())", RuntimeWarning,
                  stacklevel=stacklevel)


def kernel() -> ctypes.CDLL | None:
    """The CPU path's selection kernel (``csrc/select_rows.c``), or None."""
    return load(SELECT_ROWS)


def reset() -> None:
    """Forget what was loaded and which fallbacks were reported; the next
    ``load`` looks again (tests)."""
    with _lock:
        _loaded.clear()
        _warned.clear()
        _bf16_probed.clear()


# --------------------------------------------------------------------------- #
# Build, verify, load
# --------------------------------------------------------------------------- #


def _load(lib: Library) -> tuple[ctypes.CDLL | None, str]:
    if not _env.flag(_env.NATIVE, True):
        return None, f"disabled by {_env.NATIVE}={os.environ.get(_env.NATIVE)}"
    compiler = _env.compiler()
    if not compiler or shutil.which(compiler[0]) is None:
        return None, f"no C compiler ({' '.join(compiler) or 'CC is empty'})"
    directory = _env.cache_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        return None, f"cache directory {directory} not usable ({err})"
    why = untrusted(directory)
    if why:
        warnings.warn(f"stem_indexer: not loading native kernels from {directory}: {why}; "
                      f"using torch operations (set {_env.CACHE_DIR} to a private directory)",
                      RuntimeWarning, stacklevel=3)
        return None, f"cache directory refused: {why}"
    target = directory / f"{lib.source}-{_tag(lib, compiler)}.so"
    digest = target.with_suffix(".sha256")
    if _verified(target, digest):
        cdll, err = _open(lib, target)
        if cdll is not None:
            return cdll, f"{lib.path.name} loaded from {target}"
    return _build(lib, compiler, target, digest)


def _tag(lib: Library, compiler: list[str]) -> str:
    """Cache key: the source, compiler, flags and what the flags depend on."""
    host = platform.machine()
    if any("native" in flag for flag in lib.cflags):  # -march=native: this CPU's features
        host += torch_blas.cpu_flags()
    key = lib.path.read_bytes() + repr((compiler, CFLAGS, OPENMP, lib.cflags, host)).encode()
    return hashlib.sha256(key).hexdigest()[:16]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(target: Path, digest: Path) -> bool:
    """The library exists, is this user's alone and is the file we built."""
    if untrusted(target) or untrusted(digest):
        return False
    try:
        return digest.read_text().strip() == _sha256(target)
    except OSError:
        return False


def _open(lib: Library, path: Path) -> tuple[ctypes.CDLL | None, str]:
    try:
        cdll = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in lib.functions.items():
            fn = getattr(cdll, name)
            fn.restype, fn.argtypes = restype, argtypes
    except (OSError, AttributeError) as err:
        return None, f"loading {path} failed ({err})"
    return cdll, ""


def _build(lib: Library, compiler: list[str], target: Path,
           digest: Path) -> tuple[ctypes.CDLL | None, str]:
    try:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as err:
        return None, f"cache directory {target.parent} not writable ({err})"
    try:
        err = _compile(lib, compiler, tmp)
        if err:
            return None, err
        built = _sha256(Path(tmp))
        cdll, err = _open(lib, Path(tmp))  # loaded from our own file: no race
        if cdll is None:
            return None, err
        os.replace(tmp, target)
        # A reader between the two replaces sees a mismatch and builds again.
        write_atomic(digest, built + "\n")
        return cdll, f"{lib.path.name} built into {target}"
    except OSError as err:
        return None, f"installing {target} failed ({err})"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _compile(lib: Library, compiler: list[str], out: str) -> str | None:
    """Compile ``lib`` into ``out``; the error text, or None."""
    for extra in (OPENMP, ()):
        cmd = [*compiler, *CFLAGS, *lib.cflags, *extra, "-o", out, str(lib.path)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_SECONDS)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"compiling {lib.path.name} failed ({err})"
        if proc.returncode == 0:
            return None
    return f"compiling {lib.path.name} failed: {proc.stderr.strip()[-500:]}"


# --------------------------------------------------------------------------- #
# bfloat16 products of the scores
# --------------------------------------------------------------------------- #

SCORE_ROWS, SCORE_COLS = 32, 64  # as csrc/select_rows.c
_bf16_lock = threading.Lock()
_bf16_probed: dict[int, str | None] = {}  # Df -> why unusable, or None


def dp_scores() -> bool:
    """The scores' bfloat16 products run on this library's own vdpbf16ps
    kernel (``stem_scores_dp``) instead of torch's micro-kernel: a CPU with
    AVX512-BF16 and no AMX (where oneDNN's kernel uses AMX tiles), and a
    compiler that built it. Its keys are packed by 16 x 16 transposes in
    registers; torch's micro-kernel is fed by the same packing where the
    selection's passes run on AVX-512 (``select_vector``), element by
    element elsewhere. The same instruction in the same order per lane: the
    same floats as torch's kernel (tests/test_native.py)."""
    flags = set(torch_blas.cpu_flags().split())
    lib = load(SELECT_ROWS)
    return ("avx512_bf16" in flags and "amx_bf16" not in flags and lib is not None
            and lib.stem_scores_dp_built() == 1)


def bf16_scores_status() -> str:
    """How the CPU path multiplies bfloat16 scores, and why."""
    fns, why = torch_blas.bf16_brgemm()
    if fns is None or load(SELECT_ROWS) is None:
        return f"float32 GEMM ({why if fns is None else 'no selection kernel'})"
    pays, reason = torch_blas.bf16_products_pay()
    if not pays:
        return f"float32 GEMM ({reason})"
    if dp_scores():
        why = "this library's vdpbf16ps kernel (AVX512-BF16, no AMX)"
    failed = [f"float32 GEMM for Df={df} ({reason})"
              for df, reason in sorted(_bf16_probed.items()) if reason]
    return "; ".join([f"bfloat16 products on {why}", *failed])


def bf16_scores_available(df: int) -> bool:
    """Scores of Df-element bfloat16 vectors can be multiplied in bfloat16
    here (``scores_bf16``): a CPU with bfloat16 dot products, torch's brgemm,
    the selection kernel built, Df even, and the micro-kernel's calls for
    this Df made once in a child process (``torch_blas.probe``: an
    exception in them would abort the process). A failed probe is reported
    (status(), one warning) and the float32 GEMMs run instead."""
    fns = torch_blas.bf16_brgemm()[0]
    if fns is None or df % 2 or df < 2 or load(SELECT_ROWS) is None:
        return False
    with _bf16_lock:
        if df not in _bf16_probed:
            calls = [(m, SCORE_COLS, df, df, SCORE_COLS, SCORE_COLS, 0)
                     for m in range(1, SCORE_ROWS + 1)]
            sizes = (SCORE_ROWS * df, df * SCORE_COLS, SCORE_ROWS * SCORE_COLS)
            _bf16_probed[df] = torch_blas.probe(calls, sizes)
        why = _bf16_probed[df]
    if why is not None:
        report_fallback("bfloat16 scores", bf16_scores_status())
    return why is None


def scores_bf16(a: torch.Tensor, keys: torch.Tensor, out: torch.Tensor, scale: float = 1.0,
                bias: torch.Tensor | None = None, stream: bool = False,
                queries: bool = True) -> tuple[float, float]:
    """``out[h, i, g] = (a[h, g, i] @ keys[h]^T) * scale + bias[h]`` in
    float32, for bfloat16 ``a`` (H, G, m, k) (query head g of key head h; rows
    contiguous) and ``keys`` (H, n, k) (unit stride along k), into float32
    ``out`` (H, m, G, n) (unit stride along n, any other strides); ``bias``
    float32 (H, n) (unit stride along n) or None (no sum). Rounded after the
    product and after the sum, as ``(a @ keys^T).mul_(scale).add_(bias)``
    rounds in float32 (the contract's two roundings, never one fused
    multiply-add).

    Products of two bfloat16 values are exact in float32 and are summed in
    float32: integer-valued inputs give exactly a float32 GEMM's results (the
    bfloat16 dot product instructions treat subnormal inputs as zero: a
    difference below 2^-126 per product elsewhere). Only after
    ``bf16_scores_available(k)``.

    ``stream``: rows of 64 products that start on a 64-byte boundary of
    ``out`` are written with streaming stores (on AVX-512), which do not
    read the lines in first: for outputs too large to be still cached when
    they are read back. The same values either way.

    Returns the largest magnitudes among the elements of ``keys`` and of
    ``a`` (inf, or NaN if one is NaN), found while the kernel packs the keys
    and, for the queries, from cache just before their first product (none
    when ``n`` is 0, or without ``queries``: for rows whose magnitude the
    caller has from an earlier call): they bound every product without
    another pass over the inputs."""
    heads, group, m, k = a.shape
    n = keys.shape[1]
    assert a.dtype == keys.dtype == torch.bfloat16 and out.dtype == torch.float32
    assert a.stride(3) == 1 and (a.stride(2) == k or m <= 1)
    assert keys.stride(2) == 1 and keys.shape == (heads, n, k)
    assert out.shape == (heads, m, group, n) and (out.stride(3) == 1 or n <= 1)
    if bias is not None:
        assert bias.dtype == torch.float32 and bias.shape == (heads, n)
        assert bias.stride(1) == 1 or n <= 1
    assert _bf16_probed[k] is None
    args = (heads, group, m, n, k, a.data_ptr(), a.stride(0), a.stride(1), keys.data_ptr(),
            keys.stride(0), keys.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
            out.stride(2), float(scale), None if bias is None else bias.data_ptr(),
            0 if bias is None else bias.stride(0), torch.get_num_threads(), int(stream),
            int(queries), ctypes.byref(magnitudes := (ctypes.c_uint32 * 2)()))
    lib = load(SELECT_ROWS)
    if dp_scores():
        name, code = "stem_scores_dp", lib.stem_scores_dp(*args)
    else:
        fns = (ctypes.c_void_p * 2)(*torch_blas.bf16_brgemm()[0])
        name, code = "stem_scores_bf16", lib.stem_scores_bf16(fns, *args)
    if code == -2:
        raise MemoryError(f"{name}: no memory for its packed keys")
    assert code == 0, f"{name} refused its arguments"
    keys_max, a_max = (struct.unpack("<f", struct.pack("<I", bits << 16))[0]  # bf16 -> float
                       for bits in magnitudes)
    return keys_max, a_max


def widen_bf16(src: torch.Tensor, out: torch.Tensor) -> float | None:
    """``out.copy_(src)`` for bfloat16 ``src`` (S, n, k) whose every ``src[s]``
    is contiguous, into contiguous float32 ``out`` of its shape, in one pass
    that also returns the largest magnitude in ``src`` (inf, or NaN if one
    is NaN). None, and nothing written, where the kernel is not built or the
    strides differ: the caller copies and bounds the keys another way."""
    segs = src.shape[0]
    n = src[0].numel() if segs else 0
    lib = load(SELECT_ROWS)
    if (lib is None or src.dtype != torch.bfloat16 or out.dtype != torch.float32
            or out.shape != src.shape or not out.is_contiguous() or src.device.type != "cpu"
            or (segs and not src[0].is_contiguous())):
        return None
    bits = lib.stem_widen_bf16(src.data_ptr(), segs, n, src.stride(0) if segs else 0,
                               out.data_ptr(), torch.get_num_threads())
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]  # bf16 -> float


# --------------------------------------------------------------------------- #
# Threads of small work
# --------------------------------------------------------------------------- #


@functools.lru_cache(maxsize=None)
def _libgomp() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libgomp.so.1")  # torch's, already loaded: the same handle
        lib.omp_get_max_threads.restype = ctypes.c_int
        lib.omp_set_num_threads.argtypes = [ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return lib


@contextlib.contextmanager
def omp_threads(n: int):
    """torch's CPU operations run by this thread use at most ``n`` OpenMP
    threads inside the block (other threads are not affected).

    For host bookkeeping on tensors of a few thousand elements: split across
    threads, each such operation waits for a worker to be scheduled, which
    on a busy machine costs milliseconds instead of microseconds. OpenMP's
    thread count is a per-thread setting, so this is safe with concurrent
    callers; without libgomp (another OpenMP runtime) it changes nothing.
    """
    lib = _libgomp()
    if lib is None:
        yield
        return
    with thread_count(lib.omp_get_max_threads, lib.omp_set_num_threads, n):
        yield


# --------------------------------------------------------------------------- #
# Large outputs: on huge pages, and their memory handed out again once released
# --------------------------------------------------------------------------- #

# Outputs at least this large get their own mapping, asked to be backed by
# huge pages, and kept for reuse once released.
HUGE_PAGE_MIN_BYTES = 8 << 20
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Mappings of the last large outputs kept, busy or released (the oldest go
# first); a released one is handed out again to an output of its size.
OUTPUTS_KEPT = 2


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's madvise where transparent huge pages are given on request
    (mode ``madvise``; with ``always`` they come unasked), else None."""
    try:
        if "[madvise]" not in THP_MODE.read_text():
            return None
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


class _Mapping:
    """Anonymous memory for one large output, and a weak reference to the
    buffer over it that the output's storage holds: dead exactly when every
    tensor, view, storage and array sharing that memory is gone."""

    def __init__(self, nbytes: int):
        # private (a shared one would be shared with forked children, and is not
        # given huge pages), page-aligned, untouched until written
        self.memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
        self.lease: weakref.ref | None = None
        fn = _madvise()
        if fn is not None:
            base = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
            start = -(-base // HUGE_PAGE) * HUGE_PAGE
            end = (base + nbytes) // HUGE_PAGE * HUGE_PAGE
            if end > start:
                fn(start, end - start, _MADV_HUGEPAGE)  # a refusal leaves small pages

    @property
    def released(self) -> bool:
        return self.lease is None or self.lease() is None

    def lend(self) -> ctypes.Array:
        lease = (ctypes.c_char * len(self.memory)).from_buffer(self.memory)
        self.lease = weakref.ref(lease)
        return lease


_mappings: list[_Mapping] = []  # most recently lent last
_mappings_lock = threading.Lock()


def filled(shape: tuple[int, ...], value: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.full(shape, value, dtype=dtype)`` on the CPU. From
    ``HUGE_PAGE_MIN_BYTES`` on, its memory is a mapping of its own: the memory
    of an earlier output of the same size once nothing refers to it any more
    (one of the last ``OUTPUTS_KEPT``), else fresh, first asked to be backed by
    huge pages (``madvise``, where the kernel gives them on request).

    A fresh output of hundreds of MiB is paid mostly in page faults on first
    touch, one per 4 KiB page: with 2 MiB pages there are 512 times fewer
    (the indexer's 512 MiB output at S5 of ``benchmarks/operator/indexer_bench.py``,
    on a 2-core AMD EPYC VM: 18 to 26 ms instead of 115 to 306 ms), and
    memory touched before costs none (a model calls the indexer once per
    layer with the same shapes, and drops each layer's output before the
    next call). Four-byte values are written with streaming stores where
    the selection kernel is built (``stem_fill32``): ordinary stores read
    each line in before writing it. The values are the same either way.
    ``release_outputs`` unmaps the released mappings kept."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MAP_PRIVATE"):  # Windows: no reuse
        return torch.full(shape, value, dtype=dtype)
    with _mappings_lock:
        mapping = next((m for m in reversed(_mappings)
                        if len(m.memory) == nbytes and m.released), None)
        if mapping is not None:
            _mappings.remove(mapping)
        else:
            mapping = _Mapping(nbytes)
        lease = mapping.lend()
        _mappings.append(mapping)
        del _mappings[:-OUTPUTS_KEPT]  # a busy one dropped stays mapped while lent
    out = torch.frombuffer(lease, dtype=dtype).view(shape)
    lib = kernel()
    if lib is None or dtype.itemsize != 4:
        return out.fill_(value)
    word = torch.tensor([value], dtype=dtype).view(torch.int32).item() & 0xFFFFFFFF
    lib.stem_fill32(out.data_ptr(), out.numel(), word, torch.get_num_threads(), -1)
    return out


def kept_output_bytes() -> int:
    """Memory of released large outputs kept for the next ones."""
    with _mappings_lock:
        return sum(len(m.memory) for m in _mappings if m.released)


def release_outputs() -> None:
    """Unmap the released large outputs kept (those still in use stay, for
    as long as they are)."""
    with _mappings_lock:
        _mappings.clear()


# --------------------------------------------------------------------------- #
# The selection kernel's face
# --------------------------------------------------------------------------- #


def select_rows(nk: int, c: int, group: int, s2: torch.Tensor, sink_end: torch.Tensor,
                cand_end: torch.Tensor, take: torch.Tensor, scores: torch.Tensor | None,
                ranked: int, lo: int, precision: int, out: torch.Tensor) -> None:
    """Write the output rows of one tile: ``out`` (Nq, c, Kmax) int32 view,
    prefilled with -1.

    s2, sink_end, cand_end, take: (c,) int64 per query block. ``scores``:
    (Nk, c - ranked, G, width) float32 of query blocks [ranked, c), column 0
    = key block ``lo`` (None when no row ranks). torch's threads share the rows.
    """
    lib = kernel()
    assert lib is not None and out.dtype == torch.int32 and out.stride(-1) == 1
    per_block = [t.contiguous().to(torch.int64) for t in (s2, sink_end, cand_end, take)]
    width = 0
    scores_ptr = None
    if scores is not None:
        assert scores.dtype == torch.float32 and scores.is_contiguous()
        assert scores.shape[:3] == (nk, c - ranked, group)
        width, scores_ptr = scores.shape[3], scores.data_ptr()
    work = nk * c * group * max(width, out.shape[-1])  # keys read + entries written
    threads = torch.get_num_threads() if work >= PARALLEL_MIN_WORK else 1
    code = lib.stem_select_rows(nk, c, group, *(t.data_ptr() for t in per_block), scores_ptr,
                                ranked, lo, width, precision, out.data_ptr(), out.stride(0),
                                out.stride(1), out.shape[-1], threads)
    if code != 0:
        raise MemoryError("stem_select_rows: no memory for its scratch keys")
