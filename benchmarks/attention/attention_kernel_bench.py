"""The C block-sparse attention kernel (``ops/sparse_attention.py``) against dense SDPA.

Efficiency (per kept block pair, against dense attention per visible pair):

    E = dense_time * density / sparse_time

dense_time: ``F.scaled_dot_product_attention(q, k, v, is_causal=True,
enable_gqa=...)`` on the same inputs (with B=4 and different lengths: the sum
of one SDPA call per batch on its valid tokens, so padding is not charged to
dense); density: listed (query block, key block) pairs of the valid rows /
causally visible block pairs. E = 1 means the kernel pays per kept pair what
dense SDPA pays per visible pair. The torch path of the package
(``block_sparse_attention(..., backend="gather")``) is timed in the same run
as the baseline. Dense, kernel and gather runs alternate; times are medians,
E is the median over repetitions of dense_time * density / sparse_time taken
from runs of the same repetition (adjacent in time, so drift in the machine's
load cancels). Other jobs share the machine, so E is also given from process
CPU time (both threads' CPU seconds, which preemption does not inflate).

The kernel is timed alone (``sparse_attention`` on host-checked, sorted
lists); ``block_sparse_attention`` also checks the selection, on the host.

Selections: ``stem`` is the package's indexer with default parameters (block
128, stride 16, as ``stem_attention`` calls it) on random q/k/v; ``synthNN``
keeps the 4 sink blocks, the 4 window blocks and random picks, about NN% of
the visible block pairs. Errors: max |out - reference| on sampled rows, the
reference being float64 attention restricted to the row's listed blocks and
the token mask.

    .venv/bin/python benchmarks/attention/attention_kernel_bench.py             # 16K, a few configs
    .venv/bin/python benchmarks/attention/attention_kernel_bench.py --full      # the sweep (hours)
    .venv/bin/python benchmarks/attention/attention_kernel_bench.py --full --seqs 32768 \\
        --dtypes bf16
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import stem_indexer
from stem_indexer.surfaces.attention import block_sparse_attention
from stem_indexer.operator.ops import sparse_attention as sa, torch_blas

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEADS = {"gqa": (8, 2), "mha": (8, 8)}
BS, STRIDE = 128, 16


@dataclass(frozen=True)
class Config:
    seq: int
    heads: str
    dim: int
    batch: int
    dtype: str
    selection: str

    def __str__(self) -> str:
        hq, hkv = HEADS[self.heads]
        return (f"{self.seq // 1024}K {self.heads.upper()} {hq}/{hkv} D{self.dim} B{self.batch} "
                f"{self.dtype} {self.selection}")

    def lengths(self) -> list[int]:
        """Valid tokens per batch: one full sequence, or four different ones."""
        s = self.seq
        return [s] if self.batch == 1 else [s, 3 * s // 4 + 100, s // 2 - 50, s // 4 + 37]


QUICK = [Config(16384, "gqa", 128, 1, "fp32", "stem"),
         Config(16384, "gqa", 128, 1, "bf16", "stem"),
         Config(16384, "gqa", 128, 1, "bf16", "synth25"),
         Config(16384, "mha", 64, 1, "bf16", "synth50"),
         Config(16384, "gqa", 128, 4, "bf16", "stem")]


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    """lscpu's model name, cores, and the vector / matrix extensions that matter here."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        flags = info.get("Flags", "").split()
        ext = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
        return (f"{info.get('Model name', '?').strip()}, {info.get('CPU(s)', '?').strip()} CPUs, "
                f"{' '.join(ext)}")
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()


