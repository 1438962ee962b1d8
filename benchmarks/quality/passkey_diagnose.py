r"""Why did a Stem configuration miss a passkey that dense attention found?

Runs one passkey prompt (the ``differ:`` lines of ``model_quality.py`` give
the arguments) through SmolLM2 with a Stem configuration, captures every
layer's post-RoPE q/k/v of the prefill, and recomputes that layer's
selection for the last query block (the one holding the question, whose
output produces the first answer token). Per layer it reports how many query
heads keep the key block(s) holding the needle, and for those that do not:
the needle block's rank among the row's top-k candidates (sink and window
blocks are forced, not ranked) against the row's budget K.

    python benchmarks/quality/passkey_diagnose.py --config default --length 7680 --depth 0.7143 \
        --key 48213

Prompts past the model's 8K window run on the model with its RoPE scaled x4,
as in ``model_quality.py --long``. ``--set NAME=VALUE`` changes one of the
configuration's attributes (a larger budget, say) to see what it takes:

    python benchmarks/quality/passkey_diagnose.py --length 16384 --depth 0.6 --key 43432 \
        --set k_block_num_bias_medium=50

``--trial N`` takes the key and depth of trial N of ``vllm_bench.py passkey``
(the same prompt, token for token), to ask the same of a miss in the engine:

    python benchmarks/quality/passkey_diagnose.py --length 16384 --trial 2

``--ruler-trial N`` replays trial N of ``ruler_bench.py``'s passkey task
(the same seeded prompt, token for token) on ``--model`` (``gemma3``: its
own window, Stem on its 3 global layers, the only ones reported; the
reference is ``dense-window``, exact attention through the integration):

    python benchmarks/quality/passkey_diagnose.py --model gemma3 --length 16384 --ruler-trial 10 \
        --config tight

``--dense-last-block`` runs the prompt once more with the configuration's
selection everywhere but in the last query block (the question's, whose
last position gives the first answer token), which attends to every key in
each layer Stem selects for (the configuration with ``exact_tail`` of one
block's tokens: the blocks holding the prompt's last 128), and says whether
that finds the key.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # noqa: F401  (every area's folder on sys.path)
import model_quality as mq
import stem_indexer
from stem_indexer.operator import contract
from stem_indexer.pipeline.prepare import DEFAULT_OAM_LAMBDA

def split_config(config: dict) -> tuple[contract.IndexerParams, bool]:
    """A configuration of ``model_quality.CONFIGS`` as (indexer attributes, oam)."""
    kwargs = dict(config)
    oam = kwargs.pop("oam", True)
    return contract.IndexerParams.from_kwargs("passkey_diagnose", **kwargs), oam


def span_blocks(at: int, tokens: int, block: int) -> list[int]:
    """The key blocks holding positions [at, at + tokens)."""
    return list(range(at // block, (at + tokens - 1) // block + 1))


def needle_blocks(tok, length: int, depth: float, key: int, block: int) -> list[int]:
    """The key blocks holding the needle sentence's tokens."""
    ids = mq.passkey_prompt(tok, length, depth, key)[0].tolist()
    needle = tok(mq.NEEDLE.format(key=key), add_special_tokens=False).input_ids
    for at in range(len(ids) - len(needle) + 1):
        if ids[at:at + len(needle)] == needle:
            return span_blocks(at, len(needle), block)
    raise SystemExit("the needle is not in the prompt")


def capture(fn, trial):
    """Run ``trial()`` (a passkey trial through ``fn``'s attention); returns
    (its result, {layer: (q, k, v, scale)} of the layers Stem selects for)."""
    seen = {}
    original = fn._stem

    def recording(module, query, key_, value, **kwargs):
        seen[getattr(module, "layer_idx", len(seen))] = (query, key_, value, kwargs.get("scale"))
        return original(module, query, key_, value, **kwargs)

    fn._stem = recording
    try:
        found = trial()
    finally:
        del fn._stem
    return found, seen


