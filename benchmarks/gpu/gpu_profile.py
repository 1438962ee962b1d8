"""Where one eager call spends its time on a GPU: the indexer op at 128K
(B=8, Nq=64, Nk=8, Df=2048) and ``stem_attention`` at 64K (B=1, Hq=32,
Hkv=8, D=128, bf16), each profiled once after a warm-up call.

    python benchmarks/gpu/gpu_profile.py           # tables to stdout and $OUT/gpu_profile.md
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import stem_indexer
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # noqa: F401  (every area's folder on sys.path)
from common import git_sha, machine, write_atomic
from gpu_check import BENCHES, _metadata, bench_inputs, run_op
from stem_indexer.operator.contract import IndexerParams


def _table(fn, title: str) -> str:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14)
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10)
    return f"## {title}\n\n```\n{table}\n{host}\n```\n"


def _indexer() -> str:
    bench = BENCHES[0]
    params = IndexerParams(stem_block_size=bench.block, stem_stride=bench.stride)
    inputs = bench_inputs(bench, "cuda")
    md = _metadata(inputs, bench.q_heads, bench.kv_heads, params, bench.dim)
    return _table(lambda: run_op(inputs, md, params), f"indexer op, eager: {bench.name}")


def _attention() -> str:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, 65536, 128, device="cuda", generator=gen,
                           dtype=torch.bfloat16) for h in (32, 8, 8))
    return _table(lambda: stem_indexer.stem_attention(q, k, v, exact_tail=0),
                  "stem_attention, eager: B=1 Hq=32 Hkv=8 S=64K D=128 bf16")


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    parts = [f"# GPU profile ({machine('cuda')}, git {git_sha()})\n", _indexer()]
    torch.cuda.empty_cache()
    parts.append(_attention())
    text = "\n".join(parts)
    print(text)
    write_atomic(Path(os.environ.get("OUT", "./out")) / "gpu_profile.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
