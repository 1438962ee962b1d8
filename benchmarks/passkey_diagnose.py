r"""Why did a Stem configuration miss a passkey that dense attention found?

Runs one passkey prompt (the ``differ:`` lines of ``model_quality.py`` give
the arguments) through SmolLM2 with a Stem configuration, captures every
layer's post-RoPE q/k/v of the prefill, and recomputes that layer's
selection for the last query block (the one holding the question, whose
output produces the first answer token). Per layer it reports how many query
heads keep the key block(s) holding the needle, and for those that do not:
the needle block's rank among the row's top-k candidates (sink and window
blocks are forced, not ranked) against the row's budget K.

    python benchmarks/passkey_diagnose.py --config default --length 7680 --depth 0.7143 --key 48213

Prompts past the model's 8K window run on the model with its RoPE scaled x4,
as in ``model_quality.py --long``. ``--set NAME=VALUE`` changes one of the
configuration's attributes (a larger budget, say) to see what it takes:

    python benchmarks/passkey_diagnose.py --length 16384 --depth 0.6 --key 43432 \
        --set k_block_num_bias_medium=50

``--trial N`` takes the key and depth of trial N of ``vllm_bench.py passkey``
(the same prompt, token for token), to ask the same of a miss in the engine:

    python benchmarks/passkey_diagnose.py --length 16384 --trial 2
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys

import torch

import model_quality as mq
import stem_indexer
from stem_indexer import contract
from stem_indexer.prepare import DEFAULT_OAM_LAMBDA

def split_config(config: dict) -> tuple[contract.IndexerParams, bool]:
    """A configuration of ``model_quality.CONFIGS`` as (indexer attributes, oam)."""
    kwargs = dict(config)
    oam = kwargs.pop("oam", True)
    return contract.IndexerParams.from_kwargs("passkey_diagnose", **kwargs), oam


def needle_blocks(tok, length: int, depth: float, key: int, block: int) -> list[int]:
    """The key blocks holding the needle sentence's tokens."""
    ids = mq.passkey_prompt(tok, length, depth, key)[0].tolist()
    needle = tok(mq.NEEDLE.format(key=key), add_special_tokens=False).input_ids
    for at in range(len(ids) - len(needle) + 1):
        if ids[at:at + len(needle)] == needle:
            return sorted({p // block for p in range(at, at + len(needle))})
    raise SystemExit("the needle is not in the prompt")


def capture(model, tok, fn, length: int, depth: float, key: int):
    """Run the prompt with ``fn``; returns (found, {layer: (q, k, v, scale)})."""
    seen = {}
    original = fn._stem

    def recording(module, query, key_, value, **kwargs):
        seen[getattr(module, "layer_idx", len(seen))] = (query, key_, value, kwargs.get("scale"))
        return original(module, query, key_, value, **kwargs)

    fn._stem = recording
    try:
        found = mq.passkey_trial(model, tok, fn.name, length, depth, key)
    finally:
        del fn._stem
    return found, seen


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
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override one of the configuration's attributes, e.g. "
                             "k_block_num_bias_medium=50 (repeatable)")
    parser.add_argument("--rope", choices=("yarn", "linear"), default="yarn",
                        help="RoPE scaling x4 for prompts past the model's 8K window, as "
                             "model_quality.py --long runs them")
    args = parser.parse_args(argv)
    if args.trial is not None:
        if args.depth is not None or args.key is not None:
            parser.error("--trial draws the key and depth: give it alone, or --depth and --key")
        from vllm_bench import passkey_draw  # its prompt is model_quality's, token for token
        args.key, args.depth = passkey_draw(args.length, args.trial)
    elif args.depth is None or args.key is None:
        parser.error("--depth and --key (or --trial) are required")
    config = dict(mq.CONFIGS[args.config])
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
    factor = 4.0 if args.length > 8192 else None
    tok, model = mq.load(mq.default_dtype(), rope_factor=factor, rope=args.rope)
    fn = mq.register({args.config: config})[args.config]
    block = params.stem_block_size
    blocks = needle_blocks(tok, args.length, args.depth, args.key, block)
    found, seen = capture(model, tok, fn, args.length, args.depth, args.key)
    dense = mq.passkey_trial(model, tok, "sdpa", args.length, args.depth, args.key)
    label = " ".join([args.config, *args.set])
    print(f"{label}, {args.length} tokens, depth {args.depth}, key {args.key}: needle in "
          f"key block(s) {blocks} of {-(-args.length // block)}; Stem "
          f"{'found' if found else 'missed'} it, dense {'found' if dense else 'missed'} it")
    print("\n| layer | query heads keeping the needle (last row) | needle rank where dropped "
          "(median, min) | row budget K |\n|---|---|---|---|")
    for layer in sorted(seen):
        q, k, v, scale = seen[layer]
        kept, ranks, budget = last_row_report(q, k, v, scale, blocks, params, oam)
        where = f"{statistics.median(ranks):g}, {min(ranks)}" if ranks else "-"
        print(f"| {layer} | {kept}/{q.shape[1]} | {where} | {budget} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
