"""GPU check of the Triton path: correctness, speed against a baseline and the
roofline, CUDA-graph capture. One H200, under five minutes.

1. Correctness: a subset of the case table (128K and 1M-token kv included)
   on the GPU against the CPU path on the same inputs, judged like the runner
   (SPEC section 5; integer-data cases must be identical).
2. Speed, each timed as the median of CUDA-event measurements after warm-up:
   the op replayed from a CUDA graph (no host checks), the eager op (with its
   host-side value checks), and a torch composite on the GPU -- the
   device-agnostic torch path (``ops/cpu.py``: batched matmul, mask, top-k,
   chunked by the metadata's tiles) -- on
   * B=8, Nq=64, Nk=8, Df=2048, Bs=128, causal q = kv = 128K tokens;
   * B=1, Nq=32, Nk=8, Df=2048, Bs=128, q = 8K tokens at the end of kv = 1M.
   The roofline is max(GEMM FLOPs of the visible pairs at 790 TFLOP/s, output
   bytes at 4.3 TB/s). Targets: >= 5x the composite, <= 2x the roofline.
3. CUDA graphs: ``torch.compile(mode="reduce-overhead")`` of the op replays
   with results identical to eager.

``--dry-run`` runs the same logic on CPU tensors with tiny shapes and the
Triton interpreter (no GPU needed), so the script itself can be checked
anywhere. The table goes to stdout and to ``$OUT/gpu_check.md`` (``$OUT``
defaults to ./out), with the machine, versions and git sha.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import stem_indexer  # noqa: F401  (registers the ops)
from stem_indexer import cases, compare
from stem_indexer.contract import IndexerParams
from stem_indexer.ops import library

PEAK_FLOPS = 790e12
PEAK_BYTES = 4.3e12
CORRECTNESS_CASES = ("SI_WB_001", "SI_WB_003", "SI_WB_103", "SI_WB_013", "SI_WB_024",
                     "SI_WB_045", "SI_WB_059", "SI_WB_061", "SI_WB_161", "SI_WB_062",
                     "SI_WB_077", "SI_WB_094", "SI_WB_097", "SI_WB_098")
DRY_CASES = ("SI_WB_003", "SI_WB_012", "SI_WB_113")


@dataclasses.dataclass
class Bench:
    name: str
    batch: int
    q_heads: int
    kv_heads: int
    dim: int
    q_tokens: int
    kv_tokens: int
    block: int = 128
    stride: int = 16


BENCHES = [
    Bench("prefill 128K causal", 8, 64, 8, 2048, 1 << 17, 1 << 17),
    Bench("chunk 8K over 1M", 1, 32, 8, 2048, 1 << 13, 1 << 20),
]
DRY_BENCHES = [
    Bench("prefill (dry)", 2, 4, 2, 32, 16 * 8, 16 * 8, block=16, stride=4),
    Bench("chunk (dry)", 1, 4, 2, 32, 16 * 2, 16 * 100, block=16, stride=4),
]


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except Exception:
        return "unknown"


def _versions(device: str) -> str:
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "not installed"
    machine = (torch.cuda.get_device_name() if device == "cuda"
               else f"{platform.machine()} CPU ({os.cpu_count()} cores)")
    return (f"machine: {machine}; torch {torch.__version__}; triton {tv}; "
            f"git {_git_sha()}; python {platform.python_version()}")


def _metadata(inputs: dict, q_heads: int, kv_heads: int, params: IndexerParams, dim: int):
    return torch.ops.custom.npu_stem_indexer_metadata(
        inputs["q_seq_lens"], inputs["kv_seq_lens"], q_heads, kv_heads, causal=params.causal,
        stem_block_size=params.stem_block_size, dim_qkflat=dim, window_size=params.window_size)


def _args(inputs: dict):
    return [inputs[k] for k in ("qflat", "kflat", "vbias", "q_seq_lens", "kv_seq_lens")]


def run_op(inputs: dict, md, params: IndexerParams, device: str):
    """The CUDA op (Triton); on CPU the Triton launcher under the interpreter."""
    attrs = dataclasses.asdict(params)
    if device == "cuda":
        return torch.ops.custom.npu_stem_indexer(
            *_args(inputs), num_prompt_tokens=inputs["num_prompt_tokens"], metadata=md, **attrs)
    from stem_indexer.ops.triton.launch import stem_indexer_triton
    return stem_indexer_triton(*_args(inputs), inputs["num_prompt_tokens"], md, params)


def run_composite(inputs: dict, md, params: IndexerParams):
    """The device-agnostic torch path (the op's CPU kernel) on the inputs' device."""
    return library._indexer_kernel(*_args(inputs), num_prompt_tokens=inputs["num_prompt_tokens"],
                                   metadata=md, **dataclasses.asdict(params))


def _time_ms(fn, device: str, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def check_correctness(device: str, case_ids, lines: list[str]) -> bool:
    ok_all = True
    lines += ["", "## Correctness (GPU vs the CPU path, SPEC section 5)", "",
              "| case | result | seconds |", "|---|---|---|"]
    for cid in case_ids:
        case = cases.get_case(cid)
        raw = case.make_inputs()
        md = _metadata(raw, case.q_heads, case.kv_heads, case.params, case.dim)
        expected = run_composite(raw, md, case.params)
        dev = {k: (v.to(device) if v is not None else None) for k, v in raw.items()}
        t0 = time.perf_counter()
        try:
            out = run_op(dev, md.to(device), case.params, device)
            out = tuple(t.cpu() for t in out)
            result = compare.compare(out, expected, raw, case.params)
            ok = result.ok
            text = result.summary()
            if case.data == "integer" and not all(torch.equal(a, e) for a, e in zip(out, expected)):
                ok, text = False, text + "; FAIL: integer data must be identical"
        except Exception as exc:  # reported, the check goes on
            ok, text = False, f"ERROR {type(exc).__name__}: {exc}"
        ok_all &= ok
        lines.append(f"| {case.label} | {'PASS' if ok else 'FAIL'}: {text[:160]} | "
                     f"{time.perf_counter() - t0:.2f} |")
        print(lines[-1], flush=True)
    return ok_all


def bench_inputs(bench: Bench, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    qb, kb = bench.q_tokens // bench.block, bench.kv_tokens // bench.block
    b, nq, nk, df = bench.batch, bench.q_heads, bench.kv_heads, bench.dim
    i32 = dict(dtype=torch.int32, device=device)
    return {
        "qflat": torch.randn((b, nq, qb, df), generator=gen, device=device).to(torch.bfloat16),
        "kflat": torch.randn((b, nk, kb, df), generator=gen, device=device).to(torch.bfloat16),
        "vbias": torch.randn((b, nk, kb), generator=gen, device=device) * 0.1,
        "q_seq_lens": torch.full((b,), bench.q_tokens, **i32),
        "kv_seq_lens": torch.full((b,), bench.kv_tokens, **i32),
        "num_prompt_tokens": None,
    }


def roofline_ms(bench: Bench, inputs: dict, out) -> float:
    _, seq_len = out
    qb, kb = bench.q_tokens // bench.block, bench.kv_tokens // bench.block
    s2 = torch.arange(qb, dtype=torch.float64) + (kb - qb + 1)  # causal, right-down
    pairs = float(s2.clamp(0, kb).sum()) * bench.batch * bench.q_heads
    flops = 2.0 * bench.dim * pairs
    out_bytes = out[0].numel() * 4 + seq_len.numel() * 4
    return max(flops / PEAK_FLOPS, out_bytes / PEAK_BYTES) * 1e3


def run_benches(device: str, benches, lines: list[str], reps: int) -> bool:
    ok_all = True
    lines += ["", "## Speed (median ms)", "",
              "| shape | op (graph) | op (eager) | composite | speed-up (>= 5) | roofline | "
              "op / roofline (<= 2) | outputs equal composite |",
              "|---|---|---|---|---|---|---|---|"]
    for bench in benches:
        params = IndexerParams(stem_block_size=bench.block, stem_stride=bench.stride)
        inputs = bench_inputs(bench, device)
        md = _metadata(inputs, bench.q_heads, bench.kv_heads, params, bench.dim)
        out = run_op(inputs, md, params, device)
        composite_out = run_composite(inputs, md, params)
        # Judged on batch 0 and the query heads of KV head 0 (recomputing the
        # scores of differing rows of the whole output would take minutes).
        g = bench.q_heads // bench.kv_heads
        part = {"qflat": inputs["qflat"][:1, :g], "kflat": inputs["kflat"][:1, :1],
                "vbias": inputs["vbias"][:1, :1], "q_seq_lens": inputs["q_seq_lens"][:1],
                "kv_seq_lens": inputs["kv_seq_lens"][:1]}
        equal = compare.compare(tuple(t[:1, :g].cpu() for t in out),
                                tuple(t[:1, :g].cpu() for t in composite_out), part, params)
        del composite_out
        eager = _time_ms(lambda: run_op(inputs, md, params, device), device, reps)
        if device == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_op(inputs, md, params, device)
            replay = _time_ms(graph.replay, device, reps)
            del graph
        else:
            replay = eager
        # Seconds per call: two calls after the one above.
        composite = _time_ms(lambda: run_composite(inputs, md, params), device, 2, warmup=0)
        roof = roofline_ms(bench, inputs, out)
        speedup, ratio = composite / replay, replay / roof
        ok = speedup >= 5 and ratio <= 2 and equal.ok
        ok_all &= ok
        lines.append(f"| {bench.name}: B={bench.batch} Nq={bench.q_heads} Nk={bench.kv_heads} "
                     f"Df={bench.dim} q={bench.q_tokens} kv={bench.kv_tokens} | {replay:.3f} | "
                     f"{eager:.3f} | {composite:.3f} | {speedup:.1f}x | {roof:.3f} | "
                     f"{ratio:.2f}x | {'yes' if equal.ok else 'NO: ' + equal.summary()[:80]} |")
        print(lines[-1], flush=True)
        del out
        if device == "cuda":
            torch.cuda.empty_cache()
    return ok_all


def check_graph_capture(device: str, lines: list[str]) -> bool:
    lines += ["", "## CUDA graph capture", ""]
    if device != "cuda":
        lines.append("skipped: no CUDA device (dry run)")
        return True
    case = cases.get_case("SI_WB_079")  # integer data, GQA, mixed batch of 7
    raw = case.make_inputs("cuda")
    md = _metadata(raw, case.q_heads, case.kv_heads, case.params, case.dim)
    attrs = case.op_kwargs()

    def call(qflat, kflat, vbias, q_lens, kv_lens, metadata):
        return torch.ops.custom.npu_stem_indexer(qflat, kflat, vbias, q_lens, kv_lens,
                                                 metadata=metadata, **attrs)

    args = (*_args(raw), md)
    eager = call(*args)
    compiled = torch.compile(call, mode="reduce-overhead")
    same = True
    for _ in range(4):
        got = compiled(*args)
        same &= all(torch.equal(a, e) for a, e in zip(got, eager))
    lines.append(f"torch.compile(mode='reduce-overhead'), 4 calls (warm-up, record, replays): "
                 f"{'identical to eager' if same else 'DIFFERENT from eager'}")
    print(lines[-1], flush=True)
    return same


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on CPU under the Triton interpreter")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --dry-run", file=sys.stderr)
        return 2
    lines = ["# stem-indexer GPU check", "", _versions(device)]
    print(lines[-1], flush=True)
    ok = check_correctness(device, DRY_CASES if args.dry_run else CORRECTNESS_CASES, lines)
    ok &= check_graph_capture(device, lines)
    ok &= run_benches(device, DRY_BENCHES if args.dry_run else BENCHES, lines,
                      2 if args.dry_run else args.reps)
    lines += ["", f"overall: {'PASS' if ok else 'FAIL'}"
              + (" (dry run: speed targets not meaningful)" if args.dry_run else "")]
    print(lines[-1])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    return 0 if ok or args.dry_run else 1


if __name__ == "__main__":
    sys.exit(main())
