"""Which Triton kernel, under which configuration, disagrees with the CPU path on
the gpu_check shapes (float data, Df 2048): the op's rows of batch 0 and the
query heads of KV head 0 against the CPU path on that part alone, for the
default configuration and variants (pointer loads, radix selection for every
row), on random float inputs and on integer-valued ones (exact scores: any
difference is then a logic error, not rounding).

    python benchmarks/gpu/gpu_triton_diagnose.py  # table to stdout and $OUT/gpu_triton_diagnose.md
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # noqa: F401  (every area's folder on sys.path)
from common import git_sha, machine, write_atomic
from gpu_check import BENCHES, _config, _metadata, bench_inputs, run_cpu_path
from stem_indexer.operator.contract import IndexerParams
from stem_indexer.operator.ops.triton import launch
from stem_indexer.testing import compare

VARIANTS = {"default": {}, "pointer loads": dict(tma=False, score_maxnreg=None),
            "radix for every row": dict(block_c=16)}


def _diagnose(bench, integer: bool, lines: list[str]) -> None:
    params = IndexerParams(stem_block_size=bench.block, stem_stride=bench.stride)
    inputs = bench_inputs(bench, "cuda")
    if integer:
        for name in ("qflat", "kflat"):
            inputs[name] = inputs[name].float().mul(2).round().clamp(-3, 3).to(torch.bfloat16)
        inputs["vbias"] = (inputs["vbias"] * 640).round() / 64
    g = bench.q_heads // bench.kv_heads
    part = {"qflat": inputs["qflat"][:1, :g], "kflat": inputs["kflat"][:1, :1],
            "vbias": inputs["vbias"][:1, :1], "q_seq_lens": inputs["q_seq_lens"][:1],
            "kv_seq_lens": inputs["kv_seq_lens"][:1]}
    part_cpu = {k: v.cpu() for k, v in part.items()}
    want = run_cpu_path({**part_cpu, "num_prompt_tokens": None},
                        _metadata(part_cpu, g, 1, params, bench.dim), params)
    md = _metadata(inputs, bench.q_heads, bench.kv_heads, params, bench.dim)
    for name, changes in VARIANTS.items():
        cfg = _config(bench, "cuda", **changes)
        out = launch.stem_indexer_triton(*(inputs[k] for k in ("qflat", "kflat", "vbias",
                                                               "q_seq_lens", "kv_seq_lens")),
                                         None, md, params, config=cfg)
        mine = tuple(t[:1, :g].cpu() for t in out)
        same = all(torch.equal(a, b) for a, b in zip(mine, want))
        verdict = compare.compare(mine, want, part_cpu, params)
        lines.append(f"| {bench.name} | {'integer' if integer else 'float'} | {name} | "
                     f"{'identical' if same else 'differs'} | {verdict.summary()} |")
        print(lines[-1], flush=True)


def main() -> int:
    lines = [f"# Triton vs CPU path ({machine('cuda')}, git {git_sha()})", "",
             "| shape | data | configuration | outputs | CONTRACT.md section 5 comparison |",
             "|---|---|---|---|---|"]
    for bench in reversed(BENCHES):  # the 1M-token chunk first: it disagreed most
        for integer in (False, True):
            _diagnose(bench, integer, lines)
        torch.cuda.empty_cache()
    write_atomic(Path(os.environ.get("OUT", "./out")) / "gpu_triton_diagnose.md",
                 "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main() if torch.cuda.is_available() else 2)
