"""CPU benchmark of the indexer: the op against its own score GEMM and a plain baseline.

For each shape the benchmark checks the op's output first (against the
scalar reference where that is fast enough, else against the plain baseline,
which is itself checked against the reference on the small shapes), then
reports in one run:

* ``op``: the op's median time (metadata prebuilt, as a model would reuse it);
* ``gemm``: the op with its selection stubbed out: the score GEMMs over the
  key blocks each row can pick, in the op's own blocking (bf16 products on
  oneDNN's micro-kernel where the CPU has bf16 dot products, else bf16
  operands upcast into reused float32 buffers and batched SGEMMs;
  ``* 1/R^2 + vbias``), plus the output's allocation; so op/gemm is what
  selecting costs on top;
* ``output``: the op's two outputs allocated alone, as the op allocates
  them (indices filled with -1: hundreds of MiB at S4 and S5), in the same
  turns: on a virtual machine whose fresh memory is slow and erratic to
  touch, this is the part of ``op`` that is not computation;
* ``bf16 GEMM`` and ``f32 GEMM``: plain ``torch.matmul`` of every causally
  visible (query block, key block) pair, in bfloat16 and in float32
  (operands converted before the clock), nothing else: the floor. ``op /
  faster GEMM`` is the op against the faster of the two, per interleaved
  turn (median and [min, max] over the turns);
* ``plain``: the version a user would write: one full float32 score matmul
  per (batch, KV head), mask, stable descending sort per row, take the budget;
* the ratios op/gemm and plain/op, and the op's peak extra memory (resident
  set growth during one call, outputs included) against inputs + outputs;
* which selection the op ran: ``native`` (the C kernel of ``ops/native.py``)
  or ``torch`` (its fallback; ``STEM_INDEXER_NATIVE=0`` forces it).

Each shape runs in a fresh subprocess so that its memory peak is its own.

    python benchmarks/operator/indexer_bench.py                 # S1, under a minute
    python benchmarks/operator/indexer_bench.py --shapes S1,S2,S3,S4,S5 --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

import stem_indexer  # noqa: F401  (registers the ops)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # noqa: F401  (every area's folder on sys.path)
from common import cpu_flags, git_sha, interleaved_ms, interleaved_runs, machine, write_atomic
from stem_indexer.operator import contract
from stem_indexer.operator.contract import IndexerParams, ceil_div
from stem_indexer.operator.ops import native
from stem_indexer.testing.cases import Case
from stem_indexer.testing.compare import compare

DEFAULT_RESULTS = Path("benchmarks") / "RESULTS.md"
# Environment settings that change what is measured; the recorded command
# line names those that are set.
RECORDED_ENV = ("STEM_INDEXER_NATIVE", "THP_MEM_ALLOC_ENABLE", "OMP_NUM_THREADS")


@dataclass(frozen=True)
class Shape(Case):
    """One benchmark shape ``S<number>``: a case of the test table's kind (its
    lengths, heads and the default attributes: Bs 128, stride 16, causal)
    with Df 2048 unless given, the check of its output and its turns."""

    dim: int = 2048
    check: str = "reference"  # or "plain"
    repeat: int = 5

    @property
    def name(self) -> str:
        return f"S{self.number}"

    def make_inputs(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Random inputs from ``seed``, drawn slice by slice (no float32 copy
        of a whole 1M-key input), without prompt lengths."""
        gen = torch.Generator().manual_seed(self.seed)
        shape = (self.batch, self.shape_q_blocks, self.shape_kv_blocks)
        qflat = torch.empty((shape[0], self.q_heads, shape[1], self.dim), dtype=torch.bfloat16)
        kflat = torch.empty((shape[0], self.kv_heads, shape[2], self.dim), dtype=torch.bfloat16)
        for t in (qflat, kflat):
            for part in t.view(-1, self.dim).split(1 << 14):
                part.copy_(torch.randn(part.shape, generator=gen))
        vbias = torch.rand((shape[0], self.kv_heads, shape[2]), generator=gen) * 0.3
        i32 = dict(dtype=torch.int32)
        inputs = {"qflat": qflat, "kflat": kflat, "vbias": vbias,
                  "q_seq_lens": torch.tensor(self.q_lens, **i32),
                  "kv_seq_lens": torch.tensor(self.kv_lens, **i32)}
        return {k: v.to(device) for k, v in inputs.items()}


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape(1, "article example: B4 Nq64 Nk8, 16 q blocks, 64 kv blocks",
          (2048,) * 4, (8192,) * 4, 64, 8),
    Shape(2, "B1 Nq32 Nk8, q 3968, kv 32K", (3968,), (32768,), 32, 8),
    Shape(3, "B1 Nq32 Nk8, q 8K, kv 1M", (8192,), (1 << 20,), 32, 8,
          check="plain", repeat=5),
    Shape(4, "B1 Nq32 Nk8, q = kv = 128K, causal prefill", (1 << 17,), (1 << 17,), 32, 8,
          check="plain", repeat=5),
    Shape(5, "B8 Nq64 Nk8, mixed prefill/decode, lengths up to 64K",
          (65536, 1, 16384, 1, 40000, 128, 1, 30000),
          (65536, 65536, 50000, 12345, 40000, 64000, 777, 61000), 64, 8,
          check="plain", repeat=5),
    Shape(6, "many short sequences: B1024 Nq32 Nk8, one 128-token block each",
          (128,) * 1024, (128,) * 1024, 32, 8, check="plain", repeat=5),
    Shape(7, "many short sequences: B65536 Nq4 Nk1 Df128, one 128-token block each",
          (128,) * 65536, (128,) * 65536, 4, 1, dim=128, check="plain", repeat=3),
)}


