"""Block-sparse attention on the indexer's selection vs dense SDPA.

For each dtype: build Q/K/V, run the indexer with its default parameters,
check the sparse result (against dense attention restricted to the same
blocks, on sampled rows; against full dense attention, everywhere), then time
sparse attention and dense causal ``scaled_dot_product_attention`` alternately
and report medians and their ratio.

    .venv/bin/python benchmarks/attention_bench.py              # 32K tokens, fp32 and bf16
    .venv/bin/python benchmarks/attention_bench.py --seq 8192 --reps 2

Random Q/K give near-uniform block scores; the budget (and so the density)
depends only on the length, so timing on them is representative.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import stem_indexer
from stem_indexer.attention import block_sparse_attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return name


def restricted_error(q, k, v, out, idx, seq_len, bs, scale, rows, gen) -> float:
    """Max |out - reference| on sampled rows; the reference is dense float64
    attention over all keys with the row's listed blocks and the causal mask."""
    _, hq, sq, _ = q.shape
    group = hq // k.shape[1]
    qmax = idx.shape[2]
    skv = k.shape[2]
    err = 0.0
    for _ in range(rows):
        h = int(torch.randint(hq, (1,), generator=gen))
        i = int(torch.randint(qmax, (1,), generator=gen))
        allowed = torch.zeros(skv, dtype=torch.bool)
        for j in idx[0, h, i, : int(seq_len[0, h, i])].tolist():
            allowed[j * bs:(j + 1) * bs] = True
        t = torch.arange(i * bs, min((i + 1) * bs, sq))
        mask = allowed[None, :] & (torch.arange(skv)[None, :] <= t[:, None] + skv - sq)
        s = (q[0, h, t].double() @ k[0, h // group].double().T) * scale
        p = torch.softmax(s.masked_fill(~mask, -math.inf), dim=-1)
        ref = p @ v[0, h // group].double()
        err = max(err, (out[0, h, t].double() - ref).abs().max().item())
    return err


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--check-rows", type=int, default=16)
    args = ap.parse_args()

    bs, seq, d = 128, args.seq, args.dim
    scale = 1.0 / math.sqrt(d)
    env = (f"machine: {machine()}, threads: {torch.get_num_threads()}, "
           f"torch {torch.__version__}, git {git_sha()}")
    print(f"B=1 Hq={args.heads} Hkv={args.kv_heads} S={seq} D={d} Bs={bs} Ts=16; {env}")
    header = ("| dtype | density | indexer s | sparse attn s | dense SDPA s | dense / sparse "
              "| max err vs same-mask dense | max err vs full dense | env |")
    rows = []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, args.heads, seq, d, generator=gen).to(dtype)
        k = torch.randn(1, args.kv_heads, seq, d, generator=gen).to(dtype)
        v = torch.randn(1, args.kv_heads, seq, d, generator=gen).to(dtype)

        def select():
            inputs = stem_indexer.stem_inputs(q, k, v, block_size=bs, stride=16,
                                              scale=scale / 16)
            return stem_indexer.stem_indexer(inputs.qflat, inputs.kflat, inputs.vbias,
                                             inputs.q_seq_lens, inputs.kv_seq_lens)

        t_index, (idx, seq_len) = timed(select)
        qb = idx.shape[2]
        causal_pairs = args.heads * qb * (qb + 1) // 2
        density = int(seq_len.sum()) / causal_pairs

        def sparse():
            return block_sparse_attention(q, k, v, idx, seq_len, block_size=bs, causal=True)

        def dense():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=args.heads != args.kv_heads)

        # Correctness first, on the inputs that are timed.
        t_s, out = timed(sparse)
        err_same = restricted_error(q, k, v, out, idx, seq_len, bs, scale, args.check_rows, gen)
        t_d, ref = timed(dense)
        err_full = (out.float() - ref.float()).abs().max().item()
        del ref
        sparse_times, dense_times = [t_s], [t_d]
        for _ in range(args.reps - 1):
            sparse_times.append(timed(sparse)[0])
            dense_times.append(timed(dense)[0])
        ts, td = statistics.median(sparse_times), statistics.median(dense_times)
        row = (f"| {name} | {density:.1%} | {t_index:.2f} | {ts:.2f} | {td:.2f} | {td / ts:.2f}x "
               f"| {err_same:.2e} | {err_full:.2e} | {env} |")
        print(row, flush=True)
        rows.append(row)
    print()
    print(header)
    print("|" + "---|" * 9)
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
