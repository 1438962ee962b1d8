"""FlexAttention kernel options for Stem's selections on a GPU: the same
selection (the indexer's, default budget) timed under each option set, with
dense SDPA as the baseline, at 64K and 128K tokens (B=1, Hq=32, Hkv=8, D=128,
bf16). The fastest set becomes ``ops.flex_attention.CUDA_KERNEL_OPTIONS``.

    python benchmarks/gpu/gpu_flex_tune.py        # table to stdout and $OUT/gpu_flex_tune.md
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import stem_indexer
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # noqa: F401  (every area's folder on sys.path)
from common import git_sha, machine, median_ms, write_atomic
from stem_indexer.operator.ops import flex_attention as flex

OPTIONS = {
    "defaults": None,
    "M128 N128 w8 s2": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    "M128 N64 w8 s3": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    "M128 N64 w4 s3": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    "TMA": dict(USE_TMA=True),
    "TMA M128 N128 w8 s2": dict(USE_TMA=True, BLOCK_M=128, BLOCK_N=128, num_warps=8,
                                num_stages=2),
}


def main() -> int:
    lines = [f"# FlexAttention kernel options ({machine('cuda')}, git {git_sha()})", "",
             "| tokens | density | dense SDPA ms | " + " | ".join(OPTIONS) + " |",
             "|---|---|---|" + "---|" * len(OPTIONS)]
    for seq in (131072, 65536):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, h, seq, 128, device="cuda", generator=gen,
                               dtype=torch.bfloat16) for h in (32, 8, 8))
        inp = stem_indexer.stem_inputs(q, k, v, scale=128 ** -0.5 / 16)
        idx, lens = stem_indexer.stem_indexer(*inp)
        nb = seq // 128
        density = float(lens.sum()) / (32 * nb * (nb + 1) / 2)
        mask = flex.block_mask(idx, lens, block_size=128, q_len=seq, kv_len=seq)
        dense = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                 enable_gqa=True),
                          device="cuda", reps=5)
        row = [f"{seq}", f"{density:.1%}", f"{dense:.2f}"]
        for opts in OPTIONS.values():
            try:
                ms = median_ms(lambda: flex.flex_attention_forward(
                    q, k, v, mask, 128 ** -0.5, kernel_options=opts), device="cuda", reps=5)
                row.append(f"{ms:.2f} ({dense / ms:.2f}x)")
            except Exception as exc:  # noqa: BLE001 - an option set this GPU refuses
                row.append(f"error: {type(exc).__name__}")
            print(" | ".join(row), flush=True)
        lines.append("| " + " | ".join(row) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_atomic(Path(os.environ.get("OUT", "./out")) / "gpu_flex_tune.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(0 if torch.cuda.is_available() and main() == 0 else 2)
