"""``stem-indexer``: demo, verify, cases and plot.

    stem-indexer demo      the article's example on CPU, summarised
    stem-indexer verify    the case table against the reference; writes result.csv
    stem-indexer cases     list the case table
    stem-indexer plot      a PNG of one head's selected block map

Benchmarks (speed, selection quality) are scripts in the repository's
``benchmarks/`` folder, not part of the installed package.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch

from ..operator.contract import PRESETS


def _demo(args: argparse.Namespace) -> int:
    from ..operator import contract
    from ..operator.api import stem_indexer, stem_indexer_metadata

    batch, q_heads, kv_heads, d = 4, 64, 8, 128
    block, stride = 128, 16
    q_blocks, kv_blocks = 16, 64
    q_len, kv_len = q_blocks * block, kv_blocks * block
    torch.manual_seed(0)
    qflat = torch.randn(batch, q_heads, q_blocks, stride * d, dtype=torch.bfloat16)
    kflat = torch.randn(batch, kv_heads, kv_blocks, stride * d, dtype=torch.bfloat16)
    vbias = torch.randn(batch, kv_heads, kv_blocks, dtype=torch.float32)
    q_seq_lens = torch.full((batch,), q_len, dtype=torch.int32)
    kv_seq_lens = torch.full((batch,), kv_len, dtype=torch.int32)
    num_prompt_tokens = kv_seq_lens.clone()

    metadata = stem_indexer_metadata(q_seq_lens, kv_seq_lens, q_heads, kv_heads, causal=True,
                                     stem_block_size=block, dim_qkflat=stride * d,
                                     window_size=4)
    call = dict(num_prompt_tokens=num_prompt_tokens, metadata=metadata, causal=True,
                stem_block_size=block, stem_stride=stride, alpha=args.alpha,
                initial_blocks=4, window_size=4, topk_score_precision=1)
    stem_indexer(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, **call)  # warm-up
    start = time.perf_counter()
    indices, seq_len = stem_indexer(qflat, kflat, vbias, q_seq_lens, kv_seq_lens, **call)
    elapsed = time.perf_counter() - start

    visible = contract.visible_blocks(torch.arange(q_blocks), q_blocks, kv_blocks, causal=True)
    kept = seq_len.float()
    density = kept.sum() / (visible.sum() * batch * q_heads)
    print("StemIndexer demo: the article's example on CPU")
    print(f"  qflat {tuple(qflat.shape)} bf16, kflat {tuple(kflat.shape)} bf16, "
          f"vbias {tuple(vbias.shape)} fp32")
    print(f"  q {q_len} tokens ({q_blocks} blocks), kv {kv_len} tokens ({kv_blocks} blocks), "
          f"block {block}, stride {stride}, alpha {args.alpha}")
    print(f"  sparse_indices {tuple(indices.shape)} int32, sparse_seq_len "
          f"{tuple(seq_len.shape)} int32, metadata {metadata.numel()} int32")
    print(f"  blocks kept per row: min {int(kept.min())}, mean {kept.mean():.1f}, "
          f"max {int(kept.max())} (visible: {int(visible.min())}..{int(visible.max())})")
    print(f"  density: {density:.1%} of causally visible block pairs")
    row = indices[0, 0, q_blocks - 1, : int(seq_len[0, 0, q_blocks - 1])].tolist()
    print(f"  last query block of batch 0, head 0 keeps {len(row)} blocks: {row}")
    print(f"  time: {elapsed * 1e3:.1f} ms on {torch.get_num_threads()} CPU threads "
          f"(torch {torch.__version__})")
    from ..pipeline.dispatch import status
    print("  paths (stem_indexer.status()):")
    print("\n".join(f"    {line}" for line in status().splitlines()))
    return 0


def _progress(done: int, total: int, failed: int, label: str) -> None:
    """A bar redrawn in place on a terminal; a line per case in logs."""
    if not sys.stderr.isatty():
        if done:
            sys.stderr.write(f"[{done}/{total}] failed {failed}  {label}\n")
            sys.stderr.flush()
        return
    width = 30
    filled = width * done // max(total, 1)
    bar = "#" * filled + "." * (width - filled)
    sys.stderr.write(f"\r[{bar}] {done}/{total} failed {failed}  {label[:48]:<48}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _verify(args: argparse.Namespace) -> int:
    from ..testing import runner

    results, failed = [], 0
    _progress(0, len(args.selection), 0, "")
    for n, case in enumerate(args.selection, 1):
        result = runner.run_case(case, device=args.device, mode=args.mode)
        results.append(result)
        if not result.ok:
            failed += 1
            sys.stderr.write(f"\nFAIL {result.label}: {result.summary}\n")
        _progress(n, len(args.selection), failed, case.label)
    try:
        runner.write_results_csv(results, args.out)
    except OSError as exc:  # the path was checked before; it changed or the disk is full
        sys.stderr.write(f"stem-indexer verify: cannot write {args.out}: "
                         f"{exc.strerror or exc}\n")
        return 2
    print(f"{len(results) - failed} passed, {failed} failed  (results in {args.out})")
    return 1 if failed else 0


def _check_verify(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Everything ``verify`` needs, checked before any case runs."""
    from ..testing import cases, runner

    try:
        args.mode = args.mode or runner.env_mode()
        args.selection = (cases.select_cases(args.cases, include_large=args.large)
                          if args.cases else runner.env_cases(include_large=args.large))
    except (KeyError, ValueError) as exc:
        parser.error(str(exc.args[0]))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is usable here")
    _check_writable(parser, "--out", args.out)


