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
import sys
import time

import torch


def _demo(args: argparse.Namespace) -> int:
    from . import contract, stem_indexer, stem_indexer_metadata

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
    from .ops import native
    print(f"  selection: {native.status()}")
    return 0


def _progress(done: int, total: int, failed: int, label: str) -> None:
    if not sys.stderr.isatty():
        return  # a bar redrawn with carriage returns only clutters logs
    width = 30
    filled = width * done // max(total, 1)
    bar = "#" * filled + "." * (width - filled)
    sys.stderr.write(f"\r[{bar}] {done}/{total} failed {failed}  {label[:48]:<48}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _verify(args: argparse.Namespace) -> int:
    from .testing import cases, runner

    selection = (cases.select_cases(args.cases, include_large=args.large) if args.cases
                 else runner.env_cases(include_large=args.large))
    results, failed = [], 0
    _progress(0, len(selection), 0, "")
    for n, case in enumerate(selection, 1):
        result = runner.run_case(case, device=args.device, mode=args.mode or runner.env_mode())
        results.append(result)
        if not result.ok:
            failed += 1
            sys.stderr.write(f"\nFAIL {result.label}: {result.summary}\n")
        _progress(n, len(selection), failed, case.label)
    runner.write_results_csv(results, args.out)
    print(f"{len(results) - failed} passed, {failed} failed  (results in {args.out})")
    return 1 if failed else 0


def _cases(args: argparse.Namespace) -> int:
    from .testing import cases

    for case in cases.all_cases(include_large=True):
        flag = " [large]" if case.large else ""
        print(f"{case.label}{flag}\n    {case.covers}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from . import plot

    try:
        counts = plot.plot_example(source=args.source, q_blocks=args.q_blocks,
                                   kv_blocks=args.kv_blocks, block_size=args.block_size,
                                   stride=args.stride, alpha=args.alpha, budget=args.budget,
                                   batch=args.batch, head=args.head, seed=args.seed,
                                   path=args.out)
    except (ImportError, ValueError) as exc:
        print(f"stem-indexer plot: error: {exc}", file=sys.stderr)
        return 2
    kept = counts["sink"] + counts["window"] + counts["topk"]
    print(f"wrote {args.out}: batch {args.batch}, head {args.head}, kept {kept} block pairs "
          f"(sink {counts['sink']}, window {counts['window']}, top-k {counts['topk']}) "
          f"of {kept + counts['skipped']} visible")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stem-indexer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the article's example on CPU")
    demo.add_argument("--alpha", type=float, default=1.0, help="TPD decay end (0, 1]")
    demo.set_defaults(func=_demo)

    verify = sub.add_parser("verify", help="check the case table against the reference")
    verify.add_argument("--cases", help="comma-separated ids (default: STEM_INDEXER_CASE_ID "
                                        "or the whole table)")
    verify.add_argument("--large", action="store_true", help="include the large cases")
    verify.add_argument("--mode", choices=("eager", "graph"), default=None,
                        help="default: STEM_INDEXER_MODE, else eager")
    verify.add_argument("--device", default="cpu", help="cpu or cuda")
    verify.add_argument("--out", default="result.csv", help="where to write the results")
    verify.set_defaults(func=_verify)

    listing = sub.add_parser("cases", help="list the case table")
    listing.set_defaults(func=_cases)

    picture = sub.add_parser("plot", help="draw one head's selected block map to a PNG")
    picture.add_argument("--source", choices=("random", "synthetic"), default="random",
                         help="random block representations (the article's example) or "
                              "Q/K/V with planted needles (the eval's synthetic workload)")
    picture.add_argument("--q-blocks", type=int, default=16, help="query blocks")
    picture.add_argument("--kv-blocks", type=int, default=64, help="key blocks")
    picture.add_argument("--block-size", type=int, default=128)
    picture.add_argument("--stride", type=int, default=16)
    picture.add_argument("--alpha", type=float, default=1.0, help="TPD decay end (0, 1]")
    picture.add_argument("--budget", choices=("default", "tight"), default="default",
                         help="the operator's budget, or Ks = P/8 for small shapes")
    picture.add_argument("--batch", type=int, default=0, help="batch to draw")
    picture.add_argument("--head", type=int, default=0, help="query head to draw")
    picture.add_argument("--seed", type=int, default=0)
    picture.add_argument("--out", default="stem_block_map.png", help="PNG path")
    picture.set_defaults(func=_plot)

    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # e.g. `stem-indexer cases | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
