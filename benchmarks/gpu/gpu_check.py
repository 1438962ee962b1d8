"""GPU check of the Triton path: correctness, speed against a torch composite
and the roofline, CUDA-graph capture, on one H100 or H200 (``gpu_check.sh
--all`` gives it 80 s).

1. Correctness: a subset of the case table (128K and 1M-token kv included)
   on the GPU against the op's CPU path on the same inputs, judged like the
   runner (docs/CONTRACT.md section 5; integer-data cases must be identical).
2. CUDA graphs: ``torch.compile(mode="reduce-overhead")`` of the op replays
   with results identical to the CPU path's (integer data: exact scores).
3. Speed, each the median of CUDA-event measurements after warm-up: the op
   replayed from a CUDA graph (no host checks), the eager op (with its
   host-side value checks), its two kernels alone (score, select), and a
   torch composite written here (per batch and KV head: bf16 matmul with
   float32 output, the visible candidates of each row, top-k on keys that
   order by score then lower block index, forced blocks added; chunked to
   fit memory) on
   * B=8, Nq=64, Nk=8, Df=2048, Bs=128, causal q = kv = 128K tokens;
   * B=1, Nq=32, Nk=8, Df=2048, Bs=128, q = 8K tokens at the end of kv = 1M.
   The roofline is max(GEMM FLOPs of the visible pairs at the GPU's peak,
   bytes of the inputs read once and the outputs written once at its
   bandwidth), the peaks chosen by ``torch.cuda.get_device_name()``
   (``gpu_report.peaks_for``: 790 TFLOP/s on an H100 SXM and an H200, 3.0
   and 4.3 TB/s); on another GPU the roofline is not guessed: its cells say
   ``unknown`` and its target is not judged.
   Targets: >= 5x the composite, <= 2x the roofline.
4. ``--variants``: the two kernels under other launch configurations
   (pointer loads instead of TMA, deeper pipeline, the radix selection for
   every row, ...) on the first shape, to choose defaults.

Each case, check, shape and variant runs in its own try, and so does each
timing of a shape: one that raises fails the check and loses its own cells,
the rest are measured. Every line goes to stdout and is appended to
``$OUT/gpu_check.md`` (``$OUT`` defaults to ./out) as it is produced, after
the machine, its peaks, the versions and the commit (``STEM_GIT_SHA``,
``gpu_report.run_sha``): a run stopped at its time limit keeps what it
measured.

``--dry-run`` runs the same logic on CPU tensors with tiny shapes under the
Triton interpreter (no GPU needed), so the script itself can be checked
anywhere.
"""

from __future__ import annotations

import os
import sys

# Triton decides at import whether it interprets kernels: a dry run must say so first.
if __name__ == "__main__" and "--dry-run" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # noqa: E402,F401  (every area's folder on sys.path)
from common import machine, median_ms  # noqa: E402
from gpu_report import Peaks, Report, attempt, device_peaks, error_text, run_sha  # noqa: E402
from stem_indexer.operator import contract  # noqa: E402
from stem_indexer.operator.contract import IndexerParams, ceil_div  # noqa: E402
from stem_indexer.operator.ops.triton import launch  # noqa: E402
from stem_indexer.testing import cases, compare  # noqa: E402

CORRECTNESS_CASES = ("SI_WB_001", "SI_WB_003", "SI_WB_103", "SI_WB_013", "SI_WB_024",
                     "SI_WB_045", "SI_WB_059", "SI_WB_061", "SI_WB_161", "SI_WB_062",
                     "SI_WB_077", "SI_WB_094", "SI_WB_097", "SI_WB_098")
DRY_CASES = ("SI_WB_003", "SI_WB_012", "SI_WB_113")
# Memory for the composite's per-chunk temporaries (int64 keys and their sort).
COMPOSITE_BYTES = 2 << 30


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
# Launch configurations compared by --variants: changes to the default one.
VARIANTS = {
    "pointer loads (no TMA)": dict(tma=False, score_maxnreg=None),
    "score registers uncapped (one program per SM)": dict(score_maxnreg=None),
    "4 pipeline stages": dict(score_stages=4),
    "BLOCK_N 64": dict(block_n=64),
    "radix selection for every row": dict(block_c=16),
    "3 pipeline stages": dict(score_stages=3),
    "select: 2 warps": dict(select_warps=2),
}


