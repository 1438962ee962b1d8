"""Stem's settings inside vLLM: ``additional_config={"stem": {...}}``.

Every key is checked once, when the engine starts (the platform's config
check, in the process that builds the engine's configuration), so that a bad
setting stops ``LLM(...)`` or ``vllm serve`` with one message naming the key.
This module imports neither vLLM nor the kernels: it is the plain-Python part
of the integration.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from ...operator.contract import (BUDGET_FIELDS, DEFAULT_EXACT_TAIL, PARAM_NAMES, PRESETS,
                                  IndexerParams, StemIndexerInputError, fail)
from ...pipeline.prepare import DEFAULT_OAM_LAMBDA
from ...pipeline.probe import MISS_CHECK_BLOCKS, MISS_CHECK_QUERIES, check_miss, check_probe

__all__ = ["StemSettings", "SETTINGS_KEY", "DEFAULT_PRESET", "DEFAULT_DENSE_ABOVE",
           "DEFAULT_MISS_CHECK",
           "DEFAULT_MISS_CHECK_MIN_PROMPT", "layer_ranges"]

SETTINGS_KEY = "stem"
_WHO = f"additional_config['{SETTINGS_KEY}']"

# The budget the backend runs without a ``preset`` setting: the operator's
# ``default`` with a flat 40-block budget for 7K- to 20K-token prompts
# (contract.PRESETS). Measured through this backend on SmolLM2 at 8K, 12K,
# 16K and 19K: at dense's accuracy at each, where ``default`` keeps up to
# 60 blocks for at most 0.2 points less perplexity and less speed from 12K on
# (benchmarks/FRONTIER.md, "A flat budget below 20K").
DEFAULT_PRESET = "serving"

# Above this share of a row's visible (query block, key block) pairs, the
# row runs vLLM's own kernel: Stem's scoring costs more than the pairs it
# drops save. Measured: the break-even share is 89% to 91% of a row's pairs
# (benchmarks/VLLM.md, "One attention layer: cost per block pair, and the
# `dense_above` default"), with vLLM's kernel on the kept blocks. With Stem's
# kernel (``sparse_kernel``) it is above 100%, and the default keeps those
# rows' answers dense.
DEFAULT_DENSE_ABOVE = 0.9
# A layer whose selection keeps this much less of the sampled queries'
# attention than the heaviest blocks would keeps every block
# (``miss_check``). Measured on SmolLM2 at 32K, chunk by chunk from 8K
# tokens on: layers 3 to 10, where widening bought back most of the
# perplexity, miss 0.06 to 0.25; layer 20 0.03 to 0.09; the others under
# 0.045 (benchmarks/FRONTIER.md, "The miss check").
DEFAULT_MISS_CHECK = 0.05
# The check runs on prompts of this many tokens or more. Below, on SmolLM2 at
# 16K, widening the layers it finds bought back 0.03 points of perplexity
# for a sixth of the speed-up; at 32K, 1.4 points (benchmarks/FRONTIER.md,
# "The miss check"). 20,480 tokens: where the budget's large regime starts with
# 128-token blocks (contract.BRANCH_LARGE blocks).
DEFAULT_MISS_CHECK_MIN_PROMPT = 20480
# The check samples a prompt's chunks whose queries start at this token or
# later; the chunks before keep their selection.
DEFAULT_MISS_CHECK_FROM = 0
# A pass of the miss check is final (the layer is not checked again for that
# prompt) only where the sampled block's lists leave out at least this share
# of the blocks it can see. The budget's share falls along a prompt, so an
# early chunk drops little and cannot miss much: on Gemma-3 at 32K the
# layer the check should widen misses 0.00 in the chunk at 4K to 8K tokens
# (it drops under a sixth there) and 0.05 to 0.08 from 8K on.
MISS_CHECK_FINAL_DROPPED = 0.5
#: the values of the ``decoded_pages`` setting
DECODED_PAGES = ("read_back", "write")
#: the values of the ``sparse_kernel`` setting
SPARSE_KERNELS = ("auto", "stem", "vllm")
#: the values of the ``sparse_products`` setting, and the ``bf16`` argument of
#: Stem's kernel (``sparse_attention``) each asks for
SPARSE_PRODUCTS = {"auto": "auto", "bfloat16": "brgemm", "float32": "widen"}

# The indexer parameters a user may set (causal is the layer's).
_INDEXER_KEYS = tuple(n for n in PARAM_NAMES if n != "causal")


def _count(section: Mapping[str, Any], key: str, default: int) -> int:
    """``section[key]`` (``default`` where absent), refused unless an int >= 0."""
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        fail(_WHO, key, "must be an int >= 0", repr(value))
    return value


def _layers(value: Any, key: str = "dense_layers") -> int | tuple[int, ...]:
    """``dense_layers``: an int >= 0 (the first n), or the layers named by a
    list of ints >= 0 or a string of indices and ranges (``"0 3-8"``).
    ``key`` names the setting in errors; any key but ``dense_layers`` takes
    the string form only (a JSON object's keys are strings)."""
    rule = ("must be an int >= 0 (the first n layers), a list of layer indices, or a string "
            "of indices and ranges such as \"3-8\" or \"0 3-8\"")
    if key != "dense_layers":
        rule = "must name layers by a string of indices and ranges such as \"3-8\" or \"0 3-8\""
        if not isinstance(value, str):
            fail(_WHO, key, rule, repr(value))
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            fail(_WHO, "dense_layers", rule, repr(value))
        return value
    picked: set[int] = set()
    if isinstance(value, str):
        for part in value.replace(",", " ").split():
            lo, dash, hi = part.partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
                fail(_WHO, key, rule, repr(value))
            picked.update(range(int(lo), int(hi if dash else lo) + 1))
    elif isinstance(value, (list, tuple)) and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value):
        picked.update(value)
    else:
        fail(_WHO, key, rule, repr(value))
    if key != "dense_layers" and not picked:
        fail(_WHO, key, rule, repr(value))
    return tuple(sorted(picked))


