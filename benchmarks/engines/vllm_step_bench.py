"""What the Stem plugin costs a vLLM decode step (CPU): many decodes, no prefill.

    python benchmarks/engines/vllm_step_bench.py --requests 256 --tokens 33 --reps 3

A random model with SmolLM2-135M's shape (30 layers, 9 query / 3 KV heads,
head dim 64; random weights: a decode step's cost does not depend on them) is
written once to ``~/.cache/stem_indexer/random-smollm2-shape-32k``. Two engines in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), vLLM's own CPU backend
and Stem's (``--attention-backend CUSTOM``, default settings), the same
engine settings. Each turn submits ``--requests`` prompts of
``--prompt-tokens`` random tokens (64 unless said), and ``--long`` more of
``--long-tokens`` (none unless said: a served mix, short chats decoding
beside long documents), together, once with 1 new token (prefill only) and
once with ``--tokens``; the difference over ``tokens - 1`` is the time of
one decode step of every request. Engines alternate within a turn.

Prefix caching is off unless ``--prefix-caching``: without it the indexer
cache leaves decode rows' tokens out (nothing reads them), with it it takes
every token. With it, each turn's prompts are prefilled once before the two
timed runs, which then find every whole page in the prefix cache: their
difference is the decode steps alone, not a small difference of two long
prefills (what makes long prompts, ``--prompt-tokens`` in the thousands,
measurable).

Beside the wall clock, the Stem engine's own work is timed where it runs:
the step hook (the requests' prompt lengths, read before the metadata is
built), the metadata builder's ``build`` (vLLM's, plus the step's plan)
and each layer's ``forward``/``do_kv_cache_update`` beyond vLLM's (the
plugin's counting and checks), summed per step: the plugin's cost without
the machine's noise around it. The hook is installed in the process, so the
wall clock of vLLM's engine here pays it too (a served vLLM does not).
These timers cost the Stem engine's wall clock a few microseconds per layer
themselves: ``--no-clock`` leaves them out, for a wall-clock comparison of
the plugin as served (no own-code column then).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # noqa: E402,F401  (every area's folder on sys.path)

MODEL = Path.home() / ".cache" / "stem_indexer" / "random-smollm2-shape-32k"
POSITIONS = 32768


def make_model(out: Path) -> None:
    """A random Llama with SmolLM2-135M's shape and a word-level tokenizer."""
    if (out / "config.json").exists():
        return
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        max_position_embeddings=POSITIONS, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    vocab = {f"t{i}": i for i in range(49152)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                         eos_token="t2").save_pretrained(out)