def _versions(device: str, peaks: Peaks | None) -> str:
    import triton
    name = device_peaks(device)[0]
    roof = (f"roofline peaks {peaks}" if peaks is not None
            else f"roofline peaks unknown for {name}: no roofline ratio")
    return (f"machine: {machine(device)}; {roof}; triton {triton.__version__}; "
            f"git {run_sha()}; python {platform.python_version()}")


def _metadata(inputs: dict, q_heads: int, kv_heads: int, params: IndexerParams, dim: int):
    return torch.ops.custom.npu_stem_indexer_metadata(
        inputs["q_seq_lens"], inputs["kv_seq_lens"], q_heads, kv_heads, causal=params.causal,
        stem_block_size=params.stem_block_size, dim_qkflat=dim, window_size=params.window_size)


def _args(inputs: dict):
    return [inputs[k] for k in ("qflat", "kflat", "vbias", "q_seq_lens", "kv_seq_lens")]


def run_op(inputs: dict, md, params: IndexerParams):
    """The op on the inputs' device; on CPU the Triton launcher (interpreted),
    since the op itself sends CPU tensors to the CPU path."""
    if inputs["qflat"].is_cuda:
        return torch.ops.custom.npu_stem_indexer(
            *_args(inputs), num_prompt_tokens=inputs["num_prompt_tokens"], metadata=md,
            **dataclasses.asdict(params))
    return launch.stem_indexer_triton(*_args(inputs), inputs["num_prompt_tokens"], md, params)


def run_cpu_path(inputs: dict, md, params: IndexerParams):
    cpu = {k: (None if v is None else v.cpu()) for k, v in inputs.items()}
    return torch.ops.custom.npu_stem_indexer(
        *_args(cpu), num_prompt_tokens=cpu["num_prompt_tokens"], metadata=md.cpu(),
        **dataclasses.asdict(params))


# --------------------------------------------------------------------------- #
# The torch composite
# --------------------------------------------------------------------------- #