# --------------------------------------------------------------------------- #
# What is measured
# --------------------------------------------------------------------------- #


def _metadata(inputs: dict, params: IndexerParams) -> torch.Tensor:
    return torch.ops.custom.npu_stem_indexer_metadata(
        inputs["q_seq_lens"], inputs["kv_seq_lens"], inputs["qflat"].shape[1],
        inputs["kflat"].shape[1], causal=params.causal,
        stem_block_size=params.stem_block_size, dim_qkflat=inputs["qflat"].shape[-1],
        window_size=params.window_size)


def run_op(inputs: dict, metadata: torch.Tensor, params: IndexerParams):
    return torch.ops.custom.npu_stem_indexer(
        inputs["qflat"], inputs["kflat"], inputs["vbias"], inputs["q_seq_lens"],
        inputs["kv_seq_lens"], metadata=metadata, **dataclasses.asdict(params))


def visible_pairs(inputs: dict, params: IndexerParams) -> int:
    """Causally visible (query block, key block) pairs, summed over batches."""
    bs = params.stem_block_size
    pairs = 0
    for ql, kl in zip(inputs["q_seq_lens"].tolist(), inputs["kv_seq_lens"].tolist()):
        qb, kb = ceil_div(ql, bs), ceil_div(kl, bs)
        if qb and kb:
            pairs += int(contract.visible_blocks(torch.arange(qb), qb, kb, params.causal).sum())
    return pairs


def scores_only(inputs: dict, metadata: torch.Tensor, params: IndexerParams):
    """A closure running the op with the native selection replaced by nothing:
    what is left is the op's score stage (and its output's allocation)."""
    def run():
        with mock.patch.object(native, "select_rows", lambda *args: None):
            return run_op(inputs, metadata, params)
    return run


def output_only(inputs: dict):
    """A closure allocating the op's two outputs alone, as the op does
    (indices filled with -1, lengths with 0): on a machine where fresh memory
    is slow to touch, the part of ``op`` that is not computation."""
    batch, nq, qmax = inputs["qflat"].shape[:3]
    kmax = inputs["kflat"].shape[2]

    def run():
        return (native.filled((batch, nq, qmax, kmax), -1, torch.int32),
                torch.zeros((batch, nq, qmax), dtype=torch.int32))
    return run


