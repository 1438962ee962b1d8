"""What every benchmark script records and how it times (imported by the scripts
beside it; run them from the repository root, e.g. ``python benchmarks/x.py``).

* ``machine()``: CPU model (or GPU name), core count, torch version and its
  CPU capability; ``git_sha()``: the commit measured, ``+dirty`` when the
  tracked files differ from it;
* ``median_ms(fn, ...)``: the median of repeated calls after warm-up, with
  CUDA events on a GPU and ``time.perf_counter`` on CPU;
* ``interleaved_ms({...})``: several functions timed in turns, so that
  machine noise hits all of them alike (ratios from one run);
  ``interleaved_runs`` keeps every turn's times, for the spread of a ratio;
* ``write_atomic(path, text)``: results files appear whole or not at all;
* for the attention benchmarks (``attention_bench.py``, ``window_bench.py``):
  ``attention_options`` adds their shared options and ``attention_args``
  reads and checks them; ``table_header`` starts a results table (the
  machine, commit and load, then the setting and the columns) and
  ``record_table`` prints the load at the end and appends the table, with
  its command, to ``--record``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from stem_indexer.operator import _files

ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The instruction-set flags that decide which kernels run (lscpu's names).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_flags() -> str:
    """lscpu's model name and which of ``FLAGS`` the CPU has."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "lscpu unavailable"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    model = " ".join(fields.get("Model name", "?").split())
    have = set(fields.get("Flags", "").split())
    family = fields.get("CPU family", "?").strip()
    number = fields.get("Model", "?").strip()
    flags = " ".join(f if f in have else f"no {f}" for f in FLAGS)
    return f"{model} (family {family}, model {number}): {flags}"


def machine(device: str = "cpu") -> str:
    """One line naming the hardware and torch build the figures come from."""
    if device == "cuda":
        return (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}")
    return (f"{cpu_model()}, {os.cpu_count()} cpus, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})")


def git_sha() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT,
                              check=True, timeout=10).stdout.strip()
    try:
        sha = git("rev-parse", "--short=12", "HEAD")
        return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def once_ms(fn: Callable[[], object], device: str) -> float:
    """One call's milliseconds: CUDA events on a GPU, perf_counter on CPU."""
    if device == "cuda":
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def median_ms(fn: Callable[[], object], *, reps: int = 5, warmup: int = 1,
              device: str = "cpu") -> float:
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(once_ms(fn, device) for _ in range(reps))


def interleaved_runs(fns: dict[str, Callable[[], object]], *, reps: int = 5, warmup: int = 1,
                     device: str = "cpu") -> dict[str, list[float]]:
    """Every ms of each function, the functions called in turns (entry i of
    each list is from the same turn, so per-turn ratios give the spread)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(once_ms(fn, device))
    return times


def interleaved_ms(fns: dict[str, Callable[[], object]], *, reps: int = 5, warmup: int = 1,
                   device: str = "cpu") -> dict[str, float]:
    """Median ms of each function, the functions called in turns."""
    runs = interleaved_runs(fns, reps=reps, warmup=warmup, device=device)
    return {name: statistics.median(t) for name, t in runs.items()}


def write_atomic(path: str | os.PathLike, text: str, *, append: bool = False) -> None:
    """Write (or append to) ``path`` so that readers never see half a file.
    Appended text (the benchmarks' markdown records) starts after a blank
    line, so that its heading is one however the file ended."""
    path = Path(path)
    if append and path.exists():
        before = path.read_text()
        if before:  # newlines at the join: at least two, one blank line
            joined = (len(before) - len(before.rstrip("\n"))) + (len(text) - len(text.lstrip("\n")))
            before += "\n" * max(0, 2 - joined)
        text = before + text
    path.parent.mkdir(parents=True, exist_ok=True)
    _files.write_atomic(path, text)


def attention_options(parser: argparse.ArgumentParser, *, seqs: str, dtypes: str, heads: int,
                      kv_heads: int, dim: int, reps: int) -> None:
    """The attention benchmarks' options, with these defaults: the lengths,
    the dtypes, the query and KV heads, the head size, the turns and the
    file the table is appended to."""
    parser.add_argument("--seqs", default=seqs, help="comma-separated token counts")
    parser.add_argument("--dtypes", default=dtypes)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--kv-heads", type=int, default=kv_heads)
    parser.add_argument("--dim", type=int, default=dim)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--record", type=Path, help="append the table to this markdown file")


def attention_args(parser: argparse.ArgumentParser, argv: list[str] | None,
                   dtypes) -> tuple[argparse.Namespace, list[int], list[str]]:
    """The parsed options, the lengths and the dtypes' names (each one of
    ``dtypes``); a usage error for a dtype or a ``--record`` folder that is
    not there."""
    args = parser.parse_args(argv)
    names = [d.strip() for d in args.dtypes.split(",")]
    if any(n not in dtypes for n in names):
        parser.error(f"--dtypes: choose from {', '.join(dtypes)}")
    if args.record is not None and not args.record.parent.is_dir():
        parser.error(f"--record: directory {args.record.parent} does not exist")
    return args, [int(s) for s in args.seqs.split(",")], names


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def table_header(setting: str, columns) -> list[str]:
    """A results table's first lines: the machine, its instruction sets, the
    commit and the load average now, then ``setting``; the columns' header."""
    return [f"Machine: {machine()}; {cpu_flags()}; git {git_sha()}; load average at the "
            f"start {_load()} (1/5/15 min); {setting}", "",
            "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def record_table(path: Path | None, script: str, argv: list[str] | None, header: list[str],
                 lines: list[str]) -> None:
    """Print the load average at the end; append the table to ``path`` (if
    given) after the command that made it."""
    load = _load()
    print(f"\nload average at the end {load}")
    if path is not None:
        command = f"python benchmarks/{script} " + " ".join(sys.argv[1:] if argv is None
                                                            else argv)
        write_atomic(path, "\n".join(["", f"Command: `{command}`", "", *header, *lines, "",
                                      f"Load average at the end: {load}.", ""]), append=True)
