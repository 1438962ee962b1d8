"""Time to first token of a whole model, dense SDPA against every Stem preset,
side by side at each length, in alternating turns; resumable.

    python benchmarks/attention/ttft_bench.py --model smollm2 --lengths 2K,4K,8K,16K,32K --reps 3
    python benchmarks/attention/ttft_bench.py --table                  # the table from the file

Each turn is one prefill (``logits_to_keep=1``: the first token's logits)
of every configuration on the same random token ids, the configurations in
an order that rotates from turn to turn; one warm-up call per configuration
at the run's shortest length (8K at most) comes first. A turn's times are appended to the
results file (default ``benchmarks/results/ttft_results.jsonl``) as one JSON line,
with the machine, the git commit, the load average and, per Stem
configuration, what its calls ran (``paths``: ``stem``, ``window``,
``dense:<reason>``) and the density of its sparse calls. A run skips the
turns the file already holds (model, dtype, length, turn), so a long one can
stop and resume; ratios are only ever taken within a turn.

``--table``: per model, dtype, machine and length, each configuration's
median seconds and dense / configuration as the median and [min, max] of
the per-turn ratios, with the paths its calls took. A Stem configuration
whose calls all stepped aside (``dense:...``) runs SDPA itself: its ratio
is the noise of the machine between two identical computations.

Models as in ``ruler_bench.py``: ``smollm2`` with its RoPE scaled x4 by YaRN
(a 32K window; a "32K" length is 32,752 tokens), ``gemma3`` in its own 32K
window (its sliding-window layers take the windowed path under every Stem
configuration, and SDPA's masked square under dense). To time Stem's
selection alone there, start ``--configs`` with ``dense-window`` (exact
attention through the integration: SDPA in the global layers, the windowed
path in the sliding ones); the ratios are then against it:

    python benchmarks/attention/ttft_bench.py --model gemma3 --lengths 8K,16K \
        --configs dense-window,default,balanced,tight
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # every area's folder on sys.path
import model_quality as mq
from common import git_sha, machine
from trials import append, read

RESULTS = areas.RESULTS / "ttft_results.jsonl"
CONFIGS = ("dense", "default", "balanced", "tight")
BASELINES = ("dense", "dense-window")  # what --configs may start with
WINDOW = 32768 - 16  # the longest prompt, with room for the answer's positions
WARM_UP = 8192  # tokens of the warm-up calls, at most


def length_arg(text: str) -> int:
    text = text.strip().upper()
    value = int(text[:-1]) * 1024 if text.endswith("K") else int(text)
    if not 1 <= value:
        raise ValueError(text)
    return min(value, WINDOW)


def run(args, echo=print) -> int:
    import torch

    dtype = mq.default_dtype()
    key = dict(model=args.model, dtype=str(dtype).replace("torch.", ""))
    done = {(r["length"], r["turn"]) for r in read(args.results)
            if all(r.get(k) == v for k, v in key.items()) and r.get("configs") == args.configs}
    todo = [(n, t) for n in args.lengths for t in range(args.reps) if (n, t) not in done]
    if not todo:
        echo("every turn is in the results file")
        return 0
    tok, model = mq.load_model(args.model, dtype,
                               rope_factor=4.0 if args.model == "smollm2" else None)
    fns = mq.register({n: mq.CONFIGS[n] for n in args.configs if n != "dense"})
    gen = torch.Generator().manual_seed(0)

    def prefill(name: str, ids) -> float:
        model.set_attn_implementation(mq._impl(fns, name))
        start = time.perf_counter()
        with torch.no_grad():
            model(ids, logits_to_keep=1)
        return time.perf_counter() - start

    # One-off costs (kernels loaded, workspaces sized) paid before the first
    # turn, at a length where every preset runs sparse but which costs seconds.
    warm = torch.randint(100, 10000, (1, min(min(args.lengths), WARM_UP)), generator=gen)
    for name in args.configs:
        prefill(name, warm)
    echo(f"{machine()}; {args.model} in {dtype}; {len(todo)} turns to run")
    for length, turn in todo:
        ids = torch.randint(100, 10000, (1, length), generator=gen)
        order = args.configs[turn % len(args.configs):] + args.configs[:turn % len(args.configs)]
        row = dict(key, length=length, turn=turn, configs=args.configs, seconds={}, paths={},
                   density={}, machine=machine(), git=git_sha())
        for name in order:
            if name in fns:
                fns[name].reset_stats()
            row["seconds"][name] = round(prefill(name, ids), 3)
            if name in fns:
                fn = fns[name]
                row["paths"][name] = dict(fn.stats)
                row["density"][name] = (round(fn.kept_pairs / fn.visible_pairs, 4)
                                        if fn.visible_pairs else None)
        row["load"] = round(os.getloadavg()[0], 2)
        append(args.results, row)
        echo(f"{length} turn {turn}: " + ", ".join(f"{n} {s:.1f} s"
                                                   for n, s in row["seconds"].items()))
    return len(todo)


def table(rows: list[dict]) -> list[str]:
    """The side-by-side tables, one per (model, dtype, machine, configurations);
    the ratios are against the first configuration (the baseline)."""
    lines = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["dtype"], r["machine"], tuple(r["configs"])),
                          []).append(r)
    for (model, dtype, where, configs), group in groups.items():
        base = configs[0]
        lines += [f"{model}, {dtype}; {where}", "",
                  "| tokens | turns | " + " | ".join(f"{c} s" for c in configs)
                  + " | " + " | ".join(f"{base} / {c}, median [min, max]"
                                       for c in configs[1:])
                  + " | paths of the Stem calls |",
                  "|---|---|" + "---|" * (2 * len(configs) - 1) + "---|"]
        for length in sorted({r["length"] for r in group}):
            turns = [r for r in group if r["length"] == length]
            cells = [f"{statistics.median(r['seconds'][c] for r in turns):.2f}" for c in configs]
            for c in configs[1:]:
                ratios = [r["seconds"][base] / r["seconds"][c] for r in turns]
                cells.append(f"{statistics.median(ratios):.2f}x "
                             f"[{min(ratios):.2f}, {max(ratios):.2f}]")
            paths = []
            for c in configs[1:]:
                seen = sorted({p for r in turns for p in r["paths"].get(c, {})})
                dens = [r["density"][c] for r in turns if r["density"].get(c) is not None]
                paths.append(f"{c}: {'+'.join(seen) or '-'}"
                             + (f" ({statistics.median(dens):.0%})" if dens else ""))
            lines.append(f"| {length} | {len(turns)} | " + " | ".join(cells) + " | "
                         + "; ".join(paths) + " |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=mq.MODELS, default="smollm2")
    parser.add_argument("--lengths", default="2K,4K,8K,16K,32K",
                        help="comma-separated token counts (8K or 8192)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="the baseline first (dense, or dense-window: exact "
                             "attention through the integration), then names of "
                             "model_quality.CONFIGS")
    parser.add_argument("--reps", type=int, default=3, help="turns per length")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--table", action="store_true", help="print the table and stop")
    args = parser.parse_args(argv)
    if args.table:
        print("\n".join(table(read(args.results))))
        return 0
    try:
        args.lengths = sorted({length_arg(x) for x in args.lengths.split(",") if x.strip()})
    except ValueError:
        parser.error(f"--lengths: positive token counts such as 8K or 8192; got {args.lengths!r}")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in mq.CONFIGS]
    if unknown or not args.configs or args.configs[0] not in BASELINES:
        parser.error(f"--configs: {' or '.join(BASELINES)} first, then names of "
                     f"{list(mq.CONFIGS)}; got {args.configs}")
    if args.reps < 1:
        parser.error(f"--reps must be >= 1; got {args.reps}")
    if not args.lengths:
        parser.error("--lengths: at least one length")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