def ruler_passkey(model_name: str, tok, length: int, trial: int, block: int):
    """``ruler_bench.py``'s passkey trial ``trial`` at ``length`` (nominal):
    (tokens, needle blocks, run(model, impl) -> found, description)."""
    import ruler
    import ruler_bench
    gen = ruler.Generator(lambda text: tok(text, add_special_tokens=False).input_ids,
                          mq.model_prefix(model_name, tok))
    sample = gen.sample("passkey", ruler_bench.cell_length("passkey", length), trial)
    needle = tok(sample.needles[0], add_special_tokens=False).input_ids
    at = sample.at[0]
    assert sample.ids[at:at + len(needle)] == needle, "the needle's tokens are not where told"
    blocks = span_blocks(at, len(needle), block)

    def run(model, impl: str) -> bool:
        model.set_attn_implementation(impl)
        text = ruler_bench.answer(model, tok, sample.ids, sample.max_new_tokens)
        return ruler.score(sample.expected, text)
    return sample.length, blocks, run, f"RULER passkey trial {trial}, key {sample.expected[0]}"


def last_row_report(q, k, v, scale, blocks: list[int], params: contract.IndexerParams,
                    oam: bool) -> tuple[int, list, int]:
    """(heads keeping a needle block, ranks of the needle where missed, K)."""
    stride = params.stem_stride
    inputs = stem_indexer.stem_inputs(q, k, v, stem_block_size=params.stem_block_size,
                                      stem_stride=stride, scale=scale / stride, oam=oam,
                                      oam_lambda=DEFAULT_OAM_LAMBDA)
    overrides = {n: getattr(params, n) for n in contract.PARAM_NAMES}
    idx, lens = stem_indexer.stem_indexer(*inputs, **overrides)
    kb = inputs.kflat.shape[2]
    row = kb - 1
    p = torch.tensor([kb])
    budget = int(contract.row_budget(torch.tensor([row]), p, contract.prompt_budget(p, params),
                                     params.alpha)[0])
    sink_end, cand_end = (int(x) for x in contract.candidate_range(torch.tensor([kb]),
                                                                   params.initial_blocks,
                                                                   params.window_size))
    group = q.shape[1] // k.shape[1]
    kept, ranks = 0, []
    scale_1_r2 = contract.score_scale(params)
    for h in range(q.shape[1]):
        listed = set(idx[0, h, row, :int(lens[0, h, row])].tolist())
        if listed & set(blocks):
            kept += 1
            continue
        n = h // group
        scores = (inputs.qflat[0, h, row].float() @ inputs.kflat[0, n].float().T) * scale_1_r2
        scores = scores + inputs.vbias[0, n]
        cand = scores[sink_end:cand_end]
        best = max(blocks, key=lambda b: float(scores[b]))
        ranks.append(int((cand > scores[best]).sum()) + 1)
    return kept, ranks, budget


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="default", choices=[c for c in mq.CONFIGS
                                                                if c != "dense"])
    parser.add_argument("--length", type=int, default=7680)
    parser.add_argument("--depth", type=float)
    parser.add_argument("--key", type=int)
    parser.add_argument("--trial", type=int,
                        help="the key and depth of this trial of vllm_bench.py passkey")
    parser.add_argument("--ruler-trial", type=int,
                        help="the prompt of this trial of ruler_bench.py's passkey task")
    parser.add_argument("--dense-last-block", action="store_true",
                        help="also run with the last query block attending to every key")
    parser.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2",
                        help="with --ruler-trial: the model (smollm2 past 8K: RoPE x4)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override one of the configuration's attributes, e.g. "
                             "k_block_num_bias_medium=50 (repeatable)")
    parser.add_argument("--rope", choices=("yarn", "linear"), default="yarn",
                        help="RoPE scaling x4 for prompts past the model's 8K window, as "
                             "model_quality.py --long runs them")
    args = parser.parse_args(argv)
    if args.model != "smollm2" and args.ruler_trial is None:
        parser.error("--model: only with --ruler-trial")
    if args.ruler_trial is not None:
        if args.trial is not None or args.depth is not None or args.key is not None:
            parser.error("--ruler-trial makes its own prompt: give it alone")
    elif args.trial is not None:
        if args.depth is not None or args.key is not None:
            parser.error("--trial draws the key and depth: give it alone, or --depth and --key")
        from vllm_bench import passkey_draw  # its prompt is model_quality's, token for token
        args.key, args.depth = passkey_draw(args.length, args.trial)
    elif args.depth is None or args.key is None:
        parser.error("--depth and --key (or --trial) are required")
    config = dict(mq.CONFIGS[args.config])
    if config.get("exact_tail"):
        parser.error(f"--config {args.config}: its question's blocks attend to every key, so "
                     "their ranks say nothing; diagnose the configuration without the tail")
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in contract.PARAM_NAMES or not value:
            parser.error(f"--set: NAME=VALUE with NAME one of {', '.join(contract.PARAM_NAMES)}; "
                         f"got {item!r}")
        try:
            config[name] = ast.literal_eval(value)  # its range: split_config below
        except (ValueError, SyntaxError):
            parser.error(f"--set {name}: {value!r} is not a number or True/False")
    try:
        params, oam = split_config(config)
    except stem_indexer.StemIndexerInputError as err:
        parser.error(str(err))
    factor = 4.0 if args.length > 8192 and args.model == "smollm2" else None
    block = params.stem_block_size
    # --dense-last-block: the same configuration, the last block's rows exact
    tail = {"tail": {**config, "exact_tail": block}} if args.dense_last_block else {}
    if args.ruler_trial is not None:
        tok, model = mq.load_model(args.model, mq.default_dtype(), rope_factor=factor)
        names = [args.config] + (["dense-window"] if args.model == "gemma3" else [])
        fns = mq.register({**{n: config if n == args.config else mq.CONFIGS[n] for n in names},
                           **tail})
        fn = fns[args.config]
        length, blocks, run, what = ruler_passkey(args.model, tok, args.length, args.ruler_trial,
                                                  block)
        def trial(impl: str) -> bool:
            return run(model, impl)
        found, seen = capture(fn, lambda: trial(fn.name))
        reference = fns["dense-window"].name if args.model == "gemma3" else "sdpa"
        dense = run(model, reference)
    else:
        tok, model = mq.load(mq.default_dtype(), rope_factor=factor, rope=args.rope)
        fns = mq.register({args.config: config, **tail})
        fn = fns[args.config]
        length = args.length
        blocks = needle_blocks(tok, args.length, args.depth, args.key, block)
        def trial(impl: str) -> bool:
            return mq.passkey_trial(model, tok, impl, args.length, args.depth, args.key)
        found, seen = capture(fn, lambda: trial(fn.name))
        dense = mq.passkey_trial(model, tok, "sdpa", args.length, args.depth, args.key)
        what = f"depth {args.depth}, key {args.key}"
    label = " ".join([args.config, *args.set])
    print(f"{args.model} {label}, {length} tokens, {what}: needle in key block(s) {blocks} of "
          f"{-(-length // block)}; Stem {'found' if found else 'missed'} it, dense "
          f"{'found' if dense else 'missed'} it")
    print("\n| layer | query heads keeping the needle (last row) | needle rank where dropped "
          "(median, min) | row budget K |\n|---|---|---|---|")
    for layer in sorted(seen):
        q, k, v, scale = seen[layer]
        kept, ranks, budget = last_row_report(q, k, v, scale, blocks, params, oam)
        where = f"{statistics.median(ranks):g}, {min(ranks)}" if ranks else "-"
        print(f"| {layer} | {kept}/{q.shape[1]} | {where} | {budget} |")
    if args.dense_last_block:
        again = trial(fns["tail"].name)
        print(f"\nWith the last query block attending to every key: Stem "
              f"{'found' if again else 'missed'} it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