class Clock:
    """Seconds spent in the plugin's own code, accumulated."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.parts: dict[str, float] = {}  # the same, per method
        self.inside = 0  # calls of the plugin's methods under way

    def around(self, cls, name: str, base) -> None:
        """Time ``cls.name`` minus the time of ``base`` (vLLM's method it wraps)
        when called from it (the plain engine calls ``base`` too: not counted)."""
        ours, theirs = getattr(cls, name), getattr(base, name)
        clock = self

        def timed_base(*args, **kwargs):
            if not clock.inside:
                return theirs(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return theirs(*args, **kwargs)
            finally:
                clock.add(name, t0 - time.perf_counter())

        def timed(*args, **kwargs):
            clock.inside += 1
            t0 = time.perf_counter()
            try:
                return ours(*args, **kwargs)
            finally:
                clock.add(name, time.perf_counter() - t0)
                clock.inside -= 1

        setattr(cls, name, timed)
        setattr(base, name, timed_base)

    def add(self, name: str, seconds: float) -> None:
        self.seconds += seconds
        self.parts[name] = self.parts.get(name, 0.0) + seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=33)
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="tokens of each prompt (at most 32000: the model's 32768 "
                             "positions); long prompts decode over long contexts, and from "
                             "about 7K tokens their prefill runs Stem")
    parser.add_argument("--long", type=int, default=0,
                        help="prompts of --long-tokens besides the --requests ones")
    parser.add_argument("--long-tokens", type=int, default=16000,
                        help="tokens of each --long prompt (at most 32000)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prefix-caching", action="store_true",
                        help="both engines with prefix caching (the indexer cache then "
                             "takes the decoded tokens too)")
    parser.add_argument("--no-clock", action="store_true",
                        help="no timers around the plugin's methods (the wall clock only)")
    parser.add_argument("--record", default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    for name in ("prompt_tokens", "long_tokens"):
        if not 1 <= getattr(args, name) <= 32000:
            parser.error(f"--{name.replace('_', '-')} must be in [1, 32000]; "
                         f"got {getattr(args, name)}")
    if args.long < 0:
        parser.error(f"--long must be >= 0; got {args.long}")
    make_model(MODEL)
    from vllm import LLM, SamplingParams

    from common import cpu_flags, git_sha, machine, write_atomic

    longest = max(args.prompt_tokens, args.long_tokens if args.long else 0)
    engine = dict(model=str(MODEL), dtype="bfloat16",
                  max_model_len=max(2048, longest + args.tokens), seed=0,
                  enable_prefix_caching=args.prefix_caching,
                  max_num_seqs=args.requests + args.long,
                  max_num_batched_tokens=max(2048, 64 * (args.requests + args.long)))
    from stem_indexer.integrations.vllm import backend

    clock = Clock()
    # The step hook (installed by the Stem engine's builder, so timed from
    # here on) runs for both engines of this process; only the Stem engine's
    # runs count.
    hook = backend._record_step

    def timed_hook(*args):
        t0 = time.perf_counter()
        try:
            return hook(*args)
        finally:
            clock.add("step hook", time.perf_counter() - t0)
    if not args.no_clock:
        backend._record_step = timed_hook
    engines = {"vllm": LLM(**engine),
               "stem": LLM(**engine, attention_backend="CUSTOM", additional_config={"stem": {}})}
    from vllm.v1.attention.backends import cpu_attn

    if not args.no_clock:
        clock.around(backend.StemMetadataBuilder, "build", cpu_attn.CPUAttentionMetadataBuilder)
        clock.around(backend.StemAttentionImpl, "forward", cpu_attn.CPUAttentionBackendImpl)
        clock.around(backend.StemAttentionImpl, "do_kv_cache_update",
                     cpu_attn.CPUAttentionBackendImpl)
    rng = random.Random(0)

    def new_prompts() -> list[dict]:
        lengths = [args.prompt_tokens] * args.requests + [args.long_tokens] * args.long
        return [{"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(n)]}
                for n in lengths]

    def run(llm, tokens: int, prompts: list[dict] | None = None) -> float:
        prompts = prompts or new_prompts()
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0,
                                ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    for llm in engines.values():  # warm-up
        run(llm, 2)
    steps = {name: [] for name in engines}
    own, parts = [], {}
    for rep in range(args.reps):
        for name in (list(engines) if rep % 2 == 0 else list(reversed(engines))):
            prompts = None
            if args.prefix_caching:  # both timed runs then hit the prefix cache
                run(engines[name], 1, prompts := new_prompts())
            c0 = clock.seconds, dict(clock.parts)
            prefill = run(engines[name], 1, prompts)
            c1 = clock.seconds, dict(clock.parts)
            whole = run(engines[name], args.tokens, prompts)
            steps[name].append((whole - prefill) / (args.tokens - 1) * 1e3)
            if name == "stem":
                # The plugin's time in the decode steps alone: the whole run's
                # less the prefill run's, per step.
                per_step = 1e3 / (args.tokens - 1)
                own.append(((clock.seconds - c1[0]) - (c1[0] - c0[0])) * per_step)
                for part, total in clock.parts.items():
                    decode = (total - c1[1].get(part, 0.0)) - (c1[1].get(part, 0.0)
                                                                - c0[1].get(part, 0.0))
                    parts.setdefault(part, []).append(decode * per_step)
            print(f"  turn {rep} {name}: {steps[name][-1]:.1f} ms per decode step", flush=True)
    ratios = [s / v for s, v in zip(steps["stem"], steps["vllm"])]
    mix = f" and {args.long} of {args.long_tokens}" if args.long else ""
    lines = [f"\n### A decode step of {args.requests} requests{mix}, with and without the "
             "plugin\n",
             f"Machine: {machine()}; {cpu_flags()}; git {git_sha()}; a random model of "
             f"SmolLM2-135M's shape (30 layers), bf16, {args.requests} requests of "
             f"{args.prompt_tokens} prompt tokens{mix} "
             f"decoding {args.tokens - 1} steps; prefix caching "
             f"{'on' if args.prefix_caching else 'off'}; {args.reps} turns, engines alternating.",
             "", f"`python benchmarks/engines/vllm_step_bench.py --requests {args.requests} "
             f"--tokens {args.tokens} --reps {args.reps}"
             f"{f' --prompt-tokens {args.prompt_tokens}' if args.prompt_tokens != 64 else ''}"
             f"{f' --long {args.long} --long-tokens {args.long_tokens}' if args.long else ''}"
             f"{' --prefix-caching' if args.prefix_caching else ''}"
             f"{' --no-clock' if args.no_clock else ''}`", "",
             "| vLLM ms / step | with the plugin ms / step | ratio, median [min, max] | "
             "the plugin's own code ms / step, median [min, max] |", "|---|---|---|---|",
             f"| {statistics.median(steps['vllm']):.1f} | {statistics.median(steps['stem']):.1f} "
             f"| {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}] | "
             + ("not timed (`--no-clock`) |" if args.no_clock else
                f"{statistics.median(own):.2f} [{min(own):.2f}, {max(own):.2f}] |"), ""]
    if not args.no_clock:
        lines.append("The plugin's own code per decode step, by method (median ms, all "
                     "layers): " + ", ".join(f"`{part}` {statistics.median(ms):.2f}"
                                             for part, ms in parts.items()) + ".")
    print("\n".join(lines))
    if args.record:
        write_atomic(args.record, "\n".join(lines) + "\n", append=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
