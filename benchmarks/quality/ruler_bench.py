"""RULER-style retrieval (``benchmarks/quality/ruler.py``) and long-text perplexity,
dense attention against Stem's presets, on a real model; resumable.

    python benchmarks/quality/ruler_bench.py --model gemma3                 # the planned cells
    python benchmarks/quality/ruler_bench.py --model gemma3 --lengths 8K --tasks passkey \\
        --trials 2 --configs dense,default                          # a short look
    python benchmarks/quality/ruler_bench.py --model smollm2                # 16K, RoPE x4 (YaRN)
    python benchmarks/quality/ruler_bench.py --model gemma3 --perplexity 2 --lengths 16K,32K
    python benchmarks/quality/ruler_bench.py --table                        # QUALITY.md's tables

Models (``model_quality.load_model``): ``gemma3``, Gemma-3-270M (base,
Q4_K_M) in its own 32K window, nothing scaled: a 32K cell is 32,720 tokens,
so that the longest answer still fits the 32,768 positions; every prompt
starts with its BOS token. ``smollm2``, SmolLM2-135M-Instruct with its RoPE
scaled x4 by YaRN (a 32K window), as in ``model_quality.py --long``.

Every trial is appended to the results file (default
``benchmarks/results/ruler_results.jsonl``) as one JSON line: model, task, length,
config, trial, seed, found, answer, seconds, and what else it saw (the
filler, the expected values; for Stem configurations the density of the
call's sparse layers and the paths it took, ``paths``; the git commit, the
load average).
A run skips every (model, task, length, config, trial) already there, so it
can stop at any point (``--stop-after``, or killed: a torn last line is
ignored) and resume later. The same seeded prompt goes to every
configuration of a trial, dense first.

``--perplexity N``: N disjoint windows of the Python documentation's text
(``pydoc_data.topics``) per length instead of the retrieval tasks, each a JSON
line with its summed next-token NLL; the table gives each configuration's
perplexity and its change against dense over the windows both have run.

The dense reference is ``dense-window`` (``model_quality.CONFIGS``): exact
attention in every layer, through the integration, so that the full-attention
layers make dense's SDPA call and the sliding-window layers (Gemma's 15 of
18) run at window cost, as they do in every Stem configuration: the same
result as SDPA with the sliding mask (``tests/test_window.py``) at a
fraction of the time (one 8K passkey trial: 12 s against 45 s on two Zen 4
cores). So the only difference between the reference and a preset is the
full-attention layers' selection. ``dense`` (transformers' SDPA with its
masks, the whole causal square in every layer) may be run too; the tables
compare against ``dense-window`` where a cell has it, else ``dense``.

``--table`` prints the tables from the file: successes / trials with the
Wilson 95% interval and the trial count of each cell, per model and length;
``(dense)`` marks a Stem cell none of whose calls ran sparse (below 56
blocks every budget keeps every block, and a budget keeping more than
``dense_above`` of the block pairs, ``contract.DENSE_ABOVE`` for the device
and dtype, runs dense attention; ``default-sparse`` is the default budget's
selection whatever it keeps).
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # every area's folder on sys.path
import model_quality as mq
import ruler
from common import git_sha, machine
from trials import append, read, wilson_cell

RESULTS = areas.RESULTS / "ruler_results.jsonl"
# Trials per task and cell (length: trials), the planned run of each model.
TRIALS = {"gemma3": {8192: 10, 16384: 30, 32768: 20}, "smollm2": {16384: 20}}
DEFAULT_CONFIGS = ("dense-window", "default", "tight")
REFERENCES = ("dense-window", "dense")  # exact attention, the preferred reference first
MAX_POSITIONS = 32768  # both models' windows (SmolLM2's once scaled x4)
TITLES = {"gemma3": "Gemma-3-270M (base, Q4_K_M), its own 32K window",
          "smollm2": "SmolLM2-135M-Instruct, RoPE scaled x4 (YaRN)"}
KEY = ("model", "task", "length", "config", "trial")
SPARSE_PATHS = ("stem", "stem-rotated")  # the integration's stats of a sparse call


class Trial(NamedTuple):
    model: str
    task: str
    length: int
    config: str
    trial: int


def cell_length(task: str, nominal: int) -> int:
    """The prompt's tokens for a cell of ``nominal`` tokens: room left within
    the window for the longest answer (perplexity needs none)."""
    if task == "perplexity":
        return min(nominal, MAX_POSITIONS)
    return min(nominal, MAX_POSITIONS - max(ruler.ANSWER_TOKENS.values()) - 8)


# --------------------------------------------------------------------------- #
# The results file
# --------------------------------------------------------------------------- #


def column(row: dict) -> str:
    """The row's task as the tables and ``--tasks`` name it: ``task``, or
    ``task@filler`` for a filler other than the task's own."""
    task, filler = row["task"], row.get("filler")
    return task if filler in (None, ruler.TASK_FILLER.get(task)) else f"{task}@{filler}"