def _names(layers: int | tuple[int, ...], index: int) -> bool:
    """Whether ``_layers``' value names layer ``index`` (an int: the first n)."""
    return index < layers if isinstance(layers, int) else index in layers


def layer_ranges(layers) -> str:
    """(0, 3, 4, 5) -> "0 3-5": ascending indices as ``_layers`` reads them."""
    runs: list[list[int]] = []
    for n in layers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return " ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _layer_budgets(value: Any, params: IndexerParams,
                   dense: int | tuple[int, ...]) -> tuple[tuple[tuple[int, ...], IndexerParams],
                                                          ...]:
    """``layer_budgets``: ``{layers: budget}``, each budget a preset's name or
    an object of ``BUDGET_FIELDS`` (optionally with a ``preset`` they
    override), applied over ``params``. Returns ``((layers, params), ...)``."""
    key = "layer_budgets"
    if not isinstance(value, Mapping):
        fail(_WHO, key, "must be a JSON object mapping layers (\"3-8\", \"0 3-8\") to a "
             "preset's name or an object of budget parameters", repr(value))
    seen: dict[int, str] = {}
    out = []
    for layers, budget in value.items():
        where = f"{key}[{layers!r}]"
        picked = _layers(layers, where)
        for n in picked:
            if n in seen:
                fail(_WHO, where, f"names layer {n}, which {key}[{seen[n]!r}] names too",
                     repr(layers))
            if _names(dense, n):
                fail(_WHO, where, f"names layer {n}, which dense_layers runs dense",
                     repr(layers))
            seen[n] = layers
        if isinstance(budget, str):
            budget = {"preset": budget}
        if not isinstance(budget, Mapping):
            fail(_WHO, where, "must be a preset's name or an object of budget parameters "
                 f"({', '.join(BUDGET_FIELDS)})", repr(budget))
        unknown = sorted(set(budget) - set(BUDGET_FIELDS) - {"preset"})
        if unknown:
            fail(_WHO, f"{where}[{unknown[0]!r}]", "is not a budget parameter (those are "
                 f"{', '.join(BUDGET_FIELDS)}, and preset)", repr(budget[unknown[0]]))
        preset = budget.get("preset")
        base = {}
        if preset is not None:
            if not isinstance(preset, str) or preset not in PRESETS:
                fail(_WHO, f"{where}['preset']", "must be one of "
                     f"{', '.join(map(repr, PRESETS))}", repr(preset))
            schema = IndexerParams(**PRESETS[preset])
            base = {n: getattr(schema, n) for n in BUDGET_FIELDS}
        changes = {**base, **{n: budget[n] for n in BUDGET_FIELDS if n in budget}}
        layer = dataclasses.replace(params, **changes)
        try:
            layer.check(_WHO)
        except StemIndexerInputError as exc:  # the same message, naming the entry
            raise StemIndexerInputError(str(exc).replace(f"{_WHO}: ", f"{_WHO}: {where} ", 1)
                                        ) from None
        out.append((picked, layer))
    return tuple(out)


