"""Selection quality against dense attention: density, mass recall, output error, needles.

The measures and workloads are ``stem_indexer.testing.quality``'s; this script
runs them over the default configurations (OAM on/off x alpha 1.0/0.7/0.5 at
the P/8 budget, and the operator's default budget) and prints a markdown
table, optionally appended to a markdown file with the command, machine and
git sha.

    python benchmarks/quality/quality.py                       # 2K tokens, about a minute
    python benchmarks/quality/quality.py --record benchmarks/QUALITY.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # noqa: F401  (every area's folder on sys.path)
from common import git_sha, machine, write_atomic
from stem_indexer.testing.quality import (EvalConfig, EvalRow, Workload, evaluate,
                                          llama_workload, synthetic_workload)


def markdown_table(rows: Sequence[EvalRow]) -> str:
    """The rows as a markdown table, one line per (workload, configuration)."""

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    lines = ["| input | budget | OAM | alpha | density | mass recall | rel. L2 error "
             "| max abs error | attention-needle recall | value-needle recall |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = r.config
        lines.append(
            f"| {r.workload} | {c.budget.name} | {'on' if c.oam else 'off'} | {c.alpha:g} "
            f"| {pct(r.density)} | {pct(r.mass_recall)} | {r.rel_l2:.4f} | {r.max_abs:.4f} "
            f"| {pct(r.attention_needle_recall)} | {pct(r.value_needle_recall)} |")
    return "\n".join(lines)


def _versions() -> str:
    versions = [f"torch {torch.__version__}"]
    try:
        import transformers
        versions.append(f"transformers {transformers.__version__}")
    except ImportError:
        pass
    return ", ".join(versions)


def record_markdown(rows: Sequence[EvalRow], workloads: Sequence[Workload], path: Path,
                    command: str, seconds: float) -> None:
    """Write the table with the command, the inputs, machine, versions and git sha."""
    shapes = "\n".join(f"- {w.description}; block {w.block_size}, stride {w.stride}"
                       for w in workloads)
    text = f"""
## Selection quality on synthetic attention

Produced by `{command}` in {seconds:.0f} s.

- machine: {machine()}; {_versions()}
- git: {git_sha()}

Inputs:

{shapes}

Budgets: `P/8` is rates 0.125 and biases 0 (Ks = P/8, about the default
budget's share at 128K tokens, 132 of 1024 blocks); `default` is the operator's
default (rates 0.2/0.1, biases 30), which at these small sizes keeps almost
every block. All rows: 4 sink and 4 window blocks, OAM lambda 0.3.

{markdown_table(rows)}

Columns: density = kept block pairs / causally visible block pairs; mass
recall = the share of each query's dense softmax mass inside its kept blocks
(mean over queries and heads); rel. L2 / max abs error = block-sparse output
against dense attention; needle recall = planted (query block, key block)
pairs kept.
"""
    write_atomic(path, text, append=True)


def run(*, seq_len: int = 2048, block_size: int = 32, stride: int = 8, seed: int = 0,
        llama: bool = True, configs: Sequence[EvalConfig] | None = None,
        out=None) -> tuple[list[Workload], list[EvalRow]]:
    """Build the workloads, evaluate them and print the table to ``out``."""
    out = sys.stdout if out is None else out
    workloads = [synthetic_workload(seq_len=seq_len, block_size=block_size, stride=stride,
                                    seed=seed)]
    if llama:
        workloads.append(llama_workload(seq_len=seq_len, block_size=block_size, stride=stride,
                                        seed=seed))
    rows = evaluate(workloads, configs)
    for w in workloads:
        print(f"- {w.description}; block {w.block_size}, stride {w.stride}", file=out)
    print(file=out)
    print(markdown_table(rows), file=out)
    return workloads, rows


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=_positive, default=2048, help="tokens per sequence")
    parser.add_argument("--block-size", type=_positive, default=32,
                        help="Stem block size (small, for small shapes)")
    parser.add_argument("--stride", type=_positive, default=8, help="Stem stride")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-llama", action="store_true",
                        help="skip the tiny Llama workload (needs transformers)")
    parser.add_argument("--record", metavar="PATH", type=Path,
                        help="also append the table, command, machine and git sha to PATH")
    args = parser.parse_args(argv)
    if args.block_size % args.stride:
        parser.error(f"--block-size ({args.block_size}) must be a multiple of --stride "
                     f"({args.stride})")
    if args.record is not None and not args.record.parent.is_dir():
        parser.error(f"--record: directory {args.record.parent} does not exist")
    start = time.perf_counter()
    try:
        workloads, rows = run(seq_len=args.seq_len, block_size=args.block_size,
                              stride=args.stride, seed=args.seed, llama=not args.no_llama)
    except (ImportError, ValueError) as exc:
        parser.error(str(exc))
    seconds = time.perf_counter() - start
    print(f"\n({seconds:.1f} s on {torch.get_num_threads()} CPU threads)")
    if args.record:
        command = "python benchmarks/quality/quality.py " + " ".join(
            sys.argv[1:] if argv is None else argv)
        record_markdown(rows, workloads, args.record, command, seconds)
        print(f"recorded in {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