def sorted_lists(idx: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 lists, ascending, -1 past each row's length (what the caller hands the kernel)."""
    lengths = lengths.to(torch.int64)
    width = int(lengths.max()) if lengths.numel() else 0
    listed = torch.arange(width) < lengths[..., None]
    idx = torch.where(listed, idx[..., :width].to(torch.int64), 1 << 40).sort(-1).values
    return torch.where(listed, idx, -1), lengths


def stem_selection(q, k, v, lens, scale):
    ql = torch.tensor(lens, dtype=torch.int32)
    inputs = stem_indexer.stem_inputs(q, k, v, stem_block_size=BS, stem_stride=STRIDE, q_lens=ql,
                                      kv_lens=ql, scale=scale / STRIDE)
    idx, lengths = stem_indexer.stem_indexer(inputs.qflat, inputs.kflat, inputs.vbias,
                                             inputs.q_seq_lens, inputs.kv_seq_lens)
    return sorted_lists(idx, lengths)


def synthetic_selection(batch, hq, lens, target, gen):
    """Sink (4) + window (4) + random picks with one probability chosen so that
    about ``target`` of the visible block pairs are listed."""
    qmax = math.ceil(max(lens) / BS)
    i = torch.arange(qmax)
    fixed = torch.minimum(i + 1, torch.tensor(8))
    middle = (i + 1 - fixed).clamp(min=0)
    p = float(((target * (i + 1) - fixed).sum() / middle.sum().clamp(min=1)).clamp(0, 1))
    j = torch.arange(qmax)
    keep = torch.rand(batch, hq, qmax, qmax, generator=gen) < p
    keep |= (j < 4) | (j[None, :] > i[:, None] - 4)
    keep &= j[None, :] <= i[:, None]
    nb = torch.tensor([math.ceil(n / BS) for n in lens])
    keep &= (i[None, :] < nb[:, None])[:, None, :, None]
    blocks = torch.where(keep, j, qmax).sort(-1).values
    return sorted_lists(torch.where(blocks < qmax, blocks, -1), keep.sum(-1))


def density(lengths, lens, hq) -> float:
    visible = sum(hq * nb * (nb + 1) // 2 for nb in (math.ceil(n / BS) for n in lens))
    listed = sum(int(lengths[b, :, :math.ceil(n / BS)].sum()) for b, n in enumerate(lens))
    return listed / visible


def row_error(q, k, v, out, idx, lengths, lens, scale, rows, gen) -> float:
    """Max |out - float64 reference| over sampled rows (b, h, i)."""
    group = q.shape[1] // k.shape[1]
    err = 0.0
    for _ in range(rows):
        b = int(torch.randint(len(lens), (1,), generator=gen))
        h = int(torch.randint(q.shape[1], (1,), generator=gen))
        n = lens[b]
        i = int(torch.randint(math.ceil(n / BS), (1,), generator=gen))
        allowed = torch.zeros(n, dtype=torch.bool)
        for blk in idx[b, h, i, :int(lengths[b, h, i])].tolist():
            allowed[blk * BS:(blk + 1) * BS] = True
        t = torch.arange(i * BS, min((i + 1) * BS, n))
        mask = allowed[None, :] & (torch.arange(n)[None, :] <= t[:, None])
        s = (q[b, h, t].double() @ k[b, h // group, :n].double().T) * scale
        p = torch.softmax(s.masked_fill(~mask, -math.inf), dim=-1).nan_to_num(0.0)
        ref = p @ v[b, h // group, :n].double()
        err = max(err, (out[b, h, t].double() - ref).abs().max().item())
    return err


def make_inputs(cfg: Config, gen):
    hq, hkv = HEADS[cfg.heads]
    shape = (cfg.batch, hq, cfg.seq, cfg.dim)
    q = torch.randn(shape, generator=gen)
    k = torch.randn(cfg.batch, hkv, cfg.seq, cfg.dim, generator=gen)
    v = torch.randn(cfg.batch, hkv, cfg.seq, cfg.dim, generator=gen)
    dt = DTYPES[cfg.dtype]
    return q.to(dt), k.to(dt), v.to(dt)


def timed(fn):
    """Wall and process CPU seconds of fn(), and its result."""
    t0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - t0, time.process_time() - c0, result


def paired_e(times: dict, name: str, dens: float) -> float:
    """E from the runs of one repetition (adjacent in time), median over
    repetitions: slow drift in the machine's load cancels in each ratio."""
    return statistics.median(d / s for d, s in zip(times["dense"], times[name])) * dens


def run_config(cfg: Config, args) -> str:
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_inputs(cfg, gen)
    hq, hkv = HEADS[cfg.heads]
    lens, scale = cfg.lengths(), cfg.dim ** -0.5
    if cfg.selection == "stem":
        idx, lengths = stem_selection(q, k, v, lens, scale)
    else:
        idx, lengths = synthetic_selection(cfg.batch, hq, lens, int(cfg.selection[5:]) / 100, gen)
    dens = density(lengths, lens, hq)
    ql = torch.tensor(lens)

    def dense():
        for b, n in enumerate(lens):
            F.scaled_dot_product_attention(q[b:b + 1, :, :n], k[b:b + 1, :, :n],
                                           v[b:b + 1, :, :n], is_causal=True,
                                           enable_gqa=hq != hkv)

    fns = {"dense": dense,
           "kernel": lambda: sa.sparse_attention(q, k, v, idx, lengths, ql, ql, BS, True, scale)}
    if not args.no_gather:
        fns["gather"] = lambda: block_sparse_attention(q, k, v, idx, lengths, stem_block_size=BS,
                                                       causal=True, q_lens=ql, kv_lens=ql,
                                                       backend="gather")
    wall, cpu = {name: [] for name in fns}, {name: [] for name in fns}
    outs = {}
    for _ in range(args.reps):
        for name, fn in fns.items():
            t, c, outs[name] = timed(fn)
            wall[name].append(t)
            cpu[name].append(c)
    ms = {name: statistics.median(ts) * 1e3 for name, ts in wall.items()}
    err = {name: row_error(q, k, v, outs[name], idx, lengths, lens, scale, args.check_rows,
                           torch.Generator().manual_seed(1))
           for name in ("kernel", "gather") if name in outs}
    e = {name: paired_e(wall, name, dens) for name in ("kernel", "gather") if name in ms}
    e_cpu = paired_e(cpu, "kernel", dens)
    gather = (f"{ms['gather']:.0f} | {e['gather']:.2f} | {err['gather']:.1e}"
              if "gather" in ms else "- | - | -")
    return (f"| {cfg} | {dens:.1%} | {ms['dense']:.0f} | {ms['kernel']:.0f} | "
            f"**{e['kernel']:.2f}** | {e_cpu:.2f} | {err['kernel']:.1e} | {gather} |")


def configs(args) -> list[Config]:
    if not args.full:
        return QUICK
    axes = (args.seqs, args.heads, args.dims, args.batches, args.dtypes, args.selections)
    return [Config(*combo) for combo in itertools.product(*axes)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="the sweep over the axes below")
    ap.add_argument("--seqs", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4], choices=[1, 4])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--selections", nargs="+", default=["stem", "synth25", "synth50"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check-rows", type=int, default=8)
    ap.add_argument("--no-gather", action="store_true", help="skip the torch baseline")
    args = ap.parse_args()
    if not sa.available():
        raise SystemExit(f"kernel unavailable: {sa.status()}")
    bf16 = ("brgemm (torch's micro-kernel)" if torch_blas.bf16_brgemm()[0] is not None
            else "widen (sgemm)")
    print(f"machine: {machine()}; threads {torch.get_num_threads()}; torch {torch.__version__}; "
          f"git {git_sha()}; bf16 path: {bf16}; load average at start "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    print("| config | density | dense ms | kernel ms | E kernel | E kernel (CPU time) "
          "| err kernel | gather ms | E gather | err gather |")
    print("|" + "---|" * 10, flush=True)
    for cfg in configs(args):
        print(run_config(cfg, args), flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