def _check_writable(parser: argparse.ArgumentParser, option: str, path: str) -> None:
    """``path`` must name a file that can be (re)written: not a directory, not a
    device or other special file, in an existing directory where a file can be
    created (the results are written through a temporary file there)."""
    if not path:
        parser.error(f"{option}: empty path; give a file name")
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        parser.error(f"{option} {path}: is a directory; give a file name")
    if os.path.exists(path) and not os.path.isfile(path):
        parser.error(f"{option} {path}: not a regular file")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(directory):
        parser.error(f"{option} {path}: directory {directory} does not exist")
    if not os.path.isdir(directory):
        parser.error(f"{option} {path}: {directory} is not a directory")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        parser.error(f"{option} {path}: not writable")
    try:  # what the write itself will need: a new file in that directory
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".stem-indexer-probe.")
    except OSError as exc:
        parser.error(f"{option} {path}: not writable ({exc.strerror or exc})")
    os.close(fd)
    os.unlink(probe)


def _alpha(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text!r}") from None
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise argparse.ArgumentTypeError(f"must be finite with 0 < alpha <= 1; got {text}")
    return value


def _int_at_least(lo: int):
    """An argparse type: an integer >= ``lo``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer; got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}; got {value}")
        return value
    return parse


_positive = _int_at_least(1)
_nonnegative = _int_at_least(0)


def _cases(args: argparse.Namespace) -> int:
    from ..testing import cases

    for case in cases.all_cases(include_large=True):
        flag = " [large]" if case.large else ""
        print(f"{case.label}{flag}\n    {case.covers}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from . import plot

    counts = plot.plot_example(source=args.source, q_blocks=args.q_blocks,
                               kv_blocks=args.kv_blocks, block_size=args.block_size,
                               stride=args.stride, alpha=args.alpha, preset=args.preset,
                               batch=args.batch, head=args.head, seed=args.seed, path=args.out)
    kept = counts["sink"] + counts["window"] + counts["topk"]
    print(f"wrote {args.out}: batch {args.batch}, head {args.head}, kept {kept} block pairs "
          f"(sink {counts['sink']}, window {counts['window']}, top-k {counts['topk']}) "
          f"of {kept + counts['skipped']} visible")
    return 0


def _check_plot(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from . import plot

    try:
        plot.check_example(source=args.source, q_blocks=args.q_blocks,
                           kv_blocks=args.kv_blocks, block_size=args.block_size,
                           stride=args.stride, batch=args.batch, head=args.head)
    except (ImportError, ValueError) as exc:
        parser.error(str(exc))
    _check_writable(parser, "--out", args.out)


def _parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="stem-indexer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"stem-indexer {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the article's example on CPU")
    demo.add_argument("--alpha", type=_alpha, default=1.0, help="TPD decay end, in (0, 1]")
    demo.set_defaults(func=_demo, check=None, parser=demo)

    verify = sub.add_parser("verify", help="check the case table against the reference")
    verify.add_argument("--cases", help="comma-separated ids (default: STEM_INDEXER_CASE_ID "
                                        "or the whole table)")
    verify.add_argument("--large", action="store_true", help="include the large cases")
    verify.add_argument("--mode", choices=("eager", "graph"), default=None,
                        help="default: STEM_INDEXER_MODE, else eager")
    verify.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    verify.add_argument("--out", default="result.csv", help="where to write the results")
    verify.set_defaults(func=_verify, check=_check_verify, parser=verify)

    listing = sub.add_parser("cases", help="list the case table")
    listing.set_defaults(func=_cases, check=None, parser=listing)

    picture = sub.add_parser("plot", help="draw one head's selected block map to a PNG")
    picture.add_argument("--source", choices=("random", "synthetic"), default="synthetic",
                         help="Q/K/V with planted needles (default) or random block "
                              "representations in the article's example shape")
    picture.add_argument("--q-blocks", type=_positive, default=128, help="query blocks")
    picture.add_argument("--kv-blocks", type=_positive, default=128, help="key blocks")
    picture.add_argument("--block-size", type=_positive, default=128)
    picture.add_argument("--stride", type=_positive, default=16)
    picture.add_argument("--alpha", type=_alpha, default=1.0, help="TPD decay end, in (0, 1]")
    picture.add_argument("--preset", choices=tuple(PRESETS), default="tight",
                         help="the budget (stem_indexer.PRESETS; every preset keeps every "
                              "block below 56 prompt blocks)")
    picture.add_argument("--batch", type=_nonnegative, default=0, help="batch to draw")
    picture.add_argument("--head", type=_nonnegative, default=0, help="query head to draw")
    picture.add_argument("--seed", type=int, default=0)
    picture.add_argument("--out", default="stem_block_map.png", help="PNG path")
    picture.set_defaults(func=_plot, check=_check_plot, parser=picture)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.check is not None:
        args.check(args.parser, args)  # usage errors exit 2 before any work
    try:
        return args.func(args)
    except BrokenPipeError:  # e.g. `stem-indexer cases | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