def _row_facts(inputs: dict, params: IndexerParams, qmax: int, kmax: int) -> torch.Tensor:
    """(B, Qmax, 4) int64: visible blocks, candidate range [lo, hi), picks."""
    bs = params.stem_block_size
    qb = ceil_div(inputs["q_seq_lens"].long(), bs)[:, None]
    kb = ceil_div(inputs["kv_seq_lens"].long(), bs)[:, None]
    prompt = inputs["num_prompt_tokens"]
    p = ceil_div((inputs["kv_seq_lens"] if prompt is None else prompt).long(), bs)[:, None]
    i = torch.arange(qmax, device=qb.device)[None, :]
    s2 = torch.where(i < qb, contract.visible_blocks(i, qb, kb, params.causal), 0)
    lo, hi = contract.candidate_range(s2, params.initial_blocks, params.window_size)
    k = contract.row_budget(i + (kb - qb), p, contract.prompt_budget(p, params), params.alpha)
    return torch.stack([s2, lo, hi, torch.minimum(k, hi - lo)], dim=-1)


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q @ k.T from bf16 operands with float32 accumulation and output."""
    if q.is_cuda:
        return torch.mm(q, k.T, torch.float32)
    return q.float() @ k.float().T


def run_composite(inputs: dict, params: IndexerParams):
    """The indexer as plain torch operations on the inputs' device. Its matmul
    accumulates in float32 throughout (cuBLAS may otherwise reduce bf16
    split-K partial sums in reduced precision, which moves top-k boundaries)."""
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    qflat, kflat, vbias = inputs["qflat"], inputs["kflat"], inputs["vbias"]
    batch, nq, qmax, df = qflat.shape
    nk, kmax = kflat.shape[1], kflat.shape[2]
    group = nq // nk
    facts = _row_facts(inputs, params, qmax, kmax)
    top = max(1, int(facts[..., 3].max()))
    cols = torch.arange(kmax, device=qflat.device)
    indices = torch.full((batch, nq, qmax, kmax), -1, dtype=torch.int32, device=qflat.device)
    seq_len = torch.zeros((batch, nq, qmax), dtype=torch.int32, device=qflat.device)
    step = max(1, COMPOSITE_BYTES // (group * kmax * 24))
    for b in range(batch):
        for n in range(nk):
            heads = slice(n * group, (n + 1) * group)
            for i0 in range(0, qmax, step):
                rows = slice(i0, min(qmax, i0 + step))
                s2, lo, hi, take = (f[:, None] for f in facts[b, rows].unbind(-1))
                q = qflat[b, heads, rows].reshape(-1, df)
                s = _scores(q, kflat[b, n]) * contract.score_scale(params) + vbias[b, n]
                keys = contract.rank_keys(s.view(group, -1, kmax), 0, params.topk_score_precision)
                keys = keys.masked_fill(~((cols >= lo) & (cols < hi)), contract.NO_CANDIDATE)
                best = keys.topk(min(top, kmax), dim=-1).indices
                ranked = torch.arange(best.shape[-1], device=q.device) < take
                picked = torch.zeros_like(keys, dtype=torch.bool).scatter_(
                    -1, best, ranked.expand_as(best))
                keep = picked | (cols < lo) | ((cols >= hi) & (cols < s2))
                ordered = torch.where(keep, cols, kmax).sort(-1).values
                indices[b, heads, rows] = torch.where(ordered < kmax, ordered, -1).int()
                seq_len[b, heads, rows] = keep.sum(-1).int()
    return indices, seq_len


# --------------------------------------------------------------------------- #
# Timing
# --------------------------------------------------------------------------- #


def kernel_times(inputs: dict, md, params: IndexerParams, config, device: str,
                 reps: int) -> list[float]:
    """Median ms of each kernel of one call (in launch order), under ``config``."""
    qflat, kflat = inputs["qflat"], inputs["kflat"]
    batch, nq, qmax, _ = qflat.shape
    indices = torch.empty((batch, nq, qmax, kflat.shape[2]), dtype=torch.int32, device=device)
    seq_len = torch.empty((batch, nq, qmax), dtype=torch.int32, device=device)
    prompt = inputs["num_prompt_tokens"]
    launches = launch.kernel_launches(
        *_args(inputs), inputs["kv_seq_lens"] if prompt is None else prompt, md, params,
        config, indices, seq_len)
    samples = [[] for _ in launches]
    for rep in range(reps + 1):  # the first call compiles
        if device == "cuda":
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(launches) + 1)]
            events[0].record()
            for run, event in zip(launches, events[1:]):
                run()
                event.record()
            events[-1].synchronize()
            ms = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
        else:
            ms = []
            for run in launches:
                t0 = time.perf_counter()
                run()
                ms.append((time.perf_counter() - t0) * 1e3)
        if rep:
            for sample, t in zip(samples, ms):
                sample.append(t)
    return [statistics.median(s) for s in samples]


def _config(bench: Bench, device: str, **changes):
    arch, sms = ((None, 1) if device != "cuda" else launch.device_arch(torch.device(device)))
    cfg = launch.default_config(bench.q_heads // bench.kv_heads, bench.q_tokens // bench.block,
                                bench.kv_tokens // bench.block, bench.dim, arch=arch, sms=sms)
    return dataclasses.replace(cfg, **changes)


# --------------------------------------------------------------------------- #
# The checks
# --------------------------------------------------------------------------- #


def check_correctness(device: str, case_ids, report: Report) -> bool:
    ok_all = True
    report.add("", "## Correctness (GPU vs the CPU path, docs/CONTRACT.md section 5)", "",
               "| case | result | seconds |", "|---|---|---|")
    for cid in case_ids:
        case = cases.get_case(cid)
        t0 = time.perf_counter()
        try:
            raw = case.make_inputs()
            md = _metadata(raw, case.q_heads, case.kv_heads, case.params, case.dim)
            expected = run_cpu_path(raw, md, case.params)
            dev = {k: (v.to(device) if v is not None else None) for k, v in raw.items()}
            out = tuple(t.cpu() for t in run_op(dev, md.to(device), case.params))
            # Our own backend: no pick may differ beyond rounding (allowance 0).
            result = compare.compare(out, expected, raw, case.params, allowance=0.0)
            ok, text = result.ok, result.summary()
            if case.data == "integer" and not all(torch.equal(a, e) for a, e in zip(out, expected)):
                ok, text = False, text + "; FAIL: integer data must be identical"
        except Exception as exc:  # reported, the check goes on
            ok, text = False, f"ERROR {error_text(exc)}"
        ok_all &= ok
        report.add(f"| {case.label} | {text[:160]} | {time.perf_counter() - t0:.2f} |")
    return ok_all


def check_graph_capture(device: str, report: Report) -> bool:
    report.add("", "## CUDA graph capture", "")
    if device != "cuda":
        report.add("skipped: no CUDA device (dry run)")
        return True
    case = cases.get_case("SI_WB_079")  # integer data, GQA, mixed batch of 7
    raw = case.make_inputs("cuda")
    md = _metadata(raw, case.q_heads, case.kv_heads, case.params, case.dim)
    attrs = case.op_kwargs()

    def call(qflat, kflat, vbias, q_lens, kv_lens, metadata):
        return torch.ops.custom.npu_stem_indexer(qflat, kflat, vbias, q_lens, kv_lens,
                                                 metadata=metadata, **attrs)

    args = (*_args(raw), md)
    expected = run_cpu_path(raw, md, case.params)  # integer data: the same bits
    compiled = torch.compile(call, mode="reduce-overhead")
    same = True
    for _ in range(4):
        got = compiled(*args)
        same &= all(torch.equal(a.cpu(), e) for a, e in zip(got, expected))
    report.add("torch.compile(mode='reduce-overhead'), 4 calls (warm-up, record, replays): "
               + ("identical to the CPU path" if same else "DIFFERENT from the CPU path"))
    return same


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


def roofline_ms(bench: Bench, inputs: dict, out, peaks: Peaks) -> float:
    qb, kb = bench.q_tokens // bench.block, bench.kv_tokens // bench.block
    s2 = torch.arange(qb, dtype=torch.float64) + (kb - qb + 1)  # causal, right-down
    pairs = float(s2.clamp(0, kb).sum()) * bench.batch * bench.q_heads
    flops = 2.0 * bench.dim * pairs
    moved = sum(t.numel() * t.element_size() for t in (*_args(inputs), *out))
    return max(flops / peaks.flops, moved / peaks.bytes) * 1e3


def _graph_ms(inputs: dict, md, params: IndexerParams, device: str, reps: int) -> float:
    """The op replayed from a CUDA graph (no host checks); eager on CPU."""
    if device != "cuda":
        return median_ms(lambda: run_op(inputs, md, params), device=device, reps=reps)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_op(inputs, md, params)
    try:
        return median_ms(graph.replay, device=device, reps=reps)
    finally:
        del graph


def _judged(inputs: dict, out, composite_out, bench: Bench, params: IndexerParams):
    """The op's picks on batch 0 and the query heads of KV head 0 against the
    composite's and the CPU path's on that part alone (recomputing the scores
    of differing rows of the whole output would take minutes): two summaries
    and whether the CPU path's comparison passed."""
    g = bench.q_heads // bench.kv_heads
    part = {"qflat": inputs["qflat"][:1, :g], "kflat": inputs["kflat"][:1, :1],
            "vbias": inputs["vbias"][:1, :1], "q_seq_lens": inputs["q_seq_lens"][:1],
            "kv_seq_lens": inputs["kv_seq_lens"][:1]}
    mine = tuple(t[:1, :g].cpu() for t in out)
    equal = compare.compare(mine, tuple(t[:1, :g].cpu() for t in composite_out), part, params)
    part_cpu = {k: v.cpu() for k, v in part.items()}
    part_md = _metadata(part_cpu, g, 1, params, bench.dim)
    cpu_path = run_cpu_path({**part_cpu, "num_prompt_tokens": None}, part_md, params)
    versus_cpu = compare.compare(mine, cpu_path, part_cpu, params, allowance=0.0)
    return equal.summary(), versus_cpu.summary(), versus_cpu.ok