def key(row: dict) -> tuple:
    return tuple(column(row) if k == "task" else row[k] for k in KEY)


def done_keys(rows: list[dict]) -> set[tuple]:
    return {key(row) for row in rows}


def plan(model: str, tasks, trials: dict[int, int], configs, done: set[tuple],
         first: int = 0) -> list[Trial]:
    """What is left to run, trial after trial (every task and configuration of
    one trial together), so that a stopped run leaves even cells; trials
    ``first`` to ``count - 1`` of each cell."""
    out = []
    for nominal, count in trials.items():
        for trial in range(first, count):
            for task in tasks:
                length = cell_length(task, nominal)
                out += [t for config in configs
                        if (t := Trial(model, task, length, config, trial)) not in done]
    return out


# --------------------------------------------------------------------------- #
# Running
# --------------------------------------------------------------------------- #


def answer(model, tok, ids: list[int], max_new_tokens: int) -> str:
    """The greedy continuation (the prefill keeps only the last position's logits)."""
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, logits_to_keep=1,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id or 0)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def run(args, todo: list[Trial], echo) -> int:
    import torch
    dtype = mq.default_dtype()
    tok, model = mq.load_model(args.model, dtype,
                               rope_factor=4.0 if args.model == "smollm2" else None)
    names = sorted({t.config for t in todo}, key=lambda n: n not in REFERENCES)
    fns = mq.register({n: mq.CONFIGS[n] for n in names})
    prefix = mq.model_prefix(args.model, tok)
    gens: dict[str, ruler.Generator] = {}
    echo(f"{machine()}; {args.model} in {dtype}; {len(todo)} trials to run")
    common = dict(git=git_sha(), dtype=str(dtype).replace("torch.", ""))
    windows: dict[int, list] = {}
    started, count = time.perf_counter(), 0
    for t in todo:
        if args.stop_after and time.perf_counter() - started > args.stop_after:
            echo(f"stopping after {args.stop_after} s: {len(todo) - count} trials left")
            break
        model.set_attn_implementation(mq._impl(fns, t.config))
        if t.config in fns:
            fns[t.config].reset_stats()
        seed = args.seed * 100_000 + t.trial
        row = dict(t._asdict(), seed=seed, **common)
        begin = time.perf_counter()
        if t.task == "perplexity":
            if t.length not in windows:
                windows[t.length] = mq.text_windows(tok, t.length, args.perplexity, prefix)
            with torch.no_grad():
                nll, _ = mq._scores(model, windows[t.length][t.trial], mq.lm_rows(model))
            row.update(nll=nll, tokens=t.length - 1)
        else:
            task, _, filler = t.task.partition("@")
            if filler not in gens:
                gens[filler] = ruler.Generator(
                    lambda text: tok(text, add_special_tokens=False).input_ids, prefix,
                    filler=filler or None)
            sample = gens[filler].sample(task, t.length, seed)
            text = answer(model, tok, sample.ids, sample.max_new_tokens)
            row.update(task=task, filler=sample.filler, found=ruler.score(sample.expected, text),
                       answer=text, expected=list(sample.expected))
            if task == "vartrack":
                row["exact"] = ruler.exact_names(sample.expected, text)
        row["seconds"] = round(time.perf_counter() - begin, 2)
        if t.config in fns:
            fn = fns[t.config]
            row["density"] = (round(fn.kept_pairs / fn.visible_pairs, 4)
                              if fn.visible_pairs else None)
            row["paths"] = dict(fn.stats)
        row["load"] = round(os.getloadavg()[0], 2)
        append(args.results, row)
        count += 1
        echo(f"{t.task} {t.length} {t.config} trial {t.trial}: "
             + (f"nll/token {row['nll'] / row['tokens']:.4f}" if t.task == "perplexity"
                else f"{'found' if row['found'] else 'missed'} {row['answer']!r}")
             + f" ({row['seconds']:.0f} s)")
    return count


