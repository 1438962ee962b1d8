"""GPU timing of Stem sparse prefill against dense attention (one H200).

For B=1, Hq=32, Hkv=8, D=128, causal prefill of 64K and 128K tokens (bf16):

* ``dense``: ``scaled_dot_product_attention(is_causal=True)`` (flash);
* ``sparse``: ``block_sparse_attention`` on the indexer's selection (the
  FlexAttention backend), its density, and the indexer's own time
  (``stem_inputs`` + metadata + indexer);
* ``stem_attention``: the whole one-call path.

Correctness first: on 8 sampled query blocks the sparse output is compared
with dense attention restricted to the same blocks (float32 reference).
Target: sparse >= 3x faster than dense at 128K. Times are medians of CUDA-event
measurements after warm-up. The table goes to stdout and ``$OUT/gpu_attention.md``
(``$OUT`` defaults to ./out). ``--dry-run`` runs tiny shapes on CPU so the
script can be checked anywhere (its timings then mean nothing).

    python benchmarks/gpu_attention.py            # on the GPU (about 2 minutes)
    python benchmarks/gpu_attention.py --dry-run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

import stem_indexer
from common import git_sha, interleaved_runs, machine, write_atomic
from stem_indexer import contract
from stem_indexer.attention import block_sparse_attention


def _masked_reference(q, k, v, idx, lens, rows, bs, scale):
    """float32 dense attention of sampled query blocks over their listed blocks."""
    out = {}
    hq, hkv = q.shape[1], k.shape[1]
    seq = q.shape[2]
    for h, i in rows:
        n = h // (hq // hkv)
        blocks = idx[0, h, i, :int(lens[0, h, i])].tolist()
        cols = torch.cat([torch.arange(j * bs, min((j + 1) * bs, seq)) for j in blocks])
        qi = q[0, h, i * bs:(i + 1) * bs].float()
        kj, vj = k[0, n, cols].float(), v[0, n, cols].float()
        s = (qi @ kj.T) * scale
        t = torch.arange(i * bs, i * bs + qi.shape[0], device=q.device)
        s = s.masked_fill(cols.to(q.device)[None, :] > t[:, None], float("-inf"))
        out[(h, i)] = torch.softmax(s, -1) @ vj
    return out


def run(seq: int, device: str, reps: int, lines: list[str]) -> bool:
    torch.manual_seed(0)
    hq, hkv, d, bs = (32, 8, 128, 128) if device == "cuda" else (4, 2, 32, 32)
    dtype = torch.bfloat16
    q = torch.randn(1, hq, seq, d, device=device, dtype=dtype)
    k = torch.randn(1, hkv, seq, d, device=device, dtype=dtype)
    v = torch.randn(1, hkv, seq, d, device=device, dtype=dtype)
    scale = d ** -0.5
    stride = 16 if bs == 128 else 8

    def indexer():
        inp = stem_indexer.stem_inputs(q, k, v, stem_block_size=bs, stem_stride=stride,
                                       scale=scale / stride)
        return inp, stem_indexer.stem_indexer(inp.qflat, inp.kflat, inp.vbias, inp.q_seq_lens,
                                              inp.kv_seq_lens, stem_block_size=bs,
                                              stem_stride=stride)

    inp, (idx, lens) = indexer()
    nb = -(-seq // bs)
    visible = int(contract.visible_blocks(torch.arange(nb), nb, nb, True).sum()) * hq
    density = float(lens.sum()) / visible

    def sparse():
        return block_sparse_attention(q, k, v, idx, lens, stem_block_size=bs, scale=scale)

    def dense():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                scale=scale, enable_gqa=True)

    def one_call():
        return stem_indexer.stem_attention(q, k, v, stem_block_size=bs, stem_stride=stride,
                                           scale=scale, exact_tail=0)  # the indexer's lists

    got = sparse()
    gen = torch.Generator().manual_seed(1)
    rows = [(int(torch.randint(hq, (1,), generator=gen)),
             int(torch.randint(nb, (1,), generator=gen))) for _ in range(8)]
    ref = _masked_reference(q, k, v, idx.cpu(), lens.cpu(), rows, bs, scale)
    err = max(float((got[0, h, i * bs:(i + 1) * bs].float() - r).abs().max())
              for (h, i), r in ref.items())
    ok_check = err < 2e-2
    runs = interleaved_runs({"dense": dense, "sparse": sparse, "indexer": indexer,
                             "call": one_call}, device=device, reps=reps)
    t_dense, t_sparse, t_index, t_call = (statistics.median(runs[n])
                                          for n in ("dense", "sparse", "indexer", "call"))
    speedup = t_dense / t_sparse
    efficiency = t_dense * density / t_sparse
    target = seq < 131072 or device != "cuda" or speedup >= 3.0

    def spread(name):  # dense / name per turn: [min, max]
        turns = [d / x for d, x in zip(runs["dense"], runs[name])]
        return f"[{min(turns):.2f}, {max(turns):.2f}]"
    lines.append(f"| {seq} | {density:.1%} | {t_index:.2f} | {t_sparse:.2f} | {t_dense:.2f} "
                 f"| {speedup:.2f}x {spread('sparse')} | {efficiency:.2f} | {t_call:.2f} "
                 f"| {t_dense / t_call:.2f}x {spread('call')} "
                 f"| {err:.1e} | {'ok' if ok_check else 'FAIL'} |")
    print(lines[-1], flush=True)
    return ok_check and target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --dry-run", file=sys.stderr)
        return 2
    lines = [f"# Stem sparse prefill vs dense attention ({machine(device)})", "",
             f"git {git_sha()}, bf16, B=1, causal; times in ms (medians of {args.reps} "
             "turns, the four calls alternating); speed-ups with [min, max] over the turns; "
             "E = dense x density / sparse", "",
             "| tokens | density | indexer | sparse attn | dense SDPA | dense/sparse | E "
             "| stem_attention | dense/stem_attention | max err | check |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    seqs = (65536, 131072) if device == "cuda" else (1024, 2048)
    ok = all([run(seq, device, args.reps if device == "cuda" else 1, lines) for seq in seqs])
    write_atomic(Path(os.environ.get("OUT", "./out")) / "gpu_attention.md",
                 "\n".join(lines) + "\n")
    print("targets met" if ok else "TARGET MISSED or check failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
