"""What the GPU check's scripts share (``gpu_check.py``, ``gpu_attention.py``):
results that survive a run cut short, timings where one failure loses one
cell, the commit measured and the device's peaks.

* ``Report(path)``: a results file written line by line; each line is
  printed and appended (flushed) as it is produced, so a step stopped at its
  time limit keeps every line it reached.
* ``guarded_runs({...})``: functions timed in turns like
  ``common.interleaved_runs``, each call in its own try: a function that
  raises is dropped with its error, the others are timed on. ``attempt(fn)``:
  one guarded call.
* ``run_sha()``: the commit measured. ``benchmarks/gpu/gpu_check.sh`` passes the
  host's in ``STEM_GIT_SHA`` (the device machine may get a copy of the tree
  without ``.git``, or with a stale one); without it, ``common.git_sha()``.
* ``peaks_for(device_name)``: the roofline's FLOP/s and bytes/s for a GPU
  this check knows (H100 SXM, H200), chosen by ``torch.cuda.get_device_name()``;
  None for any other device: its roofline is not guessed.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # noqa: F401  (every area's folder on sys.path)
from common import git_sha, once_ms


def run_sha() -> str:
    """``STEM_GIT_SHA`` if set (the host's commit), else this tree's."""
    return os.environ.get("STEM_GIT_SHA", "").strip() or git_sha()


@dataclasses.dataclass(frozen=True)
class Peaks:
    """What the roofline divides by: dense bfloat16 tensor-core FLOP/s and
    HBM bytes/s that the best kernels reach (the datasheet's figures derated
    alike: 0.8 of the FLOP/s, 0.9 of the bandwidth)."""

    gpu: str
    flops: float
    bytes: float

    def __str__(self) -> str:
        return f"{self.gpu}: {self.flops / 1e12:.0f} TFLOP/s, {self.bytes / 1e12:.1f} TB/s"


# Datasheets: H100 SXM 989 TFLOP/s dense bf16, 3.35 TB/s HBM3; H200 SXM the
# same FLOP/s, 4.8 TB/s HBM3e. The NVL and PCIe parts run lower clocks and
# power: unknown here.
H100_SXM = Peaks("H100 SXM", 790e12, 3.0e12)
H200 = Peaks("H200", 790e12, 4.3e12)


def peaks_for(device_name: str) -> Peaks | None:
    """The peaks of the GPU ``torch.cuda.get_device_name()`` names, or None
    where this check does not know them (then no roofline ratio)."""
    name = device_name.upper()
    if "NVL" in name or "PCIE" in name:
        return None
    if "H200" in name:
        return H200
    if "H100" in name and ("HBM3" in name or "SXM" in name):
        return H100_SXM
    return None


def device_peaks(device: str) -> tuple[str, Peaks | None]:
    """(the device's name, its peaks or None); CPU runs have none."""
    if device != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name()
    return name, peaks_for(name)


class Report:
    """A results file written as it is produced: ``add`` prints each line and
    appends it to the file at once (the file is started empty)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")

    def add(self, *lines: str) -> None:
        with self.path.open("a") as f:
            for line in lines:
                print(line, flush=True)
                f.write(line + "\n")
            f.flush()


def error_text(exc: BaseException, limit: int = 160) -> str:
    """``Type: message`` on one line, at most ``limit`` characters."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _recover(device: str) -> None:
    """After a failed call: give back what an out-of-memory left cached."""
    if device == "cuda":
        try:
            torch.cuda.empty_cache()
        except Exception:  # a broken context reports itself at the next call
            pass


def attempt(fn: Callable[[], object], device: str = "cpu"):
    """``(fn(), None)``, or ``(None, error text)`` where it raises."""
    try:
        return fn(), None
    except Exception as exc:  # reported in its own cell; the caller goes on
        _recover(device)
        return None, error_text(exc)


def guarded_runs(fns: dict[str, Callable[[], object]], *, device: str, reps: int = 5,
                 warmup: int = 1) -> tuple[dict[str, list[float]], dict[str, str]]:
    """``(times, errors)``: every ms of each function that never raised, the
    functions called in turns (entry i of each list is from turn i, for the
    spread of a ratio); ``errors`` names each function that raised, with its
    error (its times are dropped, the others are timed on)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    errors: dict[str, str] = {}

    def call(name: str, timed: bool) -> None:
        try:
            t = once_ms(fns[name], device) if timed else fns[name]()
        except Exception as exc:  # this function's cells say so; the others go on
            errors[name] = error_text(exc)
            del times[name]
            _recover(device)
            return
        if timed:
            times[name].append(t)

    for name in fns:
        for _ in range(warmup):
            if name in times:
                call(name, timed=False)
    if device == "cuda":
        torch.cuda.synchronize()
    for _ in range(reps):
        for name in fns:
            if name in times:
                call(name, timed=True)
    return times, errors


def median_cell(times: dict[str, list[float]], name: str, fmt: str = ".2f") -> str:
    """The median ms of ``name``, or ``error`` where it raised."""
    return format(statistics.median(times[name]), fmt) if name in times else "error"


def spread_cell(times: dict[str, list[float]], base: str, name: str) -> str:
    """``base / name`` per turn: median [min, max]; ``-`` where either raised."""
    if base not in times or name not in times:
        return "-"
    turns = [b / x for b, x in zip(times[base], times[name])]
    return f"{statistics.median(turns):.2f}x [{min(turns):.2f}, {max(turns):.2f}]"


def errors_line(errors: dict[str, str], where: str) -> str | None:
    """One line naming each function that raised (for the log; None: none)."""
    if not errors:
        return None
    return f"{where}: " + "; ".join(f"{name} raised {text}" for name, text in errors.items())