def visible_gemm(inputs: dict, params: IndexerParams, dtype: torch.dtype, tile: int = 32):
    """A closure computing the scores of every causally visible (query block,
    key block) pair with plain ``torch.matmul`` in ``dtype`` (bfloat16:
    oneDNN's bf16 GEMM, bf16 out; float32: SGEMM on operands converted before
    the clock starts), ``tile`` query blocks per matmul against the keys the
    tile's last row sees, into preallocated outputs. No scale, bias or
    selection: the GEMM floor the op is held to."""
    qflat, kflat = inputs["qflat"].to(dtype), inputs["kflat"].to(dtype)
    batch, nq, _, df = qflat.shape
    nk = kflat.shape[1]
    group = nq // nk
    bs = params.stem_block_size
    jobs = []
    for b in range(batch):
        qb = ceil_div(int(inputs["q_seq_lens"][b]), bs)
        kb = ceil_div(int(inputs["kv_seq_lens"][b]), bs)
        if qb == 0 or kb == 0:
            continue
        s2 = contract.visible_blocks(torch.arange(qb), qb, kb, params.causal)
        for r0 in range(0, qb, tile):
            r1 = min(r0 + tile, qb)
            upper = int(s2[r0:r1].max())
            if upper:
                jobs.append((b, r0, r1, upper))
    largest = max((group * (r1 - r0) * upper for _, r0, r1, upper in jobs), default=1)
    scratch = torch.empty(nk, largest, dtype=dtype)

    def run():
        for b, r0, r1, upper in jobs:
            for n in range(nk):
                q = qflat[b, n * group:(n + 1) * group, r0:r1].reshape(-1, df)
                out = scratch[n, :q.shape[0] * upper].view(q.shape[0], upper)
                torch.matmul(q, kflat[b, n, :upper].T, out=out)
        return scratch
    return run


def plain_indexer(inputs: dict, params: IndexerParams):
    """What a user would write: full float32 scores per (batch, KV head),
    mask, stable descending sort, take each row's budget, add the forced
    blocks, sort ascending. Correct (ties to the lower block by the stable
    sort) but it scores every pair and sorts every row."""
    qflat, kflat, vbias = inputs["qflat"], inputs["kflat"], inputs["vbias"]
    batch, nq, qmax, _ = qflat.shape
    nk, kmax = kflat.shape[1], kflat.shape[2]
    group = nq // nk
    bs = params.stem_block_size
    indices = torch.full((batch, nq, qmax, kmax), -1, dtype=torch.int32)
    seq_len = torch.zeros((batch, nq, qmax), dtype=torch.int32)
    scale = contract.score_scale(params)
    for b in range(batch):
        qb = ceil_div(int(inputs["q_seq_lens"][b]), bs)
        kb = ceil_div(int(inputs["kv_seq_lens"][b]), bs)
        if qb == 0 or kb == 0:
            continue
        rows = torch.arange(qb)
        s2 = contract.visible_blocks(rows, qb, kb, params.causal)
        p = torch.tensor(kb)
        budget = contract.row_budget(rows + kb - qb, p, contract.prompt_budget(p, params),
                                     params.alpha)
        sink_end, cand_end = contract.candidate_range(s2, params.initial_blocks,
                                                      params.window_size)
        take = torch.minimum(budget, cand_end - sink_end)
        cols = torch.arange(kb)
        candidate = (cols >= sink_end[:, None]) & (cols < cand_end[:, None])
        forced = (cols < s2[:, None]) & ~candidate
        for n in range(nk):
            q = qflat[b, n * group:(n + 1) * group, :qb].float()
            scores = q @ kflat[b, n, :kb].float().T * scale + vbias[b, n, :kb]
            if params.topk_score_precision == 2:
                scores = scores.bfloat16().float()
            scores = scores.masked_fill(~candidate, -math.inf)
            order = scores.sort(dim=-1, descending=True, stable=True).indices
            chosen = torch.zeros_like(scores, dtype=torch.bool)
            chosen.scatter_(-1, order, (cols < take[:, None]).expand_as(order))
            keep = chosen | forced
            ranked = torch.where(keep, cols, kb).sort(dim=-1).values.to(torch.int32)
            count = keep.sum(-1).to(torch.int32)
            width = int(count.max())
            sel = ranked[..., :width]
            indices[b, n * group:(n + 1) * group, :qb, :width] = torch.where(sel < kb, sel, -1)
            seq_len[b, n * group:(n + 1) * group, :qb] = count
    return indices, seq_len


