"""The CPU path's native selection kernel (``csrc/select_rows.c``).

The kernel writes finished output rows from a tile's float32 scores: exact
top-k by a radix select over each row's keys, then sink ++ picks ++ window
in one pass per row. It is plain C with no dependency (not even on
torch's headers), built with the system C compiler at first use into a cache
directory, and called through ``ctypes``. Its rows are shared by OpenMP
threads: built with ``-fopenmp``, it binds to the ``libgomp.so.1`` torch has
loaded, so it uses torch's own thread pool (threads of a second pool would
compete with torch's spinning workers for the cores). Compilers without
OpenMP build it serial.

Without a compiler (or with ``STEM_INDEXER_NATIVE=0``) ``kernel()`` returns
None and ``ops/cpu.py`` selects with torch operations instead: the same
results, a little slower. ``status()`` says which and why.

Environment:

* ``STEM_INDEXER_NATIVE=0``: do not build or use the kernel.
* ``STEM_INDEXER_CACHE_DIR``: where the built library goes (default
  ``$XDG_CACHE_HOME/stem_indexer`` or ``~/.cache/stem_indexer``).
* ``CC``: the C compiler (default ``cc``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "select_rows.c"
CFLAGS = ("-O3", "-std=c11", "-shared", "-fPIC")
OPENMP = ("-fopenmp",)
COMPILE_SECONDS = 120

_lock = threading.Lock()
_state: dict = {}  # "lib" (ctypes.CDLL or None), "why" (str)


def _cache_dir() -> Path:
    explicit = os.environ.get("STEM_INDEXER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "stem_indexer"


def _build() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("STEM_INDEXER_NATIVE", "1") == "0":
        return None, "disabled by STEM_INDEXER_NATIVE=0"
    compiler = shlex.split(os.environ.get("CC", "cc"))
    if not compiler or shutil.which(compiler[0]) is None:
        return None, f"no C compiler ({' '.join(compiler) or 'CC is empty'})"
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + repr((compiler, CFLAGS, OPENMP, platform.machine())).encode())
    target = _cache_dir() / f"select_rows-{tag.hexdigest()[:16]}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
        except OSError as err:
            return None, f"cache directory {target.parent} not writable ({err})"
        try:
            for extra in (OPENMP, ()):
                proc = subprocess.run([*compiler, *CFLAGS, *extra, "-o", tmp, str(SOURCE)],
                                      capture_output=True, text=True, timeout=COMPILE_SECONDS)
                if proc.returncode == 0:
                    break
            else:
                return None, f"compiling {SOURCE.name} failed: {proc.stderr.strip()[-500:]}"
            os.replace(tmp, target)  # atomic: concurrent builders agree
        except (OSError, subprocess.TimeoutExpired) as err:
            return None, f"compiling {SOURCE.name} failed ({err})"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        return None, f"loading {target} failed ({err})"
    fn = lib.stem_select_rows
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int,
                   ptr, i64, i64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib, f"{SOURCE.name} built into {target}"


def kernel() -> ctypes.CDLL | None:
    """The loaded library, or None when it cannot be used (see ``status``)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"], _state["why"] = _build()
    return _state["lib"]


def status() -> str:
    """Whether the CPU path selects natively, and why (builds on first call)."""
    kernel()
    return ("native: " if _state["lib"] is not None else "torch fallback: ") + _state["why"]


def reset() -> None:
    """Forget the loaded state; the next ``kernel()`` looks again (tests)."""
    with _lock:
        _state.clear()


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
    code = lib.stem_select_rows(nk, c, group, *(t.data_ptr() for t in per_block), scores_ptr,
                                ranked, lo, width, precision, out.data_ptr(), out.stride(0),
                                out.stride(1), torch.get_num_threads())
    if code != 0:
        raise MemoryError("stem_select_rows: no memory for its scratch keys")
