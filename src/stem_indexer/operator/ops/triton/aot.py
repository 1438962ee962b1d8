"""Ahead-of-time report: every kernel the launcher would compile, compiled for
an NVIDIA target without a GPU, with its register and spill figures.

    python -m stem_indexer.operator.ops.triton.aot --arch 90 --arch 80 [--json]
    python -m stem_indexer.operator.ops.triton.aot --arch 90 --shape prefill --df 2048 --jobs 1

For each benchmark shape (``SHAPES``), Df and precision, the launcher's own
``default_config`` and ``kernel_launches`` produce the launches on ``meta``
tensors, and with them (Df 2048: head dim 128, bfloat16, 16-token pages) the
paged entry point's ``kflat_kernel`` and ``paged_attention_kernel``
(``paged_index.py``, ``paged_attention.py``; the latter also with one page
per block, as ``backend="triton"`` runs it) and the indexer cache's device
writer (``index_write.py``); the arguments have the
benchmark's sizes and no memory. Triton's own argument binder turns each
launch into the signature, constants, attributes and options its JIT would
compile, and ``triton.compile`` builds that for ``GPUTarget("cuda", arch,
32)``. ``cuobjdump`` (shipped with Triton) then reads the cubin: registers
and stack bytes per thread (``-res-usage``), and in the SASS the local-
memory spill stores/loads (STL/LDL) and the tensor-core MMA instructions
(HMMA, or HGMMA on sm_90). Identical compiles are made once; ``shape`` lists
every case each one serves.

Compiles go through Triton's own cache (``TRITON_CACHE_DIR``, by default
under ``~/.triton``), whose key covers the kernel's source, constants,
options, target and Triton's version: a changed kernel is compiled anew, an
unchanged one is read back. ``--shape`` and ``--df`` narrow the report. The
kernels must be jitted for the GPU: run this without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from ... import metadata as md
from ...contract import IndexerParams
from . import index_write, launch, paged_attention, paged_index

# SM count of each target's reference GPU (it sets the persistent grid, an argument).
REFERENCE_SMS = {80: 108, 90: 132}  # A100, H100/H200 SXM
DFS = (128, 2048)
PRECISIONS = (1, 2)


@dataclass(frozen=True)
class Shape:
    """A benchmark shape: batch, heads and tokens (blocks of 128 tokens)."""

    name: str
    batch: int
    q_heads: int
    kv_heads: int
    q_tokens: int
    kv_tokens: int
    block: int = 128


SHAPES = (
    # The example of the Ascend operator's documentation.
    Shape("example B4 Nq64 Nk8 q2K kv8K", 4, 64, 8, 16 * 128, 64 * 128),
    Shape("prefill B8 Nq64 Nk8 q=kv=128K", 8, 64, 8, 1 << 17, 1 << 17),
    Shape("chunk B1 Nq32 Nk8 q8K kv1M", 1, 32, 8, 1 << 13, 1 << 20),
)


def _launches(shape: Shape, df: int, precision: int, arch: int) -> list[launch.Launch]:
    """The launcher's launches for ``shape`` on a GPU of ``arch``, on meta tensors."""
    meta = dict(device="meta")
    b, nq, nk = shape.batch, shape.q_heads, shape.kv_heads
    qmax, kmax = shape.q_tokens // shape.block, shape.kv_tokens // shape.block
    params = IndexerParams(stem_block_size=shape.block, topk_score_precision=precision)
    lens = torch.empty(b, dtype=torch.int32, **meta)
    cfg = launch.default_config(nq // nk, qmax, kmax, df, arch=arch, sms=REFERENCE_SMS[arch])
    return launch.kernel_launches(
        torch.empty(b, nq, qmax, df, dtype=torch.bfloat16, **meta),
        torch.empty(b, nk, kmax, df, dtype=torch.bfloat16, **meta),
        torch.empty(b, nk, kmax, dtype=torch.float32, **meta), lens, lens, lens,
        torch.empty(md.metadata_size(b, nk), dtype=torch.int32, **meta), params, cfg,
        torch.empty(b, nq, qmax, kmax, dtype=torch.int32, **meta),
        torch.empty(b, nq, qmax, dtype=torch.int32, **meta))


PAGE = 16  # vLLM's default page size on CUDA


def _paged_launches(shape: Shape, df: int, arch: int) -> list[launch.Launch]:
    """The paged entry point's launches for ``shape`` (head dim ``df / 16``:
    Df 2048 only, the realistic head dim 128), bfloat16, ``PAGE``-token pages."""
    if df != 2048:
        return []
    meta = dict(device="meta")
    stride, dim = 16, df // 16
    b, nq, nk = shape.batch, shape.q_heads, shape.kv_heads
    qmax, kmax = shape.q_tokens // shape.block, shape.kv_tokens // shape.block
    pages = b * shape.kv_tokens // PAGE
    i32 = dict(dtype=torch.int32, **meta)
    table = torch.empty(b, shape.kv_tokens // PAGE, **i32)
    kflat = paged_index.kflat_launch(
        torch.empty(pages, stride, nk, dim, dtype=torch.float32, **meta), table,
        torch.empty(b, **i32), torch.empty(b, nk, kmax, df, dtype=torch.int16, **meta),
        shape.block, PAGE)
    query = torch.empty(b * shape.q_tokens, nq, dim, dtype=torch.bfloat16, **meta)
    cfg = paged_attention.default_paged_config(shape.block, dim, torch.bfloat16, arch)
    attention = []
    # 16-token pages (the paged entry point), and one page per block
    # (block_sparse_attention's backend="triton" on contiguous tensors).
    for page in (PAGE, shape.block):
        cache = torch.empty(b * shape.kv_tokens // page, page, nk, dim, dtype=torch.bfloat16,
                            **meta)
        attention.append(paged_attention.paged_launch(
            query, cache, cache, torch.empty(b, shape.kv_tokens // page, **i32),
            torch.empty(b, nq, qmax, kmax, **i32), torch.empty(b, nq, qmax, **i32),
            torch.empty(b, 4, **i32), torch.empty_like(query), block_size=shape.block,
            scale=dim ** -0.5, softcap=None, config=cfg))
    write = index_write.index_write_launch(
        torch.empty(pages, stride, nk, dim, dtype=torch.float32, **meta),
        torch.empty(pages, PAGE // stride, nk, dtype=torch.float32, **meta),
        torch.empty(pages, **i32), torch.empty(pages, dtype=torch.int64, **meta), PAGE,
        torch.empty(b * shape.q_tokens, nk, dim, dtype=torch.bfloat16, **meta),
        torch.empty(b * shape.q_tokens, nk, dtype=torch.float32, **meta),
        torch.empty(b * shape.q_tokens, dtype=torch.int64, **meta),
        torch.empty(b * shape.q_tokens, dtype=torch.int64, **meta))
    return [kflat, *attention, write]


def _compile_inputs(run: launch.Launch, arch: int) -> dict:
    """What Triton's JIT would compile for this launch: Triton's binder and
    argument packing, as ``JITFunction.run`` calls them."""
    fn = run.kernel
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(run.constexprs, **run.options)
    bound, specialization, opts = binder(*run.args, **kwargs)
    _, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, opts)
    names = list(signature)
    return {
        "kernel": f"{fn.fn.__module__}:{fn.__name__}",
        "signature": signature,
        "constexprs": {names[k[0]]: v for k, v in constexprs.items()},
        "attrs": {names[k[0]]: v for k, v in attrs.items()},
        "options": run.options,
    }


def _resource_usage(cubin: bytes, workdir: str) -> dict:
    path = os.path.join(workdir, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    tool = triton.knobs.nvidia.cuobjdump.path
    sass = subprocess.run([tool, "-res-usage", "-sass", path], check=True,  # one pass: both
                          capture_output=True, text=True).stdout
    figures = re.search(r"REG:(\d+) STACK:(\d+)", sass)
    return {
        "regs": int(figures.group(1)),
        "stack_bytes": int(figures.group(2)),
        "spill_stores": len(re.findall(r"\bSTL(?:\.\w+)*\s", sass)),
        "spill_loads": len(re.findall(r"\bLDL(?:\.\w+)*\s", sass)),
        "mma": len(re.findall(r"\bH(?:G)?MMA\.", sass)),
    }


def compile_entry(entry: dict) -> dict:
    """Compile one report entry for its target and add the cubin's figures."""
    module, name = entry["kernel"].split(":")
    fn = getattr(sys.modules.get(module) or __import__(module, fromlist=[name]), name)
    names = list(entry["signature"])
    source = ASTSource(fn, entry["signature"], entry["constexprs"],
                       {(names.index(k),): v for k, v in entry["attrs"].items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", entry["arch"], 32),
                              options=entry["options"])
    with tempfile.TemporaryDirectory() as tmp:
        return dict(entry, shared_bytes=compiled.metadata.shared,
                    **_resource_usage(compiled.asm["cubin"], tmp))


def shape_key(shape: Shape) -> str:
    """The short name ``--shape`` takes: the first word of the shape's name."""
    return shape.name.split()[0]


def report_entries(archs, shapes=SHAPES, dfs=DFS) -> list[dict]:
    """The uncompiled report: one entry per distinct compile, with its shapes."""
    entries: dict[str, dict] = {}
    for arch in archs:
        for shape in shapes:
            for df in dfs:
                for precision in PRECISIONS:
                    case = f"{shape.name} Df{df} p{precision}"
                    runs = _launches(shape, df, precision, arch)
                    runs += _paged_launches(shape, df, arch)
                    for run in runs:
                        entry = dict(_compile_inputs(run, arch), arch=arch, target=f"sm_{arch}")
                        key = json.dumps(entry, sort_keys=True, default=str)
                        entries.setdefault(key, dict(entry, shape=[]))["shape"].append(case)
    return list(entries.values())


def build_report(archs, jobs: int | None = None, shapes=SHAPES, dfs=DFS) -> list[dict]:
    """Every distinct compile of ``shapes`` x ``dfs`` for ``archs``, with figures."""
    if launch.INTERPRETED:
        raise SystemExit("aot: the kernels are interpreted (TRITON_INTERPRET=1); unset it")
    entries = report_entries(archs, shapes, dfs)
    workers = jobs or min(len(entries), os.cpu_count() or 1)
    if workers <= 1:
        return [compile_entry(entry) for entry in entries]
    # More than one: fresh processes (spawned: forking a process that has
    # imported torch is not safe).
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(compile_entry, entries))


def format_table(report: list[dict]) -> str:
    """The report as a Markdown table (constants that are False, options that
    are defaults or the same for every launch left out)."""
    rows = ["| kernel | target | constants | options | regs | stack bytes | STL / LDL "
            "| MMA | serves |", "|---|---|---|---|---|---|---|---|---|"]
    for e in report:
        consts = " ".join(f"{k}={v}" for k, v in e["constexprs"].items() if v is not False)
        opts = " ".join(f"{k}={v}" for k, v in e["options"].items()
                        if v is not None and k != "enable_fp_fusion")
        rows.append(f"| `{e['kernel'].split(':')[1]}` | {e['target']} | {consts} | {opts} | "
                    f"{e['regs']} | {e['stack_bytes']} | {e['spill_stores']} / "
                    f"{e['spill_loads']} | {e['mma']} | {'; '.join(e['shape'])} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", choices=sorted(REFERENCE_SMS),
                        help="target compute capability (repeatable; default: 90 and 80)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--shape", action="append", choices=[shape_key(s) for s in SHAPES],
                        help="benchmark shape (repeatable; default: all)")
    parser.add_argument("--df", type=int, action="append", choices=DFS,
                        help="Df (repeatable; default: all)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="compile processes (1: compile in this process)")
    args = parser.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs must be >= 1; got {args.jobs}")
    shapes = [s for s in SHAPES if args.shape is None or shape_key(s) in args.shape]
    report = build_report(args.arch or (90, 80), args.jobs, shapes, args.df or DFS)
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