# --------------------------------------------------------------------------- #
# One shape, in its own process
# --------------------------------------------------------------------------- #


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_extra_mib(fn) -> float | None:
    """Resident-set growth during ``fn()`` (Linux: reset and read VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _rss_kib("VmRSS")
    except OSError:
        return None
    result = fn()
    peak = _rss_kib("VmHWM")
    del result
    return (peak - before) / 1024


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _check(shape: Shape, inputs: dict, params: IndexerParams, out) -> tuple[bool, float]:
    """Compare the op's output with the reference or the plain baseline
    (docs/CONTRACT.md section 5); returns (identical, seconds)."""
    start = time.perf_counter()
    if shape.check == "reference":
        from stem_indexer.operator.reference import stem_indexer_reference
        expected = stem_indexer_reference(**inputs, **dataclasses.asdict(params))
    else:
        expected = plain_indexer(inputs, params)
    verdict = compare(out, expected, inputs, params)
    if not verdict.ok:
        raise AssertionError(f"{shape.name}: op differs from {shape.check}: {verdict.summary()}")
    exact = torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
    return exact, time.perf_counter() - start


def measure_shape(shape: Shape, repeat: int | None = None) -> dict:
    """Correctness, then times and memory, for one shape (this process)."""
    params = shape.params
    inputs = shape.make_inputs()
    metadata = _metadata(inputs, params)
    peak = _peak_extra_mib(lambda: run_op(inputs, metadata, params))
    out = run_op(inputs, metadata, params)
    in_bytes = _nbytes(*inputs.values(), metadata)
    out_bytes = _nbytes(*out)
    exact, check_seconds = _check(shape, inputs, params, out)
    del out

    runs = interleaved_runs({"op": lambda: run_op(inputs, metadata, params),
                             "output": output_only(inputs),
                             "gemm": scores_only(inputs, metadata, params),
                             "bf16": visible_gemm(inputs, params, torch.bfloat16),
                             "f32": visible_gemm(inputs, params, torch.float32)},
                            reps=repeat or shape.repeat)
    ms = {name: statistics.median(t) for name, t in runs.items()}
    # op / the faster GEMM of the visible pairs, per turn: the median and spread
    floor = [t / min(a, b) for t, a, b in zip(runs["op"], runs["bf16"], runs["f32"])]
    ms["plain"] = interleaved_ms({"plain": lambda: plain_indexer(inputs, params)},
                                 reps=max(1, shape.repeat // 2), warmup=0)["plain"]
    flops = 2.0 * visible_pairs(inputs, params) * shape.q_heads * shape.dim
    return {
        "shape": shape.name, "about": shape.covers, "check": shape.check,
        "check_exact": exact, "check_seconds": round(check_seconds, 1),
        "op_ms": ms["op"], "output_ms": ms["output"], "gemm_ms": ms["gemm"],
        "plain_ms": ms["plain"], "turns": len(runs["op"]),
        "op_over_gemm": ms["op"] / ms["gemm"], "plain_over_op": ms["plain"] / ms["op"],
        "bf16_ms": ms["bf16"], "f32_ms": ms["f32"],
        "op_over_floor": statistics.median(floor), "floor_spread": [min(floor), max(floor)],
        "gemm_gflops": flops / ms["gemm"] / 1e6,
        "in_mib": in_bytes / 2**20, "out_mib": out_bytes / 2**20, "peak_extra_mib": peak,
        "mem_ratio": (None if peak is None
                      else (in_bytes / 2**20 + peak) / ((in_bytes + out_bytes) / 2**20)),
        "threads": torch.get_num_threads(),
        "selection": "native" if native.kernel() is not None else "torch",
    }


# --------------------------------------------------------------------------- #
# The table
# --------------------------------------------------------------------------- #


COLUMNS = ("shape", "threads", "turns", "op ms", "output ms", "gemm ms", "op/gemm",
           "bf16 GEMM ms", "f32 GEMM ms",
           "op / faster GEMM [min, max]", "plain ms", "plain/op", "gemm GFLOP/s",
           "peak extra MiB", "in+out MiB", "mem ratio", "selection", "check")


def format_row(r: dict) -> list[str]:
    check = f"{r['check']} {'identical' if r['check_exact'] else 'within CONTRACT.md section 5'}"
    peak = "n/a" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.0f}"
    ratio = "n/a" if r["mem_ratio"] is None else f"{r['mem_ratio']:.2f}"
    lo, hi = r["floor_spread"]
    return [r["shape"], str(r["threads"]), str(r.get("turns", "")), f"{r['op_ms']:.1f}",
            f"{r['output_ms']:.1f}" if "output_ms" in r else "", f"{r['gemm_ms']:.1f}",
            f"{r['op_over_gemm']:.2f}", f"{r['bf16_ms']:.1f}", f"{r['f32_ms']:.1f}",
            f"{r['op_over_floor']:.2f} [{lo:.2f}, {hi:.2f}]",
            f"{r['plain_ms']:.0f}", f"{r['plain_over_op']:.1f}",
            f"{r['gemm_gflops']:.0f}", peak, f"{r['in_mib'] + r['out_mib']:.0f}", ratio,
            r["selection"], check]


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(format_row(r)) + " |" for r in rows]
    return "\n".join(lines)


def run(names: list[str], *, threads: list[int | None] = (None,), out: Path | None = None,
        command_line: str = "", echo=print, repeat: int | None = None) -> list[dict]:
    """Measure ``names`` with each thread count (each in a subprocess);
    optionally append the table to ``out``."""
    rows = []
    for name, count in ((n, t) for n in names for t in threads):
        cmd = [sys.executable, __file__, "--child", name]
        if count:
            cmd += ["--threads", str(count)]
        if repeat:
            cmd += ["--repeat", str(repeat)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"benchmark {name} failed:\n{proc.stdout}\n{proc.stderr}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        echo(" | ".join(format_row(row)))
    if out is not None:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        text = [f"## {stamp} - git {git_sha()}", "", f"- machine: {machine()}",
                f"- lscpu: {cpu_flags()}",
                f"- command: `{command_line}`", "", markdown_table(rows), ""]
        write_atomic(out, "\n".join(text) + "\n", append=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="S1",
                        help=f"comma-separated shape names ({', '.join(SHAPES)}; default S1)")
    parser.add_argument("--threads", default=None,
                        help="intra-op threads, or a comma-separated list of counts to run "
                             "every shape with each (default: torch's, all cores)")
    parser.add_argument("--out", default=None, type=Path,
                        help=f"append the table to this markdown file (e.g. {DEFAULT_RESULTS})")
    parser.add_argument("--repeat", type=int, default=None,
                        help="interleaved turns per shape (default: the shape's own, 3 to 5)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        threads = [int(t) for t in args.threads.split(",")] if args.threads else [None]
    except ValueError:
        parser.error(f"--threads must be a count or a comma-separated list; got {args.threads}")
    if args.repeat is not None and args.repeat < 1:
        parser.error(f"--repeat must be >= 1; got {args.repeat}")
    if any(t is not None and t < 1 for t in threads):
        parser.error(f"--threads must be >= 1; got {args.threads}")
    if args.child:
        if threads[0]:
            torch.set_num_threads(threads[0])
        print(json.dumps(measure_shape(SHAPES[args.child], args.repeat)))
        return 0
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        parser.error(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    settings = [f"{name}={os.environ[name]}" for name in RECORDED_ENV if name in os.environ]
    command_line = " ".join([*settings, "python benchmarks/operator/indexer_bench.py",
                             f"--shapes {','.join(names)}"]
                            + ([f"--threads {args.threads}"] if args.threads else [])
                            + ([f"--repeat {args.repeat}"] if args.repeat else []))
    print(f"machine: {machine()}; {cpu_flags()}; git {git_sha()}")
    print(" | ".join(COLUMNS), flush=True)
    run(names, threads=threads, out=args.out, command_line=command_line, repeat=args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