def _cell(value, error: str | None, fmt: str = ".3f") -> str:
    return "error" if error is not None else format(value, fmt)


def bench_row(bench: Bench, device: str, reps: int, peaks: Peaks | None) -> tuple[str, bool]:
    """One shape's line of the speed table, each timing in its own try: a
    part that raises says ``error`` in its cell (and fails the shape)."""
    params = IndexerParams(stem_block_size=bench.block, stem_stride=bench.stride)
    inputs = bench_inputs(bench, device)
    md = _metadata(inputs, bench.q_heads, bench.kv_heads, params, bench.dim)
    out = run_op(inputs, md, params)
    judged, judge_error = attempt(lambda: _judged(inputs, out, run_composite(inputs, params),
                                                  bench, params), device)
    equal, versus_cpu, cpu_ok = judged or ("error", "error", False)
    eager, eager_error = attempt(lambda: median_ms(lambda: run_op(inputs, md, params),
                                                   device=device, reps=reps), device)
    replay, replay_error = attempt(lambda: _graph_ms(inputs, md, params, device, reps), device)
    kernels, kernels_error = attempt(lambda: kernel_times(
        inputs, md, params, _config(bench, device), device, reps), device)
    composite, composite_error = attempt(lambda: median_ms(
        lambda: run_composite(inputs, params), device=device, reps=2, warmup=0), device)
    errors = [e for e in (judge_error, eager_error, replay_error, kernels_error,
                          composite_error) if e is not None]
    speedup = None if composite is None or replay is None else composite / replay
    roof = None if peaks is None else roofline_ms(bench, inputs, out, peaks)
    ratio = None if roof is None or replay is None else replay / roof
    ok = not errors and cpu_ok and speedup is not None and speedup >= 5 \
        and (ratio is None or ratio <= 2)
    cells = [f"{bench.name}: B={bench.batch} Nq={bench.q_heads} Nk={bench.kv_heads} "
             f"Df={bench.dim} q={bench.q_tokens} kv={bench.kv_tokens}",
             _cell(replay, replay_error), _cell(eager, eager_error),
             "error" if kernels is None else " + ".join(f"{t:.3f}" for t in kernels),
             _cell(composite, composite_error),
             "-" if speedup is None else f"{speedup:.1f}x",
             "unknown" if roof is None else f"{roof:.3f}",
             "-" if ratio is None else f"{ratio:.2f}x", equal, versus_cpu]
    for text in errors:
        print(f"{bench.name}: {text}", flush=True)
    return "| " + " | ".join(cells) + " |", ok