# --------------------------------------------------------------------------- #
# Tables
# --------------------------------------------------------------------------- #


def _order(configs) -> list[str]:
    known = list(mq.CONFIGS)
    return sorted(configs, key=lambda c: (known.index(c) if c in known else len(known), c))


def _k(length: int) -> str:
    return f"{round(length / 1024)}K"


def tables(rows: list[dict]) -> list[str]:
    """Markdown tables of the rows: per model and length, successes / trials
    [Wilson 95%] per configuration and task (with the mean seconds of a
    trial); then perplexity as the change against dense."""
    rows = list({key(r): r for r in rows}.values())  # last one wins
    lines = []
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        retrieval = [r for r in mine if r["task"] != "perplexity"]
        for length in sorted({r["length"] for r in retrieval}):
            cell = collections.defaultdict(list)
            for r in retrieval:
                if r["length"] == length:
                    cell[r["config"], column(r)].append(r)
            tasks = sorted({k[1] for k in cell}, key=lambda c: (
                ruler.TASKS.index(c.partition("@")[0]), c))
            configs = _order({k[0] for k in cell})
            lines += ["", f"{TITLES.get(model, model)}, {_k(length)} ({length:,} tokens): "
                      "successes / trials [Wilson 95%]", "",
                      "| configuration | " + " | ".join(tasks) + " | s / trial |",
                      "|---|" + "---|" * (len(tasks) + 1)]
            for config in configs:
                cells, seconds = [], []
                for task in tasks:
                    got = cell.get((config, task), [])
                    k, n = sum(bool(r["found"]) for r in got), len(got)
                    note = ""
                    if config not in REFERENCES and n and not any(
                            r.get("paths", {}).get(p) for r in got for p in SPARSE_PATHS):
                        note = " (dense)"  # stem_attention ran dense attention in every layer
                    cells.append(wilson_cell(k, n) + note)
                    seconds += [r["seconds"] for r in got]
                mean = f"{sum(seconds) / len(seconds):.0f}" if seconds else "-"
                lines.append(f"| {config} | " + " | ".join(cells) + f" | {mean} |")
        ppl = [r for r in mine if r["task"] == "perplexity"]
        if ppl:
            lengths = sorted({r["length"] for r in ppl})
            by = {(r["config"], r["length"], r["trial"]): r for r in ppl}
            lines += ["", f"{TITLES.get(model, model)}: perplexity of the Python documentation "
                      "(change against the dense reference over the windows both ran; windows)", "",
                      "| configuration | " + " | ".join(_k(n) for n in lengths) + " |",
                      "|---|" + "---|" * len(lengths)]
            for config in _order({r["config"] for r in ppl}):
                cells = []
                for n in lengths:
                    ref = next((c for c in REFERENCES
                                if any(k[0] == c and k[1] == n for k in by)), None)
                    wins = sorted(w for c, m, w in by if c == config and m == n
                                  and (ref, n, w) in by)
                    if not wins:
                        cells.append("-")
                        continue

                    def value(c):
                        return math.exp(sum(by[c, n, w]["nll"] for w in wins)
                                        / sum(by[c, n, w]["tokens"] for w in wins))
                    p, d = value(config), value(ref)
                    count = f"{len(wins)} window{'s' if len(wins) > 1 else ''}"
                    cells.append(f"{p:.3f} ({p / d - 1:+.2%} against {ref}; {count})"
                                 if config != ref else f"{p:.3f} ({count})")
                lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return lines


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def _length(text: str) -> int:
    text = text.strip().upper()
    return int(text[:-1]) * 1024 if text.endswith("K") else int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=mq.MODELS, default="gemma3")
    parser.add_argument("--tasks", default=",".join(ruler.TASKS),
                        help=f"comma-separated, from {', '.join(ruler.TASKS)}; TASK@zen or "
                             "TASK@docs: with that filler instead of the task's own")
    parser.add_argument("--lengths", help="comma-separated (8K or 8192); default the model's "
                        f"planned cells ({TRIALS})")
    parser.add_argument("--trials", type=int,
                        help="trials per task and cell (default: the planned count per length)")
    parser.add_argument("--first-trial", type=int, default=0, metavar="N",
                        help="start at trial N, so that two processes can share one cell "
                             "(one with --trials N, the other with --first-trial N)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated, from {', '.join(mq.CONFIGS)}")
    parser.add_argument("--perplexity", type=int, default=0, metavar="N",
                        help="N perplexity windows per length instead of the retrieval tasks")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--seed", type=int, default=0,
                        help="the prompts' seed (trials are keyed by number: one seed a file)")
    parser.add_argument("--stop-after", type=float, default=0, metavar="SECONDS",
                        help="start no trial after this long (0: run everything left)")
    parser.add_argument("--table", action="store_true", help="print the tables and stop")
    args = parser.parse_args(argv)
    if args.table:
        print("\n".join(tables(read(args.results))).strip())
        return 0
    tasks = [t.strip() for t in args.tasks.split(",")]
    configs = [c.strip() for c in args.configs.split(",")]
    if any(t.partition("@")[0] not in ruler.TASKS
           or t.partition("@")[2] not in ("", *ruler.FILLERS) for t in tasks):
        parser.error(f"--tasks: choose from {ruler.TASKS}, each with @zen or @docs for "
                     f"another filler; got {tasks}")
    if any(c not in mq.CONFIGS for c in configs):
        parser.error(f"--configs: choose from {list(mq.CONFIGS)}; got {configs}")
    try:
        lengths = ([_length(x) for x in args.lengths.split(",")] if args.lengths
                   else list(TRIALS[args.model]))
    except ValueError:
        parser.error("--lengths: comma-separated token counts (8192 or 8K)")
    if not all(1024 <= n <= MAX_POSITIONS for n in lengths):
        parser.error(f"--lengths: each from 1K to {MAX_POSITIONS} tokens (the window)")
    if args.trials is not None and args.trials < 1:
        parser.error("--trials must be >= 1")
    if args.perplexity < 0:
        parser.error("--perplexity must be >= 0")
    if args.perplexity:
        tasks, trials = ["perplexity"], {n: args.perplexity for n in lengths}
    else:
        trials = {n: args.trials or TRIALS[args.model].get(n, 10) for n in lengths}
    if not 0 <= args.first_trial < min(trials.values()):
        parser.error(f"--first-trial must be >= 0 and below each cell's trial count "
                     f"({min(trials.values())}); got {args.first_trial}")
    started = time.perf_counter()

    def echo(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {text}", flush=True)

    todo = plan(args.model, tasks, trials, configs, done_keys(read(args.results)),
                first=args.first_trial)
    if not todo:
        echo("every trial asked for is in the results file")
        return 0
    count = run(args, todo, echo)
    echo(f"{count} trials appended to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
