"""GPU timing of Stem attention against dense attention (one H100 or H200).

For B=1, Hq=32, Hkv=8, D=128, bf16 causal prefill at each of ``--seqs``
(default 32K, 64K and 128K tokens), the calls in alternating turns:

* ``sdpa``: ``scaled_dot_product_attention(is_causal=True)`` (flash);
* ``flex dense``: compiled FlexAttention under the plain causal ``BlockMask``
  (built from block lists) and this package's kernel options (the dense
  kernel of the library the sparse path runs on);
* ``indexer``: ``stem_inputs`` + metadata + indexer (default budget);
* ``sparse``: ``block_sparse_attention`` on the indexer's selection
  (FlexAttention on CUDA);
* ``triton sparse`` (CUDA): ``block_sparse_attention(backend="triton")``,
  the paged entry point's Triton kernel (``ops/triton/paged_attention.py``)
  on the same selection, K and V cut into pages of one block: the candidate
  to replace FlexAttention there, with its own E and error;
* ``stem``: ``stem_attention`` with every default (preset, ``exact_tail``,
  ``dense_above``: it may step aside to dense, said in the ``path`` column).

Then, at the last length, the paged entry point (``stem_paged_run``) on the
same tokens held as an engine holds them: 16-token pages, shuffled, with
their ``IndexCache``. Its Triton kernels' picks against the CPU path's on a
host copy of the step (identical, or differing only within the rounding of
a row's threshold, docs/CONTRACT.md section 5), its output against float32
attention on the picked blocks, compiled and replayed from a CUDA graph equal
to eager, timed against ``stem_run`` on the contiguous tensors. And
``stem_run`` on one ``stem_plan``: against float32 attention on the
indexer's blocks, compiled with ``fullgraph=True, dynamic=True`` and
replayed from a CUDA graph on new inputs equal to eager, timed against
``stem_attention``, which plans on every call.

Correctness first: 8 sampled query blocks of the sparse output are compared
with float32 attention restricted to the same blocks, and ``stem``'s output
with the sparse output widened as ``exact_tail`` widens it (or SDPA's, where
it steps aside). E = sdpa x density / sparse (the block-sparse kernel's
efficiency per kept pair). Speed-ups are medians over the turns with
[min, max].

``--break-even SEQ``: ``stem_attention(dense_above=1.0, exact_tail=0)``
against SDPA at one length with the budget fixed to each of ``--budgets``
blocks per row (rates 0, alpha 1): the density where the two cost the same
is the measured ``dense_above`` for CUDA bf16 (``contract.DENSE_ABOVE``).

Each length, each check and each budget runs in its own try, and so does
each timed call: one that raises fails the run and loses its own cells
(``error``), the rest are measured. Every line is appended to
``$OUT/gpu_attention.md`` (or ``gpu_break_even.md``; ``$OUT`` defaults to
./out) as it is produced, with the machine and the commit (``STEM_GIT_SHA``,
``gpu_report.run_sha``), so a run stopped at its time limit keeps what it
measured. ``--dry-run`` runs tiny shapes on CPU, the Triton kernels
interpreted, so that the script is checked anywhere (its timings then mean
nothing).

    python benchmarks/gpu/gpu_attention.py --reps 3
    python benchmarks/gpu/gpu_attention.py --break-even 32768 --budgets 32,64,128,192 --reps 3
    python benchmarks/gpu/gpu_attention.py --dry-run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

# Triton decides at import whether it interprets kernels: a dry run runs the
# paged entry point's Triton kernels on CPU tensors, interpreted.
if __name__ == "__main__" and "--dry-run" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import stem_indexer  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # noqa: E402,F401  (every area's folder on sys.path)
from common import machine  # noqa: E402
from gpu_report import (Report, attempt, error_text, errors_line, guarded_runs,  # noqa: E402
                        median_cell, run_sha, spread_cell)
from stem_indexer.operator import contract  # noqa: E402
from stem_indexer.surfaces.attention import block_sparse_attention  # noqa: E402
from stem_indexer.operator.ops import flex_attention as flex  # noqa: E402
from stem_indexer.testing import compare  # noqa: E402

TOLERANCE = 2e-2  # bf16 outputs against float32 attention on the same blocks
HEADER = ("| tokens | density | sdpa | flex dense | indexer | sparse attn | stem_attention | "
          "path | sdpa / sparse | E | sdpa / stem | flex dense / stem | "
          "max err sparse / stem | triton sparse | E triton | max err triton | check |")


def _shape(device: str):
    """(Hq, Hkv, D, block, stride): the benchmark's on CUDA, tiny on CPU."""
    return (32, 8, 128, 128, 16) if device == "cuda" else (4, 2, 32, 32, 8)


