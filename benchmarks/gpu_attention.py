"""GPU timing of Stem attention against dense attention (one H200).

For B=1, Hq=32, Hkv=8, D=128, bf16 causal prefill at each of ``--seqs``
(default 32K, 64K and 128K tokens), five calls in alternating turns:

* ``sdpa``: ``scaled_dot_product_attention(is_causal=True)`` (flash);
* ``flex dense``: compiled FlexAttention with the causal ``BlockMask`` of
  ``create_block_mask`` and this package's kernel options (the dense
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

Then, at the last length, ``stem_run`` on one ``stem_plan``: equal to
``stem_attention`` eagerly, compiled with ``fullgraph=True, dynamic=True``,
and replayed from a CUDA graph on new inputs (CUDA only), each call timed.
And the paged entry point (``stem_paged_run``) on the same tokens held as an
engine holds them: 16-token pages, shuffled, with their ``IndexCache``; the
Triton kernels (reading pages through the table) pick exactly the torch
path's blocks and attend alike, compiled and replayed from a CUDA graph
equal to eager, timed against ``stem_run`` on the contiguous tensors.

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

Tables go to stdout and ``$OUT/gpu_attention.md`` (``$OUT`` defaults to
./out). ``--dry-run`` runs tiny shapes on CPU so that the script is checked
anywhere (its timings then mean nothing).

    python benchmarks/gpu_attention.py                       # about 90 s on an H200
    python benchmarks/gpu_attention.py --break-even 32768    # about 40 s
    python benchmarks/gpu_attention.py --dry-run   # the paged kernels interpreted
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
from common import git_sha, interleaved_runs, machine, write_atomic  # noqa: E402
from stem_indexer import contract  # noqa: E402
from stem_indexer.attention import block_sparse_attention  # noqa: E402
from stem_indexer.ops import flex_attention as flex  # noqa: E402


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


def _spread(runs: dict, name: str) -> str:
    turns = [d / x for d, x in zip(runs["sdpa"], runs[name])]
    return f"{statistics.median(turns):.2f}x [{min(turns):.2f}, {max(turns):.2f}]"


def run(seq: int, device: str, reps: int, lines: list[str]) -> bool:
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
    gen = torch.Generator().manual_seed(1)
    rows = [(int(torch.randint(q.shape[1], (1,), generator=gen)),
             int(torch.randint(nb, (1,), generator=gen))) for _ in range(8)]
    ref = _masked_reference(q, k, v, idx.cpu(), lens.cpu(), rows, bs, scale)
    err = max(float((got[0, h, i * bs:(i + 1) * bs].float() - r).abs().max())
              for (h, i), r in ref.items())
    info = stem_indexer.stem_attention(q, k, v, scale=scale, return_info=True, **params)[1]
    # stem with defaults equals the sparse path outside the exact tail's rows
    # (or SDPA, where it steps aside): checked on the rows before the tail.
    tail_start = (seq - contract.DEFAULT_EXACT_TAIL) // bs * bs
    want = got if info.path == "sparse" else sdpa()
    stem_err = float((stem()[:, :, :tail_start].float()
                      - want[:, :, :tail_start].float()).abs().max())
    ok = err < 2e-2 and stem_err < 2e-2
    fns = {"sdpa": sdpa, "flex dense": _flex_dense(q, k, v, scale), "indexer": indexer,
           "sparse": sparse, "stem": stem}
    triton_err = None
    if device == "cuda":
        fns["triton sparse"] = lambda: block_sparse_attention(
            q, k, v, idx, lens, stem_block_size=bs, scale=scale, backend="triton")
        triton_err = float((fns["triton sparse"]().float() - got.float()).abs().max())
        ok &= triton_err < 2e-2
    runs = interleaved_runs(fns, device=device, reps=reps)
    t = {name: statistics.median(ms) for name, ms in runs.items()}
    eff = t["sdpa"] * density / t["sparse"]
    triton = "- | - | -" if triton_err is None else (
        f"{t['triton sparse']:.2f} | {t['sdpa'] * density / t['triton sparse']:.2f} | "
        f"{triton_err:.1e}")
    lines.append(
        f"| {seq} | {density:.1%} | {t['sdpa']:.2f} | {t['flex dense']:.2f} | "
        f"{t['indexer']:.2f} | {t['sparse']:.2f} | {t['stem']:.2f} | {info.path} | "
        f"{_spread(runs, 'sparse')} | {eff:.2f} | {_spread(runs, 'stem')} | "
        f"{t['flex dense'] / t['stem']:.2f}x | {err:.1e} / {stem_err:.1e} | {triton} | "
        f"{'ok' if ok else 'FAIL'} |")
    print(lines[-1], flush=True)
    return ok


def planned(seq: int, device: str, reps: int, lines: list[str]) -> bool:
    """``stem_run`` on one ``stem_plan``: the same output as ``stem_attention``
    eagerly, compiled (``fullgraph=True, dynamic=True``) and replayed from a
    CUDA graph on new inputs; timed against ``stem_attention``, which plans
    on every call."""
    q, k, v = _qkv(seq, device)
    _, _, d, bs, stride = _shape(device)
    params = dict(stem_block_size=bs, stem_stride=stride)
    plan = stem_indexer.stem_plan([seq], [seq], num_heads=q.shape[1], num_kv_heads=k.shape[1],
                                  head_dim=d, device=q.device, dtype=q.dtype, **params)
    want = stem_indexer.stem_attention(q, k, v, **params)
    checks = {"eager": torch.equal(stem_indexer.stem_run(q, k, v, plan), want)}
    compiled = torch.compile(stem_indexer.stem_run, fullgraph=True, dynamic=True)
    checks["compiled"] = torch.equal(compiled(q, k, v, plan), want)
    fns = {"stem_attention": lambda: stem_indexer.stem_attention(q, k, v, **params),
           "stem_run": lambda: stem_indexer.stem_run(q, k, v, plan)}
    if device == "cuda":
        try:
            static = [x.clone() for x in (q, k, v)]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up off the capture: kernels compiled, caches filled
                    stem_indexer.stem_run(*static, plan)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = stem_indexer.stem_run(*static, plan)
            for x, new in zip(static, (q.flip(2), k.flip(2), v.flip(2))):
                x.copy_(new)
            graph.replay()
            checks["CUDA graph replay"] = torch.equal(out, stem_indexer.stem_run(*static, plan))
            fns["graph replay"] = graph.replay
        except Exception as exc:  # reported, and the check fails
            checks[f"CUDA graph capture ({type(exc).__name__}: {exc})"] = False
    runs = interleaved_runs(fns, device=device, reps=reps)
    said = "; ".join(f"{name} {'equal' if ok else 'DIFFERENT'}" for name, ok in checks.items())
    lines += ["", f"stem_run on one plan at {seq} tokens ({plan.path}): {said}",
              "", "| call | ms, median [min, max] |", "|---|---|"]
    lines += [f"| {name} | {statistics.median(ms):.2f} [{min(ms):.2f}, {max(ms):.2f}] |"
              for name, ms in runs.items()]
    print("\n".join(lines[-len(runs) - 4:]), flush=True)
    return all(checks.values())


PAGE = 16  # vLLM's default page size on CUDA


def _paged_step(q, k, v, stride: int, seed: int = 0):
    """The tokens of one prompt as an engine holds them: K and V on shuffled
    pages of ``PAGE`` tokens, the ``IndexCache`` written beside them, the
    queries packed, the block table."""
    seq, hkv, d = k.shape[2], k.shape[1], k.shape[3]
    pages = -(-seq // PAGE)
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(pages + 8, generator=gen)[:pages].to(q.device, torch.int32)[None]
    key_cache = k.new_zeros(pages + 8, PAGE, hkv, d)
    value_cache = torch.zeros_like(key_cache)
    pos = torch.arange(seq, device=q.device)
    page_ids, offsets = table[0, pos // PAGE].long(), pos % PAGE
    key_cache[page_ids, offsets] = k[0].transpose(0, 1)
    value_cache[page_ids, offsets] = v[0].transpose(0, 1)
    cache = stem_indexer.IndexCache.allocate(pages + 8, PAGE, stride, hkv, d, device=q.device)
    cache.write(k[0].transpose(0, 1), v[0].transpose(0, 1), page_ids * PAGE + offsets)
    return q[0].transpose(0, 1).contiguous(), key_cache, value_cache, cache, table


def paged(seq: int, device: str, reps: int, lines: list[str]) -> bool:
    """``stem_paged_run`` on ``_paged_step``: the Triton path (CUDA, or the
    interpreter in a dry run) against the torch path, compiled and replayed
    from a CUDA graph; timed against ``stem_run`` on the contiguous tensors."""
    from stem_indexer.ops.triton import launch
    from stem_indexer.paged import stem_paged_select

    q, k, v = _qkv(seq, device)
    hq, hkv, d, bs, stride = _shape(device)
    params = dict(stem_block_size=bs, stem_stride=stride)
    step = _paged_step(q, k, v, stride)
    kw = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=PAGE, device=q.device,
              dtype=q.dtype, **params)
    plans = {"torch": stem_indexer.stem_paged_plan([seq], [seq], backend="torch", **kw)}
    if device == "cuda" or launch.INTERPRETED:
        plans["triton"] = stem_indexer.stem_paged_plan([seq], [seq], backend="triton", **kw)
    query, key_cache, value_cache, cache, table = step
    picks = {name: stem_paged_select(query, cache, table, p) for name, p in plans.items()}
    outs = {name: stem_indexer.stem_paged_run(*step, p) for name, p in plans.items()}
    plan = plans.get("triton", plans["torch"])
    checks = {f"{name} picks = torch picks": all(torch.equal(a, b) for a, b in
                                                 zip(picks[name], picks["torch"]))
              for name in plans if name != "torch"}
    err = max(float((outs[name].float() - outs["torch"].float()).abs().max()) for name in outs)
    checks[f"outputs within 2e-2 of the torch path's (max {err:.1e})"] = err < 2e-2
    compiled = torch.compile(stem_indexer.stem_paged_run, fullgraph=True, dynamic=True)
    checks["compiled = eager"] = torch.equal(compiled(*step, plan), outs[plan.kernel])
    contiguous = stem_indexer.stem_plan([seq], [seq], num_heads=hq, num_kv_heads=hkv,
                                        head_dim=d, device=q.device, dtype=q.dtype, **params)
    fns = {"stem_run (contiguous)": lambda: stem_indexer.stem_run(q, k, v, contiguous),
           f"stem_paged_run ({plan.kernel})": lambda: stem_indexer.stem_paged_run(*step, plan)}
    if device == "cuda":
        checks["CUDA graph replay = eager"] = _graph_check(step, plan, fns)
    runs = interleaved_runs(fns, device=device, reps=reps)
    said = "; ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in checks.items())
    lines += ["", f"stem_paged_run at {seq} tokens, {PAGE}-token pages shuffled "
              f"({plan.paths[0]}; attention: {plan.attention}): {said}", "",
              "| call | ms, median [min, max] |", "|---|---|"]
    lines += [f"| {name} | {statistics.median(ms):.2f} [{min(ms):.2f}, {max(ms):.2f}] |"
              for name, ms in runs.items()]
    print("\n".join(lines[-len(runs) - 4:]), flush=True)
    return all(checks.values())


def _graph_check(step, plan, fns: dict) -> bool:
    """Capture ``stem_paged_run`` in a CUDA graph, replay it on new queries:
    equal to eager (adds the replay to ``fns``)."""
    query, rest = step[0].clone(), step[1:]
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                stem_indexer.stem_paged_run(query, *rest, plan)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = stem_indexer.stem_paged_run(query, *rest, plan)
        query.copy_(query.flip(0))
        graph.replay()
        fns["stem_paged_run graph replay"] = graph.replay
        return torch.equal(out, stem_indexer.stem_paged_run(query, *rest, plan))
    except Exception as exc:  # reported, and the check fails
        print(f"CUDA graph capture of stem_paged_run failed: {type(exc).__name__}: {exc}")
        return False


def break_even(seq: int, budgets: list[int], device: str, reps: int, lines: list[str]) -> None:
    q, k, v = _qkv(seq, device)
    _, _, _, bs, stride = _shape(device)
    lines += ["", f"## Break-even at {seq} tokens: stem_attention(dense_above=1.0, exact_tail=0)"
              " with a fixed budget against SDPA", "",
              "| budget Ks | density | sdpa ms | stem ms | sdpa / stem, median [min, max] |",
              "|---|---|---|---|---|"]
    print("\n".join(lines[-5:]), flush=True)
    points = []
    for budget in budgets:
        kw = dict(stem_block_size=bs, stem_stride=stride, k_block_num_rate_medium=0.0,
                  k_block_num_bias_medium=budget, k_block_num_rate_large=0.0,
                  k_block_num_bias_large=budget, dense_above=1.0, exact_tail=0)
        info = stem_indexer.stem_attention(q, k, v, return_info=True, **kw)[1]
        runs = interleaved_runs(
            {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True),
             "stem": lambda: stem_indexer.stem_attention(q, k, v, **kw)},
            device=device, reps=reps)
        ratio = statistics.median(a / b for a, b in zip(runs["sdpa"], runs["stem"]))
        points.append((info.density, ratio))
        lines.append(f"| {budget} | {info.density:.1%} | {statistics.median(runs['sdpa']):.2f} "
                     f"| {statistics.median(runs['stem']):.2f} | {_spread(runs, 'stem')} |")
        print(lines[-1], flush=True)
    points.sort()
    cross = [d0 + (d1 - d0) * (r0 - 1) / (r0 - r1)
             for (d0, r0), (d1, r1) in zip(points, points[1:]) if r0 >= 1 > r1]
    lines += ["", "break-even density (linear between the budgets around sdpa / stem = 1): "
              + (f"{cross[0]:.1%}" if cross else "not crossed in this sweep")]
    print(lines[-1], flush=True)


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
    lines = [f"# Stem attention against dense attention ({machine(device)})", "",
             f"git {git_sha()}, bf16, B=1, Hq={hq}, Hkv={hkv}, D={d}, causal, blocks of {bs}, "
             f"stride {stride}; times in ms, medians of {reps} turns with the calls "
             "alternating; speed-ups are sdpa / x per turn, median [min, max]"]
    ok = True
    with torch.inference_mode():
        if args.break_even:
            budgets = [int(b) for b in args.budgets.split(",")]
            break_even(args.break_even if device == "cuda" else 2048,
                       budgets if device == "cuda" else [8, 24, 40], device, reps, lines)
        else:
            lines += ["", "| tokens | density | sdpa | flex dense | indexer | sparse attn | "
                      "stem_attention | path | sdpa / sparse | E | sdpa / stem | "
                      "flex dense / stem | max err sparse / stem | triton sparse | E triton | "
                      "triton - flex | check |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
            print("\n".join(lines), flush=True)
            default = "32768,65536,131072" if device == "cuda" else "1024,2048"
            seqs = [int(s) for s in (args.seqs or default).split(",")]
            ok = all([run(seq, device, reps, lines) for seq in seqs])
            ok &= planned(seqs[-1], device, reps, lines)
            ok &= paged(seqs[-1] if device == "cuda" else 128, device, reps, lines)
    name = "gpu_break_even.md" if args.break_even else "gpu_attention.md"
    write_atomic(Path(os.environ.get("OUT", "./out")) / name, "\n".join(lines) + "\n")
    print("checks passed" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