def run_benches(device: str, benches, report: Report, reps: int, peaks: Peaks | None) -> bool:
    ok_all = True
    report.add("", "## Speed (median ms)", "",
               "| shape | op (graph) | op (eager) | score + select kernels | composite | "
               "speed-up (>= 5) | roofline | op / roofline (<= 2) | vs composite | "
               "vs CPU path (batch 0, KV head 0) |",
               "|---|---|---|---|---|---|---|---|---|---|")
    for bench in benches:
        row, why = attempt(lambda: bench_row(bench, device, reps, peaks), device)
        line, ok = row if row is not None else (f"| {bench.name} | error: {why} |", False)
        report.add(line)
        ok_all &= ok
        if device == "cuda":
            torch.cuda.empty_cache()
    return ok_all


def run_variants(device: str, bench: Bench, report: Report, reps: int) -> bool:
    report.add("", f"## Kernel variants on {bench.name} (median ms of each kernel)", "",
               "| configuration | score | select |", "|---|---|---|")
    inputs = bench_inputs(bench, device)
    params = IndexerParams(stem_block_size=bench.block, stem_stride=bench.stride)
    md = _metadata(inputs, bench.q_heads, bench.kv_heads, params, bench.dim)
    ok = True
    for name, changes in {"default": {}, **VARIANTS}.items():
        try:
            cfg = _config(bench, device, **changes)
            score, *select = kernel_times(inputs, md, params, cfg, device, reps)
            report.add(f"| {name}: {cfg} | {score:.3f} | {sum(select):.3f} |")
        except Exception as exc:  # this variant's line says so; the others run
            report.add(f"| {name} | error: {error_text(exc)} | |")
            ok = False
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on CPU under the Triton interpreter")
    parser.add_argument("--variants", action="store_true",
                        help="also time the kernels under other launch configurations")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and (not torch.cuda.is_available() or launch.INTERPRETED):
        print("needs a CUDA device and TRITON_INTERPRET unset; or use --dry-run", file=sys.stderr)
        return 2
    reps = 2 if args.dry_run else args.reps
    benches = DRY_BENCHES if args.dry_run else BENCHES
    peaks = device_peaks(device)[1]
    report = Report(Path(args.out) / "gpu_check.md")
    report.add("# stem-indexer GPU check", "", _versions(device, peaks))
    steps = [lambda: check_correctness(device, DRY_CASES if args.dry_run else CORRECTNESS_CASES,
                                       report),
             lambda: check_graph_capture(device, report),
             lambda: run_benches(device, benches, report, reps, peaks)]
    if args.variants:
        steps.append(lambda: run_variants(device, benches[0], report, reps))
    ok = True
    try:
        for run in steps:
            verdict, why = attempt(run, device)
            if why is not None:
                report.add("", f"ERROR {why}")
            ok &= bool(verdict)
    except KeyboardInterrupt:  # the step's time limit: what was measured is in the file
        report.add("", "CUT SHORT (interrupted): the lines above are what was measured")
        return 130
    report.add("", f"overall: {'PASS' if ok else 'FAIL'}"
               + (" (dry run: speed targets not meaningful)" if args.dry_run else ""))
    return 0 if ok or args.dry_run else 1


if __name__ == "__main__":
    sys.exit(main())
