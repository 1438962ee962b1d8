"""CPU attention against the silicon: bfloat16 TFLOP/s beside the machine's own GEMM.

Dense attention and ``block_sparse_attention`` at full density (every
causally visible key block listed) do the same useful work: for S tokens,
``4 x D x Hq x S (S + 1) / 2`` floating-point operations (Q K^T and P V over
the causally visible pairs). Each is reported as TFLOP/s and as a fraction of
what ``torch.matmul`` reaches on a square GEMM in the same run, the faster
of bfloat16 and float32 (the machine's GEMM throughput, the ceiling a kernel
built on GEMMs can approach; on an Intel CPU without AMX the float32 one is
the faster). One process, B=1, causal, random Q/K/V; per turn, in order:

* ``gemm`` and ``gemm32``: ``torch.matmul`` of two N x N matrices
  (``--gemm``), bfloat16 and float32;
* ``sdpa``: ``scaled_dot_product_attention(is_causal=True, enable_gqa=...)``;
* ``kernel``: ``block_sparse_attention`` (the native kernel) on the full
  lists, its default bfloat16 path (``sparse_attention.status()``);
* ``micro-kernel``: the kernel with ``bf16="brgemm"`` (torch's bfloat16
  micro-kernel), where the CPU has one;
* ``widen``: the kernel with ``bf16="widen"`` (bfloat16 widened to float32
  and multiplied by MKL's ``sgemm_``).

Times are medians over the turns; ``kernel / sdpa`` is the speed ratio per
turn (median [min, max]). The kernel's output is checked against SDPA's (max
abs difference, both bfloat16).

    python benchmarks/attention/silicon_bench.py                          # 16K, D 64 and 128
    python benchmarks/attention/silicon_bench.py --record benchmarks/ATTENTION_KERNEL.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import stem_indexer
from stem_indexer.operator.ops import sparse_attention as sa, torch_blas
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # noqa: F401  (every area's folder on sys.path)
from common import interleaved_runs, record_table, table_header

BLOCK = 128


def causal_flops(seq: int, heads: int, dim: int) -> float:
    """Floating-point operations of causal attention over S tokens: two
    products (Q K^T, P V) of 2 x D each per causally visible pair."""
    return 4.0 * dim * heads * seq * (seq + 1) / 2


def full_lists(seq: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every causally visible key block of every query block, ascending."""
    nb = -(-seq // BLOCK)
    idx = torch.arange(nb, dtype=torch.int32).expand(1, heads, nb, nb).contiguous()
    lens = (torch.arange(nb, dtype=torch.int32) + 1).expand(1, heads, nb).contiguous()
    return idx, lens


def measure(seq: int, dim: int, heads: int, kv_heads: int, gemm_n: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, seq, dim, generator=gen).bfloat16()
               for h in (heads, kv_heads, kv_heads))
    a, b = (torch.randn(gemm_n, gemm_n, generator=gen).bfloat16() for _ in range(2))
    a32, b32 = a.float(), b.float()
    idx, lens = full_lists(seq, heads)
    scale = dim ** -0.5
    lengths = torch.tensor([seq])

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=heads != kv_heads)

    def kernel():
        return stem_indexer.block_sparse_attention(q, k, v, idx, lens, stem_block_size=BLOCK,
                                                   scale=scale, backend="native")

    def path(bf16):
        return lambda: sa.sparse_attention(q, k, v, idx, lens, lengths, lengths, BLOCK, True,
                                           scale, bf16=bf16)

    diff = (kernel().float() - sdpa().float()).abs().max().item()
    calls = {"gemm": lambda: a @ b, "gemm32": lambda: a32 @ b32, "sdpa": sdpa,
             "kernel": kernel, "widen": path("widen")}
    if sa.bf16_packed(dim, BLOCK) is None:
        calls["micro-kernel"] = path("brgemm")
    runs = interleaved_runs(calls, reps=reps)
    ms = {name: statistics.median(t) for name, t in runs.items()}
    work = causal_flops(seq, heads, dim)
    tflops = {name: work / (ms[name] * 1e-3) / 1e12 for name in ms if "gemm" not in name}
    for name in ("gemm", "gemm32"):
        tflops[name] = 2.0 * gemm_n ** 3 / (ms[name] * 1e-3) / 1e12
    turns = [s / kt for s, kt in zip(runs["sdpa"], runs["kernel"])]
    return {"seq": seq, "dim": dim, "ms": ms, "tflops": tflops, "diff": diff,
            "ratio": (statistics.median(turns), min(turns), max(turns))}


COLUMNS = ("tokens", "D", "GEMM TFLOP/s, bfloat16 / float32", "SDPA TFLOP/s (of GEMM)",
           "kernel TFLOP/s (of GEMM)", "micro-kernel TFLOP/s (of GEMM)",
           "widen TFLOP/s (of GEMM)", "kernel speed / SDPA's, median [min, max]", "SDPA ms",
           "kernel ms", "max diff vs SDPA")


def row(r: dict) -> str:
    t = r["tflops"]
    gemm = max(t["gemm"], t["gemm32"])  # the machine's faster GEMM
    frac = {name: f"{t[name]:.3f} ({t[name] / gemm:.0%})" if name in t else "-"
            for name in ("sdpa", "kernel", "micro-kernel", "widen")}
    med, lo, hi = r["ratio"]
    cells = [f"{r['seq'] // 1024}K", str(r["dim"]), f"{t['gemm']:.3f} / {t['gemm32']:.3f}",
             frac["sdpa"], frac["kernel"], frac["micro-kernel"], frac["widen"],
             f"{med:.2f}x [{lo:.2f}, {hi:.2f}]", f"{r['ms']['sdpa']:.0f}",
             f"{r['ms']['kernel']:.0f}", f"{r['diff']:.1e}"]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="16384", help="comma-separated token counts")
    parser.add_argument("--dims", default="64,128", help="comma-separated head sizes")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--gemm", type=int, default=2048, help="N of the N x N x N GEMM")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--record", type=Path, help="append the table to this markdown file")
    args = parser.parse_args(argv)
    if args.record is not None and not args.record.parent.is_dir():
        parser.error(f"--record: directory {args.record.parent} does not exist")
    if not sa.available():
        parser.error(f"the native kernel is unavailable here: {sa.status()}")
    fns, why = torch_blas.bf16_brgemm()
    pays, reason = torch_blas.bf16_products_pay()
    path = ("torch's bfloat16 micro-kernel" if fns is not None and pays
            else f"widen ({why if fns is None else reason})")
    header = table_header(
        f"B=1, Hq={args.heads}, Hkv={args.kv_heads}, causal, bfloat16, block {BLOCK}, "
        f"{torch.get_num_threads()} threads; the kernel's bfloat16 path: {path}; GEMM "
        f"{args.gemm}^3, the fraction of the faster; medians of {args.reps} turns, the calls "
        "alternating.", COLUMNS)
    print("\n".join(header), flush=True)
    lines = []
    for seq in (int(s) for s in args.seqs.split(",")):
        for dim in (int(d) for d in args.dims.split(",")):
            lines.append(row(measure(seq, dim, args.heads, args.kv_heads, args.gemm, args.reps)))
            print(lines[-1], flush=True)
    record_table(args.record, "attention/silicon_bench.py", argv, header, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
