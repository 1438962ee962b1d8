"""CPU benchmark of the indexer: the op against its own score GEMM and a plain baseline.

For each shape the benchmark checks the op's output first (against the
scalar reference where that is fast enough, else against the plain baseline,
which is itself checked against the reference on the small shapes), then
reports in one run:

* ``op``: the op's median time (metadata prebuilt, as a model would reuse it);
* ``gemm``: the bare score GEMM over exactly the causally visible (query
  block, key block) pairs, bf16 operands in and float32 scores out, done the
  fastest way this machine offers: upcast to float32 into reused buffers,
  then batched SGEMMs (no native bf16 GEMM here, see ``gemm_line``);
  ``sgemm`` is its SGEMM part alone, on operands upcast beforehand;
* ``plain``: the version a user would write: one full float32 score matmul
  per (batch, KV head), mask, stable descending sort per row, take the budget;
* the ratios op/gemm and plain/op, and the op's peak extra memory (resident
  set growth during one call, outputs included) against inputs + outputs;
* which selection the op ran: ``native`` (the C kernel of ``ops/native.py``)
  or ``torch`` (its fallback; ``STEM_INDEXER_NATIVE=0`` forces it).

Each shape runs in a fresh subprocess so that its memory peak is its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import contract
from .compare import compare
from .contract import IndexerParams, ceil_div
from .ops import native

DEFAULT_RESULTS = Path("benchmarks") / "RESULTS.md"
# Environment settings that change what is measured; the recorded command
# line names those that are set.
RECORDED_ENV = ("STEM_INDEXER_NATIVE", "THP_MEM_ALLOC_ENABLE", "OMP_NUM_THREADS")


@dataclass(frozen=True)
class Shape:
    """One benchmark shape (Bs 128, stride 16, Df 2048, causal, defaults)."""

    name: str
    about: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    q_heads: int
    kv_heads: int
    dim: int = 2048
    check: str = "reference"  # or "plain"
    repeat: int = 5

    @property
    def params(self) -> IndexerParams:
        return IndexerParams()

    def make_inputs(self, seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        bs = self.params.stem_block_size
        batch = len(self.q_lens)
        qmax = max(ceil_div(x, bs) for x in self.q_lens)
        kmax = max(ceil_div(x, bs) for x in self.kv_lens)
        qflat = torch.empty((batch, self.q_heads, qmax, self.dim), dtype=torch.bfloat16)
        kflat = torch.empty((batch, self.kv_heads, kmax, self.dim), dtype=torch.bfloat16)
        for t in (qflat, kflat):  # in slices: no float32 copy of the whole input
            for part in t.view(-1, self.dim).split(1 << 14):
                part.copy_(torch.randn(part.shape, generator=gen))
        vbias = torch.rand((batch, self.kv_heads, kmax), generator=gen) * 0.3
        i32 = dict(dtype=torch.int32)
        return {"qflat": qflat, "kflat": kflat, "vbias": vbias,
                "q_seq_lens": torch.tensor(self.q_lens, **i32),
                "kv_seq_lens": torch.tensor(self.kv_lens, **i32)}


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("S1", "article example: B4 Nq64 Nk8, 16 q blocks, 64 kv blocks",
          (2048,) * 4, (8192,) * 4, 64, 8),
    Shape("S2", "B1 Nq32 Nk8, q 3968, kv 32K", (3968,), (32768,), 32, 8),
    Shape("S3", "B1 Nq32 Nk8, q 8K, kv 1M", (8192,), (1 << 20,), 32, 8,
          check="plain", repeat=5),
    Shape("S4", "B1 Nq32 Nk8, q = kv = 128K, causal prefill", (1 << 17,), (1 << 17,), 32, 8,
          check="plain", repeat=5),
    Shape("S5", "B8 Nq64 Nk8, mixed prefill/decode, lengths up to 64K",
          (65536, 1, 16384, 1, 40000, 128, 1, 30000),
          (65536, 65536, 50000, 12345, 40000, 64000, 777, 61000), 64, 8,
          check="plain", repeat=5),
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


def gemm_line(inputs: dict, metadata: torch.Tensor, params: IndexerParams, *,
              upcast: bool = True):
    """A closure computing the op's score GEMM alone: bf16 in, float32 out.

    Every (query block, key block) pair a row can see, in the op's own
    blocking (``ops.cpu.gemm_blocks``, the plan's tiles, float32 buffers
    reused across calls): the fastest way this machine offers, as this CPU
    build has no fast bf16 GEMM (``torch.bmm`` on bf16 runs a reference
    loop). Only ``* 1/R^2 + vbias``, the selection and the output are left
    out. ``upcast=False`` times the SGEMMs alone, on operands converted
    before the clock starts.
    """
    from .metadata import key_chunk, read_plan
    from .ops.cpu import KEY_CACHE_BYTES, gemm_blocks

    qflat, kflat = inputs["qflat"], inputs["kflat"]
    _, nq, _, df = qflat.shape
    nk = kflat.shape[1]
    group = nq // nk
    bs = params.stem_block_size
    q_lens, kv_lens = inputs["q_seq_lens"], inputs["kv_seq_lens"]
    tiles = read_plan(metadata, q_lens, kv_lens, nq, nk, params.causal, bs, df,
                      params.window_size).tolist()
    qb_all = ceil_div(q_lens.to(torch.int64), bs).tolist()
    kb_all = ceil_div(kv_lens.to(torch.int64), bs).tolist()
    work = []  # (b, i0, i1, keys cached for the batch, matmul blocks)
    for b, i0, i1, _ in tiles:
        s2 = contract.visible_blocks(torch.arange(i0, i1), qb_all[b], kb_all[b], params.causal)
        cached = 4 * nk * kb_all[b] * df <= KEY_CACHE_BYTES
        chunk = kb_all[b] if cached else key_chunk(nk, df)
        work.append((b, i0, i1, cached, list(gemm_blocks(s2.tolist(), 0, int(s2[-1]), chunk))))
    rows_max = max((i1 - i0 for _, i0, i1, *_ in work), default=1)
    width_max = max((j1 - j0 for *_, blocks in work for _, _, j0, j1, _ in blocks), default=1)
    chunk_max = max((u1 - u0 for *_, blocks in work for u0, u1, *_ in blocks), default=1)
    q32 = torch.empty((nk, rows_max, group, df))
    k32 = torch.empty((nk, chunk_max, df))
    out = torch.empty((nk, rows_max * group * width_max))
    pre = {b: kflat[b].float() for b in {w[0] for w in work}} if not upcast else {}

    def run():
        cached_for = None
        for b, i0, i1, cached, blocks in work:
            c = i1 - i0
            q = q32[:, :c]
            q.copy_(qflat[b, :, i0:i1].view(nk, group, c, df).transpose(1, 2))
            whole = not upcast or cached  # the batch's keys are float32 already
            if not upcast:
                k = pre[b]
            elif cached:  # the batch's keys, upcast once (as the op does)
                if cached_for != b:
                    k32[:, :kb_all[b]].copy_(kflat[b, :, :kb_all[b]])
                    cached_for = b
                k = k32
            held = 0 if whole else None
            for u0, u1, j0, j1, r in blocks:
                if not whole and held != u0:
                    k = k32[:, :u1 - u0].copy_(kflat[b, :, u0:u1])
                    held = u0
                rows = q[:, r:].reshape(nk, (c - r) * group, df)
                o = out[:, :(c - r) * group * (j1 - j0)].view(nk, (c - r) * group, j1 - j0)
                torch.bmm(rows, k[:, j0 - held:j1 - held].transpose(1, 2), out=o)
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


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure_shape(shape: Shape) -> dict:
    """Correctness, then times and memory, for one shape (this process)."""
    params = shape.params
    inputs = shape.make_inputs()
    metadata = _metadata(inputs, params)
    peak = _peak_extra_mib(lambda: run_op(inputs, metadata, params))
    out = run_op(inputs, metadata, params)
    in_bytes = _nbytes(*inputs.values(), metadata)
    out_bytes = _nbytes(*out)

    start = time.perf_counter()
    if shape.check == "reference":
        from .reference import stem_indexer_reference
        expected = stem_indexer_reference(**inputs, **dataclasses.asdict(params))
    else:
        expected = plain_indexer(inputs, params)
    verdict = compare(out, expected, inputs, params)
    check_seconds = time.perf_counter() - start
    if not verdict.ok:
        raise AssertionError(f"{shape.name}: op differs from {shape.check}: {verdict.summary()}")
    exact = torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
    del out, expected

    flops = 2.0 * visible_pairs(inputs, params) * shape.q_heads * shape.dim
    gemm = gemm_line(inputs, metadata, params)
    sgemm = gemm_line(inputs, metadata, params, upcast=False)
    op_call = lambda: run_op(inputs, metadata, params)  # noqa: E731
    for fn in (op_call, gemm, sgemm):  # warm-up
        fn()
    # Interleaved, so that machine noise hits all of them alike.
    t_op, t_gemm, t_sgemm, t_plain = [], [], [], []
    for _ in range(shape.repeat):
        t_op.append(_seconds(op_call))
        t_gemm.append(_seconds(gemm))
        t_sgemm.append(_seconds(sgemm))
    for _ in range(max(1, shape.repeat // 2)):
        t_plain.append(_seconds(lambda: plain_indexer(inputs, params)))
    op, gemm_s, sgemm_s, plain = (statistics.median(t) for t in (t_op, t_gemm, t_sgemm, t_plain))
    return {
        "shape": shape.name, "about": shape.about, "check": shape.check,
        "check_exact": exact, "check_seconds": round(check_seconds, 1),
        "op_ms": op * 1e3, "gemm_ms": gemm_s * 1e3, "sgemm_ms": sgemm_s * 1e3,
        "plain_ms": plain * 1e3, "op_over_gemm": op / gemm_s, "plain_over_op": plain / op,
        "gemm_gflops": flops / gemm_s / 1e9, "sgemm_gflops": flops / sgemm_s / 1e9,
        "in_mib": in_bytes / 2**20, "out_mib": out_bytes / 2**20, "peak_extra_mib": peak,
        "mem_ratio": (None if peak is None
                      else (in_bytes / 2**20 + peak) / ((in_bytes + out_bytes) / 2**20)),
        "threads": torch.get_num_threads(),
        "selection": "native" if native.kernel() is not None else "torch",
    }


# --------------------------------------------------------------------------- #
# The table
# --------------------------------------------------------------------------- #


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cpus, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})"


def git_sha() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=Path(__file__).parent
                               ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


COLUMNS = ("shape", "op ms", "gemm ms", "op/gemm", "sgemm ms", "plain ms", "plain/op",
           "gemm GFLOP/s", "peak extra MiB", "in+out MiB", "mem ratio", "selection", "check")


def format_row(r: dict) -> list[str]:
    check = f"{r['check']} {'identical' if r['check_exact'] else 'equal within SPEC 5'}"
    peak = "n/a" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.0f}"
    ratio = "n/a" if r["mem_ratio"] is None else f"{r['mem_ratio']:.2f}"
    return [r["shape"], f"{r['op_ms']:.1f}", f"{r['gemm_ms']:.1f}", f"{r['op_over_gemm']:.2f}",
            f"{r['sgemm_ms']:.1f}", f"{r['plain_ms']:.0f}", f"{r['plain_over_op']:.1f}",
            f"{r['gemm_gflops']:.0f}", peak, f"{r['in_mib'] + r['out_mib']:.0f}", ratio,
            r.get("selection", "torch"), check]


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(format_row(r)) + " |" for r in rows]
    return "\n".join(lines)


def run(names: list[str], *, threads: int | None = None, out: Path | None = None,
        command_line: str = "", echo=print) -> list[dict]:
    """Measure ``names`` (each in a subprocess); optionally append to ``out``."""
    rows = []
    for name in names:
        cmd = [sys.executable, "-m", "stem_indexer.bench", "--child", name]
        if threads:
            cmd += ["--threads", str(threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"benchmark {name} failed:\n{proc.stdout}\n{proc.stderr}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        echo(" | ".join(format_row(row)))
    if out is not None:
        write_results(rows, out, command_line)
    return rows


def write_results(rows: list[dict], path: Path, command_line: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = [f"## {stamp} - git {git_sha()}", "",
            f"- machine: {machine()}",
            f"- threads: {rows[0]['threads'] if rows else '?'}",
            f"- command: `{command_line}`", "",
            markdown_table(rows), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("\n".join(text) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stem-indexer bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        if args.threads:
            torch.set_num_threads(args.threads)
        import stem_indexer  # noqa: F401  (registers the ops)
        print(json.dumps(measure_shape(SHAPES[args.child])))
        return 0
    return command(args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default="S1,S2,S3,S4,S5",
                        help="comma-separated shape names (S1..S5)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads (default: torch's, all cores)")
    parser.add_argument("--out", default=None,
                        help=f"append the table to this markdown file (e.g. {DEFAULT_RESULTS})")


def command(args: argparse.Namespace) -> int:
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; choose from {sorted(SHAPES)}")
    command_line = f"stem-indexer bench --shapes {','.join(names)}"
    settings = [f"{name}={os.environ[name]}" for name in RECORDED_ENV if name in os.environ]
    command_line = " ".join([*settings, command_line])
    if args.threads:
        command_line += f" --threads {args.threads}"
    if args.out:
        command_line += f" --out {args.out}"
    print(f"machine: {machine()}; git {git_sha()}")
    print(" | ".join(COLUMNS))
    run(names, threads=args.threads, out=Path(args.out) if args.out else None,
        command_line=command_line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
