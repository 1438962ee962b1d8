"""Sliding-window attention at window cost against SDPA with the sliding mask (CPU).

One sliding-window layer of Gemma-3-270M's shape by default (B=1, 4 query
heads, 1 KV head, D=256, window W=512), random Q/K/V, queries = keys = S:

* ``sdpa``: ``scaled_dot_product_attention`` with the 4-D boolean sliding
  mask transformers builds for such a layer (what the transformers
  integration ran for sliding layers before: S x S work);
* ``window``: ``stem_indexer.pipeline.window.sliding_window_attention`` (chunks of
  queries on their ``chunk + W - 1`` keys: S x W work).

The two calls alternate, ``--reps`` times after a warm-up; reported: the
median time of each, the median of the per-turn ratios sdpa / window with
their [min, max], and the largest difference between the two outputs.

    python benchmarks/attention/window_bench.py --seqs 2048                 # a quick run
    python benchmarks/attention/window_bench.py --seqs 8192,16384,32768 \\
        --record benchmarks/WINDOW.md
    python benchmarks/attention/window_bench.py --seqs 8192 --chunks 128,256,512,1024  # chunk sizes

``--dense-above`` measures instead where ``stem_attention`` stops paying off
(the break-even behind ``contract.DENSE_ABOVE``): at one length (``--seqs``,
one value), B=1, 8 query and 2 KV heads, D=128 (``ATTENTION.md``'s shape),
budgets ``Ks`` from ``--budgets`` (``k_block_num_bias_medium`` with rate 0,
so every row's budget is Ks blocks; at 8K the default budget is 42 of 64),
``stem_attention(dense_above=1.0)`` (always sparse) against dense causal
SDPA, interleaved; the density is the kept share of the visible pairs.

    python benchmarks/attention/window_bench.py --dense-above --seqs 8192 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # noqa: F401  (every area's folder on sys.path)
from common import (attention_args, attention_options, interleaved_runs, record_table,
                    table_header)
from stem_indexer.pipeline.window import (default_chunk, sliding_window_attention,
                                          sliding_window_mask)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure(seq: int, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, window: int,
            chunk: int | None, reps: int) -> dict:
    gen = torch.Generator().manual_seed(seq)
    q = torch.randn(1, heads, seq, dim, generator=gen).to(dtype)
    k, v = (torch.randn(1, kv_heads, seq, dim, generator=gen).to(dtype) for _ in range(2))
    mask = sliding_window_mask(torch.ones(1, seq, dtype=torch.bool), seq, window)
    gqa = heads != kv_heads
    outs = {}

    def sdpa():
        outs["sdpa"] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    def windowed():
        outs["window"] = sliding_window_attention(q, k, v, window, chunk=chunk)

    with torch.inference_mode():
        runs = interleaved_runs({"sdpa": sdpa, "window": windowed}, reps=reps, warmup=1)
    ratios = [a / b for a, b in zip(runs["sdpa"], runs["window"])]
    err = (outs["sdpa"].float() - outs["window"].float()).abs().max().item()
    return dict(sdpa=statistics.median(runs["sdpa"]), window=statistics.median(runs["window"]),
                ratio=statistics.median(ratios), lo=min(ratios), hi=max(ratios), err=err)


def measure_budget(seq: int, dtype: torch.dtype, budget: int, reps: int) -> dict:
    import stem_indexer

    gen = torch.Generator().manual_seed(seq)
    q = torch.randn(1, 8, seq, 128, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, seq, 128, generator=gen).to(dtype) for _ in range(2))
    kwargs = dict(k_block_num_rate_medium=0.0, k_block_num_bias_medium=budget,
                  k_block_num_rate_large=0.0, k_block_num_bias_large=budget, dense_above=1.0,
                  exact_tail=0)  # the budget's density, no row widened
    info = []

    def dense():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def stem():
        info[:] = [stem_indexer.stem_attention(q, k, v, return_info=True, **kwargs)[1]]

    with torch.inference_mode():
        runs = interleaved_runs({"dense": dense, "stem": stem}, reps=reps, warmup=1)
    ratios = [a / b for a, b in zip(runs["dense"], runs["stem"])]
    return dict(density=info[0].density, path=info[0].path,
                dense=statistics.median(runs["dense"]), stem=statistics.median(runs["stem"]),
                ratio=statistics.median(ratios), lo=min(ratios), hi=max(ratios))


def dense_above_table(seq: int, dtypes: list[str], budgets: list[int], reps: int) -> tuple:
    header = table_header(
        f"B=1, Hq=8, Hkv=2, D=128, causal, {_tokens(seq)} tokens, blocks of 128, stride 16; "
        f"{reps} turns, the two calls alternating.",
        ["dtype", "budget Ks (blocks)", "density", "dense SDPA ms", "stem_attention ms",
         "dense / stem, median [min, max]"])
    print("\n".join(header), flush=True)
    lines = []
    for name in dtypes:
        for budget in budgets:
            r = measure_budget(seq, DTYPES[name], budget, reps)
            assert r["path"] == "sparse", r
            line = (f"| {name} | {budget} | {r['density']:.1%} | {r['dense']:.0f} | "
                    f"{r['stem']:.0f} | {r['ratio']:.2f}x [{r['lo']:.2f}, {r['hi']:.2f}] |")
            lines.append(line)
            print(line, flush=True)
    return header, lines


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    attention_options(parser, seqs="2048", dtypes="bf16,fp32", heads=4, kv_heads=1, dim=256,
                      reps=5)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--chunks", default="",
                        help="comma-separated queries per chunk (default: default_chunk(W))")
    parser.add_argument("--dense-above", action="store_true",
                        help="the density sweep of stem_attention against dense attention")
    parser.add_argument("--budgets", default="8,16,24,32,40,48,56",
                        help="with --dense-above: budgets Ks in blocks")
    args, seqs, dtypes = attention_args(parser, argv, DTYPES)
    chunks = [int(c) for c in args.chunks.split(",")] if args.chunks else [None]
    if args.dense_above:
        if len(seqs) != 1:
            parser.error("--dense-above takes one length in --seqs")
        header, lines = dense_above_table(seqs[0], dtypes, [int(b) for b in
                                                            args.budgets.split(",")], args.reps)
        record_table(args.record, "attention/window_bench.py", argv, header, lines)
        return 0
    header = table_header(
        f"B=1, Hq={args.heads}, Hkv={args.kv_heads}, D={args.dim}, W={args.window}; "
        f"{args.reps} turns, the two calls alternating.",
        ["tokens", "dtype", "chunk", "SDPA with the sliding mask ms", "windowed ms",
         "SDPA / windowed, median [min, max]", "max abs diff"])
    print("\n".join(header), flush=True)
    lines = []
    for seq in seqs:
        for name in dtypes:
            for chunk in chunks:
                r = measure(seq, DTYPES[name], args.heads, args.kv_heads, args.dim,
                            args.window, chunk, args.reps)
                used = chunk or default_chunk(min(args.window, seq))
                line = (f"| {_tokens(seq)} | {name} | {used} | {r['sdpa']:.1f} | "
                        f"{r['window']:.1f} | {r['ratio']:.2f}x [{r['lo']:.2f}, {r['hi']:.2f}] "
                        f"| {r['err']:.1e} |")
                lines.append(line)
                print(line, flush=True)
    record_table(args.record, "attention/window_bench.py", argv, header, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