@dataclass(frozen=True)
class StemSettings:
    """What the vLLM backend runs with, from ``additional_config["stem"]``.

    Keys (all optional):

    * ``preset``: a named budget of ``stem_indexer.PRESETS`` (``"serving"``:
      ``default`` with a flat 40-block budget for 56 to 159 prompt blocks);
    * ``stem_block_size`` (128), ``stem_stride`` (16): Stem's block of tokens
      and its stride (the names of ``stem_attention``); the block must be a
      multiple of vLLM's KV-cache block size;
    * the indexer's parameters by their op names (``alpha``,
      ``initial_blocks``, ``window_size``, ``k_block_num_rate_medium``,
      ``k_block_num_bias_medium``, ``k_block_num_rate_large``,
      ``k_block_num_bias_large``, ``topk_score_precision``), overriding the
      preset; ``window_size`` must be at least 1 here (the window's last
      block carries each query block's causal diagonal);
    * ``oam`` (true), ``oam_lambda`` (0.3): the Output-Aware Metric;
    * ``min_prompt_tokens`` (0): prompts shorter than this run vLLM's kernel;
    * ``dense_layers`` (0): a per-layer keep schedule: these attention
      layers (counted in the order the model builds them, from 0) run
      vLLM's kernel for every row and keep no indexer cache; the others keep
      the budget. An int ``n`` names the first ``n``; a list of ints, or a
      string of indices and ranges (``"3-8"``, ``"0 3-8"``), names them;
    * ``layer_budgets`` ({}): per-layer budgets, ``{layers: budget}``:
      ``layers`` a string of indices and ranges (``"0 3-10"``), ``budget``
      a preset's name (``"balanced"``) or an object of the budget's
      parameters (``BUDGET_FIELDS``: ``alpha`` and the ``k_block_num_*``
      ones, optionally with a ``preset`` they override), over the budget
      above. The named layers' Stem rows keep that many blocks; the others
      keep the budget above, which also decides which rows run Stem at all
      (``dense_above``) and their exact tail, in every layer. A layer is
      named once, and not in ``dense_layers``;
    * ``dense_above`` (0.9): a row whose budget keeps more than this share of
      its visible block pairs runs vLLM's kernel (1.0: never for that reason);
    * ``exact_tail`` (128, ``contract.DEFAULT_EXACT_TAIL``): the prompt's last
      ``exact_tail`` tokens (its question) attend to every key, as
      ``stem_attention``'s option: the blocks holding them, in the chunk that
      ends the prompt, list every block; 0 keeps the indexer's selection there;
    * ``chunk_invariant`` (false): results that do not depend on where the
      scheduler cuts a prompt into chunks (``stem_paged_plan``'s option): a
      query block a chunk boundary cuts attends every block it can see, the
      Output-Aware Metric's statistic is taken over a fixed window, and
      ``dense_above`` does not apply (a chunk's share of pairs depends on
      the cut); every other query block keeps what a one-shot prefill keeps;
    * ``probe_queries`` (0: off), ``probe_candidates`` (2.0): a second
      scoring pass (``pipeline/probe.py``): the indexer lists
      ``probe_candidates`` times the budget's blocks, and the last
      ``probe_queries`` queries of each query block rank them by their exact
      attention mass; a row keeps as many blocks as without it. It reads the
      row's keys back from vLLM's cache (``kv_read.PageReader``): a layout
      that cannot be read back runs vLLM's kernel, counted;
    * ``miss_check`` (0.05; 0: off), ``miss_check_queries`` (16),
      ``miss_check_blocks`` (1), ``miss_check_min_prompt`` (20480): the
      selection checked against exact attention, per layer and request,
      for prompts of at least ``miss_check_min_prompt`` tokens (where the
      budget's share of a long prompt is smallest: its large regime, 160
      blocks of 128 tokens). In each of a request's Stem rows that drop
      blocks, until the layer's verdict, the last ``miss_check_blocks``
      such query blocks (evenly spaced where there are more) are sampled, and
      their last ``miss_check_queries`` queries attend exactly
      (``probe.selection_miss``): where the selected blocks keep more than
      ``miss_check`` less of that attention than as many heaviest blocks
      would, the layer keeps every block for the rest of the request's
      prompt (its rows count as ``dense:miss check``); else the selection
      stands, for the rest of the prompt where the sample left out at least
      half of the blocks it can see (``MISS_CHECK_FINAL_DROPPED``), and
      until the next chunk's check otherwise. ``miss_check_from`` (0):
      the first token a sampled chunk may start at; a request's rows that
      start before it keep their selection unchecked. It
      reads the row's keys back from vLLM's cache; where the layout cannot
      be read back, or with ``chunk_invariant`` (the sample depends on the
      chunk), the check is off, said in the log;
    * ``decoded_pages`` (``"read_back"``): how the indexer cache learns the
      tokens that decode steps add (a later prompt may share their pages
      through prefix caching). ``"read_back"``: decode steps write nothing
      there; a page they filled is rebuilt from vLLM's own cache when a Stem
      row first reads it (``kv_read.PageReader``; where the cache's layout
      cannot be read back, as ``"write"``). ``"write"``: every decoded token
      is written at its step (staged for every layer at once);
    * ``sparse_kernel`` (``"auto"``): what attends a Stem row's kept blocks.
      ``"stem"``: Stem's CPU block-sparse kernel (``sparse_attention``) on
      the row's keys and values, packed straight from vLLM's cache pages
      (``amx`` and ``vec`` layouts) or read out of them first
      (``kv_read.PageReader``); ``"vllm"``: vLLM's own kernel on virtual
      rows, one per (query head, query block), whose block tables list the
      kept pages; ``"auto"``: ``"stem"`` where it was measured faster
      (bfloat16 on the packed micro-kernel, the ``vec`` layout and the
      ``amx`` one up to head size 128: ``backend.STEM_KERNEL_FASTER_ON``),
      ``"vllm"`` elsewhere. Where
      ``"stem"`` cannot run, vLLM's kernel does, said once in the log;
      ``stats()["kernels"]`` counts rows by kernel;
    * ``sparse_products`` (``"auto"``): how Stem's kernel multiplies a
      bfloat16 cache: ``"bfloat16"`` on torch's micro-kernel (AMX tiles or
      AVX512-BF16), ``"float32"`` widened (once per KV head, by MKL's
      SGEMM), ``"auto"`` bfloat16 where its products beat float32 GEMMs
      (``torch_blas.bf16_products_pay``: AMX, AMD's AVX512-BF16) and float32
      elsewhere. Where ``"bfloat16"`` cannot run here, ``"auto"`` does, said
      once in the log.
    """

    params: IndexerParams = IndexerParams(**PRESETS[DEFAULT_PRESET])
    preset: str = DEFAULT_PRESET
    oam: bool = True
    oam_lambda: float = DEFAULT_OAM_LAMBDA
    min_prompt_tokens: int = 0
    dense_layers: int | tuple[int, ...] = 0
    #: ``((layers, params), ...)``: the layers with a budget of their own
    layer_budgets: tuple[tuple[tuple[int, ...], IndexerParams], ...] = ()
    dense_above: float = DEFAULT_DENSE_ABOVE
    exact_tail: int = DEFAULT_EXACT_TAIL
    chunk_invariant: bool = False
    decoded_pages: str = "read_back"
    probe_queries: int = 0
    probe_candidates: float = 2.0
    sparse_kernel: str = "auto"
    sparse_products: str = "auto"
    miss_check: float = DEFAULT_MISS_CHECK
    miss_check_queries: int = MISS_CHECK_QUERIES
    miss_check_blocks: int = MISS_CHECK_BLOCKS
    miss_check_min_prompt: int = DEFAULT_MISS_CHECK_MIN_PROMPT
    miss_check_from: int = DEFAULT_MISS_CHECK_FROM

    @property
    def block_size(self) -> int:
        return self.params.stem_block_size

    @property
    def stride(self) -> int:
        return self.params.stem_stride

    @classmethod
    def from_config(cls, additional_config: Any) -> "StemSettings":
        """The settings under ``additional_config["stem"]`` (defaults where absent)."""
        section = {}
        if isinstance(additional_config, Mapping):
            section = additional_config.get(SETTINGS_KEY, {})
        if section is None:
            section = {}
        if not isinstance(section, Mapping):
            raise StemIndexerInputError(f"{_WHO} must be a JSON object of Stem's settings; "
                                        f"got {type(section).__name__}")
        return cls.from_mapping(section)

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any]) -> "StemSettings":
        known = ("preset", "oam", "oam_lambda", "min_prompt_tokens", "dense_layers",
                 "layer_budgets", "dense_above", "exact_tail", "chunk_invariant", "decoded_pages",
                 "probe_queries", "probe_candidates", "sparse_kernel", "sparse_products",
                 "miss_check",
                 "miss_check_queries", "miss_check_blocks",
                 "miss_check_min_prompt", "miss_check_from") + _INDEXER_KEYS
        for key in section:
            if key not in known:
                fail(_WHO, repr(key), f"is not a Stem setting (those are {', '.join(known)})",
                     repr(section[key]))
        preset = section.get("preset", DEFAULT_PRESET)
        if not isinstance(preset, str) or preset not in PRESETS:
            fail(_WHO, "preset", f"must be one of {', '.join(map(repr, PRESETS))}",
                 repr(preset))
        overrides = {name: section[name] for name in _INDEXER_KEYS if name in section}
        params = IndexerParams.from_kwargs(_WHO, preset=preset, **overrides)
        if params.window_size < 1:
            fail(_WHO, "window_size", "must be >= 1 in the vLLM backend (the window's last "
                 "block holds each query block's causal diagonal)", params.window_size)
        oam = section.get("oam", True)
        if not isinstance(oam, bool):
            fail(_WHO, "oam", "must be true or false", repr(oam))
        oam_lambda = section.get("oam_lambda", DEFAULT_OAM_LAMBDA)
        if (isinstance(oam_lambda, bool) or not isinstance(oam_lambda, (int, float))
                or not math.isfinite(oam_lambda)):
            fail(_WHO, "oam_lambda", "must be a finite number", repr(oam_lambda))
        min_prompt = _count(section, "min_prompt_tokens", 0)
        dense_layers = _layers(section.get("dense_layers", 0))
        layer_budgets = _layer_budgets(section.get("layer_budgets", {}), params, dense_layers)
        dense_above = section.get("dense_above", DEFAULT_DENSE_ABOVE)
        if (isinstance(dense_above, bool) or not isinstance(dense_above, (int, float))
                or not (0.0 < dense_above <= 1.0)):
            fail(_WHO, "dense_above", "must be a number with 0 < dense_above <= 1",
                 repr(dense_above))
        exact_tail = _count(section, "exact_tail", DEFAULT_EXACT_TAIL)
        invariant = section.get("chunk_invariant", False)
        if not isinstance(invariant, bool):
            fail(_WHO, "chunk_invariant", "must be true or false", repr(invariant))
        decoded = section.get("decoded_pages", "read_back")
        if decoded not in DECODED_PAGES:
            fail(_WHO, "decoded_pages", f"must be one of {', '.join(map(repr, DECODED_PAGES))}",
                 repr(decoded))
        probe_queries = section.get("probe_queries", 0)
        candidates = section.get("probe_candidates", 2.0)
        check_probe(_WHO, probe_queries, candidates)
        kernel = section.get("sparse_kernel", "auto")
        if kernel not in SPARSE_KERNELS:
            fail(_WHO, "sparse_kernel", f"must be one of {', '.join(map(repr, SPARSE_KERNELS))}",
                 repr(kernel))
        products = section.get("sparse_products", "auto")
        if products not in SPARSE_PRODUCTS:
            fail(_WHO, "sparse_products",
                 f"must be one of {', '.join(map(repr, SPARSE_PRODUCTS))}", repr(products))
        miss = section.get("miss_check", DEFAULT_MISS_CHECK)
        miss_queries = section.get("miss_check_queries", MISS_CHECK_QUERIES)
        miss_blocks = section.get("miss_check_blocks", MISS_CHECK_BLOCKS)
        miss_from = section.get("miss_check_from", DEFAULT_MISS_CHECK_FROM)
        check_miss(_WHO, miss, miss_queries, miss_blocks, miss_from)
        miss_prompt = _count(section, "miss_check_min_prompt", DEFAULT_MISS_CHECK_MIN_PROMPT)
        return cls(params, preset, oam, float(oam_lambda), min_prompt, dense_layers,
                   layer_budgets, float(dense_above), exact_tail, invariant, decoded, probe_queries,
                   float(candidates), kernel, products, float(miss), miss_queries, miss_blocks,
                   miss_prompt, miss_from)

    def verdict(self, miss: float, dropped: float) -> bool | None:
        """The miss check's verdict on one sample (``probe.selection_miss``'s
        ``miss`` and ``dropped``): True, the layer keeps every block for the
        rest of the prompt; False, its selection stands for the rest of the
        prompt; None, it stands for this row and the next is checked again
        (the sample dropped under ``MISS_CHECK_FINAL_DROPPED`` of what it
        can see)."""
        if miss > self.miss_check:
            return True
        return False if dropped >= MISS_CHECK_FINAL_DROPPED else None

    @property
    def checks_misses(self) -> bool:
        """Whether Stem rows run the miss check (``miss_check``; not under
        ``chunk_invariant``)."""
        return self.miss_check > 0 and not self.chunk_invariant

    def dense_layer(self, index: int) -> bool:
        """Whether the model's attention layer ``index`` (from 0) is one of
        ``dense_layers``."""
        return _names(self.dense_layers, index)

    def layer_params(self, index: int) -> IndexerParams:
        """The indexer's parameters in the model's attention layer ``index``:
        its ``layer_budgets`` entry's, else the settings' own."""
        for layers, params in self.layer_budgets:
            if _names(layers, index):
                return params
        return self.params

    def check_kv_block_size(self, kv_block_size: int) -> None:
        """Stem's blocks must be whole KV-cache pages (the kernel reads pages)."""
        if self.block_size % kv_block_size:
            fail(_WHO, "stem_block_size", f"must be a multiple of vLLM's KV-cache block size "
                 f"({kv_block_size}; set with --block-size)", self.block_size)

    def describe(self) -> str:
        """One line for the log: the preset and what differs from it."""
        base = IndexerParams(**PRESETS[self.preset])
        changed = [f"{f.name}={getattr(self.params, f.name)}"
                   for f in dataclasses.fields(IndexerParams)
                   if getattr(self.params, f.name) != getattr(base, f.name)]
        extra = [f"oam={self.oam}", f"min_prompt_tokens={self.min_prompt_tokens}",
                 f"dense_above={self.dense_above}", f"exact_tail={self.exact_tail}"]
        if self.checks_misses:
            extra.append(f"miss_check={self.miss_check:g} (queries={self.miss_check_queries} "
                         f"blocks={self.miss_check_blocks} "
                         f"min_prompt={self.miss_check_min_prompt} "
                         f"from={self.miss_check_from})")
        else:
            extra.append("miss_check=off" + (" (chunk_invariant)" if self.miss_check else ""))
        if self.dense_layers:
            shown = self.dense_layers if isinstance(self.dense_layers, int) else " ".join(
                map(str, self.dense_layers))
            extra.append(f"dense_layers={shown}")
        for layers, params in self.layer_budgets:
            budget = ",".join(f"{n}={getattr(params, n)}" for n in BUDGET_FIELDS
                              if getattr(params, n) != getattr(self.params, n))
            extra.append(f"layer_budgets[{layer_ranges(layers)}]={budget or 'same'}")
        if self.chunk_invariant:
            extra.append("chunk_invariant=True")
        if self.probe_queries:
            extra.append(f"probe_queries={self.probe_queries} "
                         f"probe_candidates={self.probe_candidates:g}")
        if self.decoded_pages != "read_back":
            extra.append(f"decoded_pages={self.decoded_pages}")
        if self.sparse_kernel != "auto":
            extra.append(f"sparse_kernel={self.sparse_kernel}")
        if self.sparse_products != "auto":
            extra.append(f"sparse_products={self.sparse_products}")
        return f"preset={self.preset} " + " ".join(changed + extra)