def _qkv(seq: int, device: str):
    hq, hkv, d, _, _ = _shape(device)
    gen = torch.Generator(device=device).manual_seed(seq)
    return tuple(torch.randn(1, h, seq, d, device=device, generator=gen, dtype=torch.bfloat16)
                 for h in (hq, hkv, hkv))


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


def _sample_rows(heads: int, blocks: int, seed: int = 1, n: int = 8) -> list[tuple[int, int]]:
    """``n`` random (query head, query block) pairs, blocks below ``blocks``."""
    gen = torch.Generator().manual_seed(seed)
    return [(int(torch.randint(heads, (1,), generator=gen)),
             int(torch.randint(max(blocks, 1), (1,), generator=gen))) for _ in range(n)]


def _sampled_error(block_rows, q, k, v, idx, lens, rows, bs, scale) -> float:
    """Max error of ``block_rows(h, i)`` (query block i of head h, [bs, D])
    against float32 attention on its listed blocks, over ``rows``."""
    ref = _masked_reference(q, k, v, idx.cpu(), lens.cpu(), rows, bs, scale)
    return max(float((block_rows(h, i).float() - r).abs().max()) for (h, i), r in ref.items())


def _flex_dense(q, k, v, scale):
    """Compiled FlexAttention under the plain causal BlockMask: every block
    up to the diagonal listed (built from the lists: ``create_block_mask``
    would evaluate a (S, S) mask, 128 GiB at 128K tokens)."""
    seq, bs = q.shape[2], _shape(q.device.type)[3]
    nb = -(-seq // bs)
    lengths = (torch.arange(nb, device=q.device) + 1).int().expand(1, 1, nb)
    idx = torch.arange(nb, device=q.device).int().expand(1, 1, nb, nb)
    idx = torch.where(idx < lengths[..., None], idx, -1)
    mask = flex.block_mask(idx, lengths, block_size=bs, q_len=seq, kv_len=seq)
    return lambda: flex.flex_attention_forward(q, k, v, mask, scale)[0]


def run(seq: int, device: str, reps: int, report: Report) -> bool:
    """One length's row of the table (its timed calls each guarded)."""
    q, k, v = _qkv(seq, device)
    _, _, d, bs, stride = _shape(device)
    scale = d ** -0.5
    params = dict(stem_block_size=bs, stem_stride=stride)

    def indexer():
        inp = stem_indexer.stem_inputs(q, k, v, scale=scale / stride, **params)
        return stem_indexer.stem_indexer(inp.qflat, inp.kflat, inp.vbias, inp.q_seq_lens,
                                         inp.kv_seq_lens, **params)

    idx, lens = indexer()
    nb = -(-seq // bs)
    visible = int(contract.visible_blocks(torch.arange(nb), nb, nb, True).sum()) * q.shape[1]
    density = float(lens.sum()) / visible

    def sparse():
        return block_sparse_attention(q, k, v, idx, lens, stem_block_size=bs, scale=scale)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=True)

    def stem():
        return stem_indexer.stem_attention(q, k, v, scale=scale, **params)

    got = sparse()
    rows = _sample_rows(q.shape[1], nb)
    err = _sampled_error(lambda h, i: got[0, h, i * bs:(i + 1) * bs], q, k, v, idx, lens,
                         rows, bs, scale)
    info = stem_indexer.stem_attention(q, k, v, scale=scale, return_info=True, **params)[1]
    # stem with defaults equals the sparse path outside the exact tail's rows
    # (or SDPA, where it steps aside): checked on the rows before the tail.
    tail_start = (seq - contract.DEFAULT_EXACT_TAIL) // bs * bs
    want = got if info.path == "sparse" else sdpa()
    stem_err = float((stem()[:, :, :tail_start].float()
                      - want[:, :, :tail_start].float()).abs().max())
    ok = err < TOLERANCE and stem_err < TOLERANCE
    del want
    fns = {"sdpa": sdpa, "flex dense": _flex_dense(q, k, v, scale), "indexer": indexer,
           "sparse": sparse, "stem": stem}
    triton_err, triton_cell = None, "-"
    if device == "cuda":
        fns["triton sparse"] = lambda: block_sparse_attention(
            q, k, v, idx, lens, stem_block_size=bs, scale=scale, backend="triton")
        out, why = attempt(fns["triton sparse"], device)
        if why is None:
            triton_err = _sampled_error(lambda h, i: out[0, h, i * bs:(i + 1) * bs], q, k, v,
                                        idx, lens, rows, bs, scale)
            ok &= triton_err < TOLERANCE
            triton_cell = f"{triton_err:.1e}"
        else:
            ok, triton_cell = False, "error"
            print(f"triton sparse at {seq}: {why}", flush=True)
        del out
    times, errors = guarded_runs(fns, device=device, reps=reps)
    ok &= not errors
    t = {name: statistics.median(ms) for name, ms in times.items()}

    def ratio(a: str, b: str, factor: float = 1.0, unit: str = "") -> str:
        return f"{factor * t[a] / t[b]:.2f}{unit}" if a in t and b in t else "-"

    triton = "- | -" if "triton sparse" not in fns else (
        f"{median_cell(times, 'triton sparse')} | {ratio('sdpa', 'triton sparse', density)}")
    timed = (median_cell(times, n) for n in ("sdpa", "flex dense", "indexer", "sparse", "stem"))
    cells = [str(seq), f"{density:.1%}", *timed, info.path, spread_cell(times, "sdpa", "sparse"),
             ratio("sdpa", "sparse", density), spread_cell(times, "sdpa", "stem"),
             ratio("flex dense", "stem", unit="x"), f"{err:.1e} / {stem_err:.1e}", triton,
             triton_cell, "ok" if ok else "FAIL"]
    report.add("| " + " | ".join(cells) + " |")
    if errors:
        print(errors_line(errors, f"at {seq} tokens"), flush=True)
    return ok


def _said(checks: dict) -> str:
    return "; ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in checks.items())


def _timing_table(report: Report, times: dict, errors: dict, where: str) -> None:
    report.add("", "| call | ms, median [min, max] |", "|---|---|")
    for name, ms in times.items():
        report.add(f"| {name} | {statistics.median(ms):.2f} [{min(ms):.2f}, {max(ms):.2f}] |")
    for name, text in errors.items():
        report.add(f"| {name} | error: {text} |")


def _capture(fn, static: list, fresh: list):
    """``fn`` captured in a CUDA graph on the tensors ``static`` (warmed up on
    a side stream), then replayed on ``fresh`` copied in: ``(graph, replayed
    output, eager output on the fresh tensors)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up off the capture: kernels compiled, caches filled
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    for x, new in zip(static, fresh):
        x.copy_(new)
    graph.replay()
    return graph, out, fn(*static)


def planned(seq: int, device: str, reps: int, report: Report) -> bool:
    """``stem_run`` on one ``stem_plan``: against float32 attention on the
    indexer's blocks (sampled query blocks before the exact tail), compiled
    (``fullgraph=True, dynamic=True``) and replayed from a CUDA graph on new
    inputs equal to eager; timed against ``stem_attention``, which plans on
    every call."""
    q, k, v = _qkv(seq, device)
    _, _, d, bs, stride = _shape(device)
    scale = d ** -0.5
    params = dict(stem_block_size=bs, stem_stride=stride)
    plan = stem_indexer.stem_plan([seq], [seq], num_heads=q.shape[1], num_kv_heads=k.shape[1],
                                  head_dim=d, device=q.device, dtype=q.dtype, **params)
    eager = stem_indexer.stem_run(q, k, v, plan)
    checks = {}
    tail_blocks = (seq - contract.DEFAULT_EXACT_TAIL) // bs
    if plan.path == "sparse":
        inp = stem_indexer.stem_inputs(q, k, v, scale=scale / stride, **params)
        idx, lens = stem_indexer.stem_indexer(*inp, **params)
        rows = _sample_rows(q.shape[1], tail_blocks, seed=2)
        err = _sampled_error(lambda h, i: eager[0, h, i * bs:(i + 1) * bs], q, k, v, idx, lens,
                             rows, bs, scale)
    else:
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        err = float((eager.float() - want.float()).abs().max())
    checks[f"eager within {TOLERANCE} of float32 attention on its blocks (max {err:.1e})"] = \
        err < TOLERANCE
    compiled = torch.compile(stem_indexer.stem_run, fullgraph=True, dynamic=True)
    same, why = attempt(lambda: torch.equal(compiled(q, k, v, plan), eager), device)
    checks["compiled = eager" + (f" ({why})" if why else "")] = bool(same)
    fns = {"stem_attention": lambda: stem_indexer.stem_attention(q, k, v, **params),
           "stem_run": lambda: stem_indexer.stem_run(q, k, v, plan)}
    _replay_check(fns, checks, "graph replay", lambda *x: stem_indexer.stem_run(*x, plan),
                  [x.clone() for x in (q, k, v)], [q.flip(2), k.flip(2), v.flip(2)], device,
                  "new inputs")
    times, errors = guarded_runs(fns, device=device, reps=reps)
    report.add("", f"stem_run on one plan at {seq} tokens ({plan.path}): {_said(checks)}")
    _timing_table(report, times, errors, f"stem_run at {seq}")
    return all(checks.values()) and not errors


def _replay_check(fns: dict, checks: dict, label: str, run, inputs: list, new_inputs: list,
                  device: str, what: str) -> None:
    """On CUDA: capture ``run(*inputs)`` in a graph and replay it on
    ``new_inputs``; the replay is timed as ``label`` and checked against eager
    on the same inputs (``checks``)."""
    if device != "cuda":
        return
    captured, why = attempt(lambda: _capture(run, inputs, new_inputs), device)
    if captured is not None:
        graph, replayed, again = captured
        fns[label] = graph.replay
    checks[f"CUDA graph replay on {what} = eager" + (f" ({why})" if why else "")] = \
        captured is not None and torch.equal(replayed, again)


PAGE = 16  # vLLM's default page size on CUDA


def _paged_step(q, k, v, stride: int, device, seed: int = 0):
    """The tokens of one prompt as an engine holds them, on ``device``: K and
    V on shuffled pages of ``PAGE`` tokens, the ``IndexCache`` written beside
    them (on that device), the queries packed, the block table."""
    seq, hkv, d = k.shape[2], k.shape[1], k.shape[3]
    q, k, v = (x.to(device) for x in (q, k, v))
    pages = -(-seq // PAGE)
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(pages + 8, generator=gen)[:pages].to(device, torch.int32)[None]
    key_cache = k.new_zeros(pages + 8, PAGE, hkv, d)
    value_cache = torch.zeros_like(key_cache)
    pos = torch.arange(seq, device=device)
    page_ids, offsets = table[0, pos // PAGE].long(), pos % PAGE
    key_cache[page_ids, offsets] = k[0].transpose(0, 1)
    value_cache[page_ids, offsets] = v[0].transpose(0, 1)
    cache = stem_indexer.IndexCache.allocate(pages + 8, PAGE, stride, hkv, d, device=device)
    cache.write(k[0].transpose(0, 1), v[0].transpose(0, 1), page_ids * PAGE + offsets)
    return q[0].transpose(0, 1).contiguous(), key_cache, value_cache, cache, table


def _picks_check(picks, want, q, k, v, scale: float, params: dict) -> tuple[bool, str]:
    """The device's picks against the CPU path's: identical, or differing
    only within rounding of a row's threshold (docs/CONTRACT.md section 5,
    scores from ``stem_inputs`` on the host)."""
    picks = tuple(t.cpu() for t in picks)
    if all(torch.equal(a, b) for a, b in zip(picks, want)):
        return True, "identical"
    inp = stem_indexer.stem_inputs(q.cpu(), k.cpu(), v.cpu(), scale=scale / params["stem_stride"],
                                   **params)
    result = compare.compare(picks, want, inp._asdict(),
                             contract.IndexerParams(**params), allowance=0.0)
    return result.ok, result.summary()


def paged(seq: int, device: str, reps: int, report: Report) -> bool:
    """``stem_paged_run`` on ``_paged_step``: the Triton path (CUDA, or the
    interpreter in a dry run) against the CPU path on a host copy of the step
    (picks) and float32 attention on the picked blocks (output), compiled and
    replayed from a CUDA graph equal to eager; timed against ``stem_run`` on
    the contiguous tensors."""
    from stem_indexer.operator.ops.triton import launch
    from stem_indexer.pipeline.paged import stem_paged_select

    q, k, v = _qkv(seq, device)
    hq, hkv, d, bs, stride = _shape(device)
    scale = d ** -0.5
    params = dict(stem_block_size=bs, stem_stride=stride)
    step = _paged_step(q, k, v, stride, device)
    host_step = _paged_step(q, k, v, stride, "cpu")
    kw = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=PAGE, dtype=q.dtype,
              **params)
    backend = "triton" if device == "cuda" or launch.INTERPRETED else "torch"
    plan = stem_indexer.stem_paged_plan([seq], [seq], backend=backend, device=q.device, **kw)
    host_plan = stem_indexer.stem_paged_plan([seq], [seq], backend="torch", device="cpu", **kw)
    query, key_cache, value_cache, cache, table = step
    picks = stem_paged_select(query, cache, table, plan)
    want = stem_paged_select(host_step[0], host_step[3], host_step[4], host_plan)
    same, said = _picks_check(picks, want, q, k, v, scale, params)
    checks = {f"{plan.kernel} picks = the CPU path's ({said})": same}
    out = stem_indexer.stem_paged_run(*step, plan)
    rows = _sample_rows(hq, -(-seq // bs), seed=3)
    err = _sampled_error(lambda h, i: out[i * bs:(i + 1) * bs, h], q, k, v, *picks, rows, bs,
                         scale)
    checks[f"output within {TOLERANCE} of float32 attention on its picks (max {err:.1e})"] = \
        err < TOLERANCE
    compiled = torch.compile(stem_indexer.stem_paged_run, fullgraph=True, dynamic=True)
    equal, why = attempt(lambda: torch.equal(compiled(*step, plan), out), device)
    checks["compiled = eager" + (f" ({why})" if why else "")] = bool(equal)
    contiguous = stem_indexer.stem_plan([seq], [seq], num_heads=hq, num_kv_heads=hkv,
                                        head_dim=d, device=q.device, dtype=q.dtype, **params)
    fns = {"stem_run (contiguous)": lambda: stem_indexer.stem_run(q, k, v, contiguous),
           f"stem_paged_run ({plan.kernel})": lambda: stem_indexer.stem_paged_run(*step, plan)}
    _replay_check(fns, checks, "stem_paged_run graph replay",
                  lambda x: stem_indexer.stem_paged_run(x, *step[1:], plan), [query.clone()],
                  [query.flip(0)], device, "new queries")
    times, errors = guarded_runs(fns, device=device, reps=reps)
    report.add("", f"stem_paged_run at {seq} tokens, {PAGE}-token pages shuffled "
               f"({plan.paths[0]}; attention: {plan.attention}): {_said(checks)}")
    _timing_table(report, times, errors, f"stem_paged_run at {seq}")
    return all(checks.values()) and not errors


def break_even(seq: int, budgets: list[int], device: str, reps: int, report: Report) -> bool:
    q, k, v = _qkv(seq, device)
    _, _, _, bs, stride = _shape(device)
    report.add("", f"## Break-even at {seq} tokens: stem_attention(dense_above=1.0, "
               "exact_tail=0) with a fixed budget against SDPA", "",
               "| budget Ks | density | sdpa ms | stem ms | sdpa / stem, median [min, max] |",
               "|---|---|---|---|---|")
    points, ok = [], True
    for budget in budgets:
        kw = dict(stem_block_size=bs, stem_stride=stride, k_block_num_rate_medium=0.0,
                  k_block_num_bias_medium=budget, k_block_num_rate_large=0.0,
                  k_block_num_bias_large=budget, dense_above=1.0, exact_tail=0)
        try:
            info = stem_indexer.stem_attention(q, k, v, return_info=True, **kw)[1]
            times, errors = guarded_runs(
                {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True),
                 "stem": lambda: stem_indexer.stem_attention(q, k, v, **kw)},
                device=device, reps=reps)
        except Exception as exc:  # this budget's line says so; the sweep goes on
            report.add(f"| {budget} | error: {error_text(exc)} | | | |")
            ok = False
            continue
        if not errors:
            points.append((info.density, statistics.median(
                a / b for a, b in zip(times["sdpa"], times["stem"]))))
        report.add(f"| {budget} | {info.density:.1%} | {median_cell(times, 'sdpa')} "
                   f"| {median_cell(times, 'stem')} | {spread_cell(times, 'sdpa', 'stem')} |")
        if errors:
            print(errors_line(errors, f"budget {budget}"), flush=True)
            ok = False
    points.sort()
    cross = [d0 + (d1 - d0) * (r0 - 1) / (r0 - r1)
             for (d0, r0), (d1, r1) in zip(points, points[1:]) if r0 >= 1 > r1]
    report.add("", "break-even density (linear between the budgets around sdpa / stem = 1): "
               + (f"{cross[0]:.1%}" if cross else "not crossed in this sweep"))
    return ok


def guarded(report: Report, what: str, fn, device: str) -> bool:
    """``fn()``'s verdict, or a line saying what it raised (and False)."""
    verdict, why = attempt(fn, device)
    if why is not None:
        report.add("", f"{what}: ERROR {why}")
        return False
    return bool(verdict)


