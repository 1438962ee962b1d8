"""What ran, per worker process: rows by path and reason, block pairs per layer,
and one log line per request when its prefill ends. No vLLM import."""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field

__all__ = ["WorkerStats", "STATS", "merge", "request_line"]

# Under vLLM's logger tree, so that its handler and format (process name,
# time) apply to our lines as to its own.
LOG = logging.getLogger("vllm.stem_indexer")

# Requests whose prefill is under way; a request aborted mid-prompt is
# forgotten after this many newer ones.
_MAX_OPEN = 4096


@dataclass
class _Request:
    prompt: int
    kept: int = 0
    visible: int = 0
    rows: collections.Counter = field(default_factory=collections.Counter)  # by path
    chunks: int = 0
    layers_done: int = 0  # layers that ran the request's last chunk


@dataclass
class WorkerStats:
    """Counters of one worker process (``stats()`` sums them over workers).

    ``rows`` counts (layer, row) pairs: ``"sparse:fresh"``,
    ``"sparse:continuation"``, ``"sparse:prefix hit"``, or ``"dense:<reason>"``;
    ``pairs`` maps a layer's name to its kept and visible (query block, key
    block) pairs over the rows that ran Stem, all heads of this worker.
    """

    rows: collections.Counter = field(default_factory=collections.Counter)
    pairs: dict = field(default_factory=dict)
    layouts: collections.Counter = field(default_factory=collections.Counter)
    #: sparse rows by the kernel that attended them (``"stem"``, ``"vllm"``)
    kernels: collections.Counter = field(default_factory=collections.Counter)
    requests: dict = field(default_factory=dict)
    #: bytes of the indexer caches and of the KV caches beside them (bound at start-up)
    memory: collections.Counter = field(default_factory=collections.Counter)
    #: speculative decoding: decode tokens held back a step, then written
    #: (accepted) or dropped (rejected drafts, or their request ended)
    held: collections.Counter = field(default_factory=collections.Counter)
    #: steps without Stem rows whose writes were staged and carried out for
    #: every layer at once (``steps``), and the layers' writes in them (``layers``)
    staged: collections.Counter = field(default_factory=collections.Counter)
    #: indexer-cache pages rebuilt from vLLM's cache when a Stem row read them
    #: (``pages``, summed over layers)
    read_back_pages: collections.Counter = field(default_factory=collections.Counter)
    #: the miss check, per layer's name: [checks, checks that widened, summed miss]
    checks: dict = field(default_factory=dict)
    layers: int = 0
    log_requests: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.rows.clear()
            self.pairs.clear()
            self.layouts.clear()
            self.kernels.clear()
            self.requests.clear()
            self.held.clear()
            self.staged.clear()
            self.read_back_pages.clear()
            self.checks.clear()

    def snapshot(self) -> dict:
        with self.lock:
            return {"rows": dict(self.rows), "layouts": dict(self.layouts),
                    "kernels": dict(self.kernels),
                    "pairs": {name: list(p) for name, p in self.pairs.items()},
                    "memory": dict(self.memory), "held": dict(self.held),
                    "staged": dict(self.staged), "read_back": dict(self.read_back_pages),
                    "checks": {name: list(c) for name, c in self.checks.items()}}

    # Called by the backend --------------------------------------------------

    def bulk(self, counts) -> None:
        """Rows that belong to no prompt (decodes, empty rows): ``(reason,
        count)`` pairs of one layer, counted as ``"dense:<reason>"``."""
        if counts:
            with self.lock:
                for reason, n in counts:
                    self.rows[f"dense:{reason}"] += n

    def bound(self, index_bytes: int, kv_bytes: int, what: str = "index_cache_bytes") -> None:
        """A layer's indexer cache, allocated beside its KV cache (or, with
        ``what``, another buffer of the plugin's)."""
        with self.lock:
            self.memory[what] += index_bytes
            if kv_bytes:
                self.memory["kv_cache_bytes"] += kv_bytes

    def stage(self, layers: int) -> None:
        """One staged step, written for ``layers`` layers at once."""
        with self.lock:
            self.staged["steps"] += 1
            self.staged["layers"] += layers

    def read_back(self, pages: int) -> None:
        """One layer's ``pages`` rebuilt from vLLM's cache."""
        with self.lock:
            self.read_back_pages["pages"] += pages

    def speculative(self, accepted: int, dropped: int) -> None:
        """One step's held-back decode tokens: written, or dropped."""
        with self.lock:
            self.held["written"] += accepted
            self.held["dropped"] += dropped

    def check(self, layer: str, miss: float, widened: bool) -> None:
        """One miss check of a row in ``layer``: the miss it measured, and
        whether the layer keeps every block for the rest of the prompt."""
        with self.lock:
            c = self.checks.setdefault(layer, [0, 0, 0.0])
            c[0] += 1
            c[1] += widened
            c[2] += miss

    def count(self, path: str, n: int = 1) -> None:
        """``n`` more of ``path`` (a failure outside any row, say)."""
        with self.lock:
            self.rows[path] += n

    def row(self, layer: str, request: str, prompt: int, path: str, kept: int, visible: int,
            last_chunk: bool, first_layer: bool, layout: str = "", kernel: str = "") -> None:
        """One row of one layer: ``path`` is ``"sparse:<kind>"`` or
        ``"dense:<reason>"``; ``kept``/``visible`` its block pairs (all heads);
        ``layout`` the KV-cache layout a sparse row ran on, ``kernel`` the
        kernel that attended it."""
        with self.lock:
            self.rows[path] += 1
            if layout:
                self.layouts[layout] += 1
            if kernel:
                self.kernels[kernel] += 1
            if path.startswith("sparse"):
                pair = self.pairs.setdefault(layer, [0, 0])
                pair[0] += kept
                pair[1] += visible
            if not request:
                return
            req = self.requests.get(request)
            if req is None:
                if len(self.requests) >= _MAX_OPEN:
                    self.requests.pop(next(iter(self.requests)))
                req = self.requests[request] = _Request(prompt)
            if path.startswith("sparse"):
                req.kept += kept
                req.visible += visible
            req.rows[path] += 1
            req.chunks += first_layer
            if last_chunk:
                req.layers_done += 1
                if req.layers_done >= self.layers:
                    del self.requests[request]
                    if self.log_requests:
                        self._log(request, req)

    @staticmethod
    def _log(request: str, req: _Request) -> None:
        LOG.info(request_line(request, req.prompt, req.chunks, req.rows, req.kept, req.visible))


