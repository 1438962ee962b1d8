"""Stem attention against dense attention on CPU: the end-to-end sweep.

For each length and dtype (B=1, 8 query heads, 2 KV heads, D=128, causal,
random Q/K/V), in one process and alternating, so that machine noise hits
all alike:

* ``dense``: ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)``;
* ``stem``: ``stem_attention`` with its defaults (or ``--preset``), the whole
  call: block representations, indexer, block-sparse attention;
* ``sparse``: ``block_sparse_attention`` alone on the same selection.

Reported: density (kept / causally visible block pairs), E = dense x density
/ sparse (1 means the kernel pays per kept pair what dense attention pays per
visible pair), the speed-ups dense / stem and dense / sparse, the error of
``stem`` against dense (what the sparsity changes) and against dense
attention restricted to the same blocks (sampled rows, float64: exactness).

    python benchmarks/attention/attention_bench.py                       # 16K, fp32 and bf16
    python benchmarks/attention/attention_bench.py --seqs 16384,32768,65536 \\
        --record benchmarks/ATTENTION.md
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import stem_indexer
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # noqa: F401  (every area's folder on sys.path)
from common import (attention_args, attention_options, interleaved_runs, record_table,
                    table_header)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def restricted_error(q, k, v, out, idx, seq_len, bs, scale, rows, gen) -> float:
    """Max |out - reference| on sampled rows; the reference is float64 attention
    over the row's listed blocks with the causal mask."""
    _, hq, sq, _ = q.shape
    group = hq // k.shape[1]
    skv = k.shape[2]
    err = 0.0
    for _ in range(rows):
        h = int(torch.randint(hq, (1,), generator=gen))
        i = int(torch.randint(idx.shape[2], (1,), generator=gen))
        allowed = torch.zeros(skv, dtype=torch.bool)
        for j in idx[0, h, i, : int(seq_len[0, h, i])].tolist():
            allowed[j * bs:(j + 1) * bs] = True
        t = torch.arange(i * bs, min((i + 1) * bs, sq))
        mask = allowed[None, :] & (torch.arange(skv)[None, :] <= t[:, None] + skv - sq)
        s = (q[0, h, t].double() @ k[0, h // group].double().T) * scale
        ref = torch.softmax(s.masked_fill(~mask, -math.inf), dim=-1) @ v[0, h // group].double()
        err = max(err, (out[0, h, t].double() - ref).abs().max().item())
    return err


def measure(seq: int, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, reps: int,
            preset: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, seq, dim, generator=gen).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    scale = dim ** -0.5
    inputs = stem_indexer.stem_inputs(q, k, v, scale=scale / 16)
    idx, lens = stem_indexer.stem_indexer(*inputs, **stem_indexer.PRESETS[preset])

    def dense():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=heads != kv_heads)

    # exact_tail=0: every row is the indexer's list (idx), which the error
    # check below restricts to, as every recorded table measured it
    def stem():
        return stem_indexer.stem_attention(q, k, v, scale=scale, preset=preset, exact_tail=0)

    def sparse():
        return stem_indexer.block_sparse_attention(q, k, v, idx, lens, stem_block_size=128,
                                                   scale=scale)

    out, info = stem_indexer.stem_attention(q, k, v, scale=scale, preset=preset,
                                            exact_tail=0, return_info=True)
    ref = dense()
    exact = restricted_error(q, k, v, out, idx, lens, 128, scale, 8, gen)
    vs_dense = (out.float() - ref.float()).abs().max().item()
    del ref
    runs = interleaved_runs({"dense": dense, "stem": stem, "sparse": sparse}, reps=reps)
    ms = {name: statistics.median(t) for name, t in runs.items()}
    turns = [d / s for d, s in zip(runs["dense"], runs["stem"])]
    return {"spread": (min(turns), max(turns)),
            "seq": seq, "dtype": str(dtype).replace("torch.", ""), "density": info.density,
            "path": info.path, "backend": info.backend, "E": ms["dense"] * info.density /
            ms["sparse"], "dense": ms["dense"], "stem": ms["stem"], "sparse": ms["sparse"],
            "exact": exact, "vs_dense": vs_dense}


COLUMNS = ("tokens", "dtype", "density", "dense s", "stem_attention s",
           "dense / stem, median [min, max]",
           "block-sparse s", "E", "max err vs same blocks", "max err vs dense")


def row(r: dict) -> str:
    cells = [f"{r['seq'] // 1024}K", r["dtype"], f"{r['density']:.1%}", f"{r['dense'] / 1e3:.2f}",
             f"{r['stem'] / 1e3:.2f}",
             f"{r['dense'] / r['stem']:.2f}x [{r['spread'][0]:.2f}, {r['spread'][1]:.2f}]",
             f"{r['sparse'] / 1e3:.2f}", f"{r['E']:.2f}", f"{r['exact']:.1e}",
             f"{r['vs_dense']:.1e}"]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    attention_options(parser, seqs="16384", dtypes="fp32,bf16", heads=8, kv_heads=2, dim=128,
                      reps=3)
    parser.add_argument("--preset", choices=tuple(stem_indexer.PRESETS), default="default")
    args, seqs, names = attention_args(parser, argv, DTYPES)
    header = table_header(
        f"B=1, Hq={args.heads}, Hkv={args.kv_heads}, D={args.dim}, causal, preset "
        f"{args.preset}; medians of {args.reps} turns, the three calls alternating; [min, max] "
        "of the turns' ratios.", COLUMNS)
    print("\n".join(header), flush=True)
    lines = []
    for seq in seqs:
        for name in names:
            lines.append(row(measure(seq, DTYPES[name], args.heads, args.kv_heads, args.dim,
                                     args.reps, args.preset)))
            print(lines[-1], flush=True)
    record_table(args.record, "attention/attention_bench.py", argv, header, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