def lengths(report: Report, seqs: list[int], device: str, reps: int) -> bool:
    """The table: one row per length, each in its own try."""
    report.add("", HEADER, "|---" * HEADER.count(" | ") + "|---|")
    ok = True
    for seq in seqs:
        verdict, why = attempt(lambda: run(seq, device, reps, report), device)
        if why is not None:
            report.add(f"| {seq} | error: {why} |")
        ok &= bool(verdict)
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seqs", default=None, help="comma-separated token counts")
    parser.add_argument("--break-even", type=int, default=None, metavar="SEQ",
                        help="sweep fixed budgets at SEQ tokens instead")
    parser.add_argument("--budgets", default="32,64,96,128,160,192,224",
                        help="with --break-even: budgets Ks in blocks per row")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --dry-run", file=sys.stderr)
        return 2
    reps = args.reps if device == "cuda" else 1
    hq, hkv, d, bs, stride = _shape(device)
    name = "gpu_break_even.md" if args.break_even else "gpu_attention.md"
    report = Report(Path(os.environ.get("OUT", "./out")) / name)
    report.add(f"# Stem attention against dense attention ({machine(device)})", "",
               f"git {run_sha()}, bf16, B=1, Hq={hq}, Hkv={hkv}, D={d}, causal, blocks of {bs}, "
               f"stride {stride}; times in ms, medians of {reps} turns with the calls "
               "alternating; speed-ups are sdpa / x per turn, median [min, max]")
    ok = True
    try:
        with torch.inference_mode():
            if args.break_even:
                budgets = [int(b) for b in args.budgets.split(",")]
                ok = break_even(args.break_even if device == "cuda" else 2048,
                                budgets if device == "cuda" else [8, 24, 40], device, reps,
                                report)
            else:
                default = "32768,65536,131072" if device == "cuda" else "1024,2048"
                seqs = [int(s) for s in (args.seqs or default).split(",")]
                ok = lengths(report, seqs, device, reps)
                last = seqs[-1] if device == "cuda" else 128
                ok &= guarded(report, f"stem_paged_run at {last} tokens",
                              lambda: paged(last, device, reps, report), device)
                ok &= guarded(report, f"stem_run at {seqs[-1]} tokens",
                              lambda: planned(seqs[-1], device, reps, report), device)
    except KeyboardInterrupt:  # the step's time limit: what was measured is in the file
        report.add("", "CUT SHORT (interrupted): the lines above are what was measured")
        return 130
    report.add("", "checks passed" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