STATS = WorkerStats()


def request_line(request: str, prompt: int, chunks: int, rows: dict, kept: int,
                 visible: int) -> str:
    """The log line of a request's prefill. A row is one chunk of the prompt
    in one layer: a prompt in ``c`` chunks through ``L`` layers has ``c * L``.
    ``rows`` counts them by path; the density is over the sparse rows' visible
    block pairs (100% when none ran sparse)."""
    total = sum(rows.values())
    sparse = sorted((k.split(":", 1)[1], n) for k, n in rows.items() if k.startswith("sparse"))
    dense = sorted((k.split(":", 1)[1], n) for k, n in rows.items() if k.startswith("dense"))
    parts = [f"{sum(n for _, n in sparse)} of {total} (layer, chunk) rows sparse"]
    if sparse:
        parts[0] += " (" + ", ".join(f"{k} {n}" for k, n in sparse) + ")"
    if dense:
        parts.append("dense: " + ", ".join(f"{k} {n}" for k, n in dense))
    density = kept / visible if visible else 1.0
    return (f"Stem prefill of request {request}: {prompt} prompt tokens in {chunks} chunk(s); "
            + "; ".join(parts) + f"; density {100.0 * density:.1f}%")


def merge(snapshots: list[dict]) -> dict:
    """Sum workers' snapshots: rows by path, and per layer the kept and visible
    pairs with their density; ``density`` over all layers' Stem rows;
    ``layouts``: the sparse rows by the KV-cache layout they ran on;
    ``kernels``: the sparse rows by the kernel that attended them;
    ``memory``: the bytes of the Stem layers' indexer caches and KV caches;
    ``held``: under speculative decoding, the decode tokens held back a step
    and then written to the indexer cache or dropped (per layer 0 of each worker);
    ``staged``: the steps without Stem rows whose writes were carried out for
    every layer at once, and the layers' writes in them; ``read_back``: the
    indexer-cache pages rebuilt from vLLM's cache, summed over layers;
    ``checks``: per layer, the miss check's checks, those that widened the
    layer, and their mean miss."""
    rows: collections.Counter = collections.Counter()
    layouts: collections.Counter = collections.Counter()
    kernels: collections.Counter = collections.Counter()
    memory: collections.Counter = collections.Counter()
    held: collections.Counter = collections.Counter()
    staged: collections.Counter = collections.Counter()
    read_back: collections.Counter = collections.Counter()
    pairs: dict[str, list[int]] = {}
    checks: dict[str, list] = {}
    for snap in snapshots:
        for name, (n, widened, miss) in snap.get("checks", {}).items():
            acc = checks.setdefault(name, [0, 0, 0.0])
            acc[0], acc[1], acc[2] = acc[0] + n, acc[1] + widened, acc[2] + miss
        rows.update(snap["rows"])
        layouts.update(snap.get("layouts", {}))
        kernels.update(snap.get("kernels", {}))
        memory.update(snap.get("memory", {}))
        held.update(snap.get("held", {}))
        staged.update(snap.get("staged", {}))
        read_back.update(snap.get("read_back", {}))
        for name, (kept, visible) in snap["pairs"].items():
            acc = pairs.setdefault(name, [0, 0])
            acc[0] += kept
            acc[1] += visible
    layers = {name: {"kept": k, "visible": v, "density": k / v if v else 1.0}
              for name, (k, v) in sorted(pairs.items())}
    kept = sum(k for k, _ in pairs.values())
    visible = sum(v for _, v in pairs.values())
    return {"rows": dict(sorted(rows.items())), "layers": layers,
            "density": kept / visible if visible else None,
            "layouts": dict(sorted(layouts.items())), "kernels": dict(sorted(kernels.items())),
            "memory": dict(sorted(memory.items())),
            "held": dict(sorted(held.items())), "staged": dict(sorted(staged.items())),
            "read_back": dict(read_back),
            "checks": {name: {"checked": n, "widened": w, "mean_miss": m / n if n else 0.0}
                       for name, (n, w, m) in sorted(checks.items())}}
