"""The vLLM attention backend: vLLM's CPU backend, with Stem on long prefill rows.

Imported by vLLM (the class path registered for ``AttentionBackendEnum.CUSTOM``)
in its worker processes.

**Once per step**, the metadata builder plans the step (``StepPlan``): it
sorts the rows and does all their host work.

* A row of a request still in its prompt, of a prompt at least
  ``min_prompt_tokens`` long, whose budget keeps at most ``dense_above`` of
  its visible block pairs, runs **Stem**; ``rows.plan_stem_row`` prepares
  its pages, lengths, the indexer's metadata, its tail rows and its virtual
  rows' query counts.
* Every other row (decodes, short prompts, rows the budget keeps nearly
  whole) runs **vLLM's kernel** as it would without this backend. A step
  without a Stem row is exactly the plain backend's call, and decode rows
  are counted in bulk.

**Every layer** then does tensor work only:

* ``do_kv_cache_update`` writes the step's keys and values into vLLM's cache
  (vLLM's own writer, for its layout) and into the layer's indexer cache
  (``stem_indexer/pipeline/index_cache.py``: per page, the keys' group sums and the values' run
  maxima). Decode rows' tokens are left out of it, so a decode-only step
  writes nothing there. Without prefix caching nothing reads them (a
  request's later rows are decodes too, and a recomputed request rewrites
  its pages from the start); with it a later prompt may share their pages,
  which a Stem row then rebuilds from vLLM's own cache when it first reads
  them (``kv_read.PageReader``; where a layout cannot be read back, or with
  ``decoded_pages="write"``, every token is written, staged per step);
* ``forward`` runs, for each Stem row, the indexer on the row's queries and
  the indexer cache's entries of its pages (its keys and values are read
  back only for pages decode steps filled), then attends the kept blocks
  (``sparse_kernel``): with Stem's CPU kernel, which packs the row's keys
  and values straight from the layer's cache pages (``amx`` and ``vec``
  layouts) or takes them read out first, or with vLLM's own paged kernel on
  *virtual rows* that list only the kept pages, in the layer's own cache
  layout (``amx``, ``vec`` or ``vec16``).

A layer Stem cannot serve (sliding window, ALiBi, attention sinks, encoder or
cross attention, KV sharing, a quantised KV cache, a cache layout other than
those three) runs vLLM's kernel for every row, and the reason is counted. An
exception in Stem's part of a layer never reaches the engine: that layer's
step runs vLLM's kernel, counted as ``dense:error:<type>`` and logged once
with its traceback.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from ...operator.ops import sparse_attention as sparse_kernel
from ...pipeline.index_cache import IndexCache, WriteStage, index_cache_bytes, row_tags, token_tags
from ...pipeline.probe import selection_miss
from .kv_read import PageReader
from .patches import engine_reason, install_step_hook
from .rows import (Row, RowKinds, StemRow, attend_row, attend_row_paged, decode_only,
                   decode_tokens_left_out, plan_row, plan_stem_row, select_blocks, virtual_rows)
from .settings import SPARSE_PRODUCTS, StemSettings
from .stats import STATS

__all__ = ["StemAttentionBackend", "StemAttentionImpl", "StemMetadataBuilder",
           "StemAttentionMetadata", "StepPlan", "RowTrace", "observe", "observe_writes",
           "LAYOUTS"]

_LOG = logging.getLogger("vllm.stem_indexer")

#: vLLM's CPU cache layouts (``layer.isa``) whose attention runs on virtual rows.
LAYOUTS = ("amx", "vec", "vec16")
#: The layouts where Stem's kernel, its keys and values taken from vLLM's
#: cache pages included, was measured faster than vLLM's kernel on virtual
#: rows (``sparse_kernel="auto"``; ``vllm_bench.py pairs``,
#: benchmarks/VLLM.md), each with the largest head size it was faster at
#: (None: no limit seen): ``vec`` on AVX512-BF16 (0.48 of vLLM's cost per
#: pair at head size 64, the keys read out first); ``amx``, packing the pages
#: itself, at head size 64 (0.74 to 0.76 of vLLM's dense cost per pair,
#: against 1.05 to 1.06 for vLLM's kernel on the kept blocks) and 128 (0.89
#: to 0.93, against 1.11 to 1.13), not at 256 (1.10 to 1.21, against 1.11
#: to 1.12).
STEM_KERNEL_FASTER_ON: dict[str, int | None] = {"vec": None, "amx": 128}


class StemAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with Stem sparse prefill (``CUSTOM``)."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["StemAttentionImpl"]:
        return StemAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["StemMetadataBuilder"]:
        return StemMetadataBuilder

    @classmethod
    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        from vllm.platforms import current_platform

        reasons = super().validate_configuration(*args, **kwargs)
        if not current_platform.is_cpu():
            reasons.append("Stem's vLLM backend serves the CPU platform only in this release")
        return reasons


@dataclass
class DenseRows:
    """The step's rows that run vLLM's kernel beside Stem rows: their tokens
    (runs of the step's query tensor) and their metadata as a batch of its own."""

    spans: tuple[tuple[int, int], ...]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor


@dataclass
class StepPlan:
    """A step's rows, sorted and planned once for every layer."""

    #: the rows that run Stem, with their host work done
    stem: tuple[StemRow, ...] = ()
    #: prefill rows that run vLLM's kernel, with the reason
    dense: tuple[tuple[Row, str], ...] = ()
    #: the other rows (decodes, empty rows), counted by reason
    bulk: tuple[tuple[str, int], ...] = ()
    #: the non-Stem rows as a batch, where Stem rows run beside them
    batch: DenseRows | None = None
    #: every Stem row's pages, and what a complete indexer cache holds on
    #: them: each page's token count and its last token's tag
    pages: torch.Tensor | None = None
    fill: torch.Tensor | None = None
    page_tags: torch.Tensor | None = None
    #: the step's tokens the indexer cache takes ([tokens] bool; None: all)
    write: torch.Tensor | None = None
    #: [tokens] int64, who wrote each of the step's tokens (``token_tags``)
    tags: torch.Tensor | None = None
    #: speculative decoding: the step's decode tokens ([tokens] bool) are
    #: held back (a draft may be rejected) and written at the next step as
    #: far as they were accepted: ``flush`` ([held tokens] bool) says which
    #: of the tokens held back at step ``flush_from`` were
    held: torch.Tensor | None = None
    held_as: int = 0
    flush: torch.Tensor | None = None
    flush_from: int = -1
    #: no token of the step goes into the indexer cache
    write_nothing: bool = False
    #: no layer reads the step's tokens in the step (it has no Stem row), every
    #: token is written and no draft is held: its writes may be staged and
    #: carried out at the next step's first write
    stage: bool = False
    #: every row a decode (or empty), none written: the layers hand the step
    #: to vLLM's kernel at once, its rows counted for them by the builder
    decode_only: bool = False
    _padded: tuple = ()  #: (tokens, tags padded to them), made once per step

    def tags_for(self, n: int) -> torch.Tensor | None:
        """``tags`` for a write of ``n`` slots: padding tokens (past the
        step's own) have no slot and tag 0."""
        tags = self.tags
        if tags is None or tags.shape[0] >= n:
            return tags
        if not self._padded or self._padded[0] != n:
            self._padded = (n, torch.nn.functional.pad(tags, (0, n - tags.shape[0])))
        return self._padded[1]


@dataclass
class StemAttentionMetadata(CPUAttentionMetadata):
    #: the step's plan (None: a step Stem does not touch, as the plain backend's)
    step: StepPlan | None = None


# --------------------------------------------------------------------------- #
# What the runner knows and the attention metadata does not: prompt lengths
# --------------------------------------------------------------------------- #


class _Step(threading.local):
    """The step being built, as the model runner's input batch has it."""

    prompts: list[int] | None = None
    requests: list[str] | None = None
    kinds: dict[int, str] | None = None
    tokens: torch.Tensor | None = None  #: [requests, max_model_len] token ids (no copy)
    error: str = ""  #: why the step could not be recorded ("" when it was)


_STEP = _Step()
_KINDS = RowKinds()
# Per request, the last row's end position and the tags of its last tokens
# (a list of ints: one, or under speculative decoding as many as a step may
# rewind over).
_TAGS: collections.OrderedDict = collections.OrderedDict()
_MAX_TAGGED = 4096


def _record_step(batch, scheduled) -> None:
    """The model runner's step, before its attention metadata is built (None
    after): its requests' prompt lengths, and the kinds of the rows still in
    their prompt (``patches.install_step_hook``). Never raises: a failure
    leaves the step to vLLM's kernel, counted as ``dense:error:<type>``."""
    _STEP.prompts = _STEP.requests = _STEP.kinds = _STEP.tokens = None
    _STEP.error = ""
    if batch is None:
        return
    try:
        n = batch.num_reqs
        prompts = batch.num_prompt_tokens_cpu_tensor[:n]
        computed = batch.num_computed_tokens_cpu_tensor[:n]
        requests = list(batch.req_ids[:n])
        # Only requests still in their prompt have a kind worth tracking.
        open_ = computed < prompts
        kinds = {r: _KINDS.kind(requests[r], c, p, scheduled.get(requests[r], 1))
                 for r, c, p in zip(open_.nonzero().flatten().tolist(),
                                    computed[open_].tolist(), prompts[open_].tolist())}
        _STEP.tokens = batch.token_ids_cpu_tensor
        _STEP.prompts, _STEP.requests, _STEP.kinds = prompts.tolist(), requests, kinds
    except Exception as exc:
        _STEP.error = f"error:{type(exc).__name__}"
        _report_once(f"hook:{_STEP.error}", "Stem could not read the step's requests (%s); "
                     "such steps run vLLM's kernel (counted as dense:%s)", exc, _STEP.error,
                     exc=exc)


def _step_tags(rows: torch.Tensor, context: torch.Tensor, q_lens: torch.Tensor,
               full: dict[int, torch.Tensor], keep: int = 1) -> torch.Tensor:
    """[tokens] int64: ``token_tags`` of the tokens of ``rows`` (in order;
    ``context`` and ``q_lens`` per row of the step), ``full[row]`` the tags
    of a row's whole sequence where the plan made them. Each request's last
    tag is kept, so that its next row (a decode, the next chunk) hashes its
    own tokens only (its last ``keep`` tags are kept, for a step that
    rewinds over rejected drafts): tensor work for the step, a dictionary
    lookup per row."""
    requests = _STEP.requests
    ctx, lens = context[rows], q_lens[rows]
    carries = []
    for r, c in zip(rows.tolist(), ctx.tolist()):
        if r in full:
            carries.append(int(full[r][c - 1]) if c else 0)
            continue
        end, kept = _TAGS.get(requests[r], (-1, ()))
        if c == 0:
            carry = 0
        elif end - len(kept) < c <= end:
            carry = kept[c - 1 - (end - len(kept))]
        else:
            carry = int(token_tags(_STEP.tokens[r, :c])[-1])
        carries.append(carry)
    offset = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens).repeat_interleave(lens)
    positions = ctx.repeat_interleave(lens) + offset
    ids = _STEP.tokens[rows.repeat_interleave(lens), positions]
    tags = row_tags(ids, positions, lens, torch.tensor(carries, dtype=torch.int64))
    values = tags.tolist()
    for r, end, stop, n in zip(rows.tolist(), (ctx + lens).tolist(),
                               torch.cumsum(lens, 0).tolist(), lens.tolist()):
        if n:
            _TAGS[requests[r]] = (end, values[max(stop - keep, stop - n):stop])
            _TAGS.move_to_end(requests[r])
    while len(_TAGS) > _MAX_TAGGED:
        _TAGS.popitem(last=False)
    return tags


# --------------------------------------------------------------------------- #
# Metadata: the step's plan
# --------------------------------------------------------------------------- #


class StemMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.layers = len(layer_names)  # the layers whose rows a decode-only step counts
        self.settings = StemSettings.from_config(vllm_config.additional_config)
        self.settings.check_kv_block_size(self.block_size)
        # Why none of this group's layers can run Stem ("" when some can): their
        # rows are then sorted, not planned.
        self.group_reason = ("sliding window" if self.window_size != -1 else
                             engine_reason(vllm_config)
                             or _layout_reason(self.isa, self.block_size, self.settings)
                             or _cache_dtype_reason(self.kv_cache_dtype))
        # Decode tokens' indexer-cache entries: without prefix caching no page
        # outlives its request and they would never be read; with it a later
        # prompt may share their pages, which are then read back from vLLM's
        # cache when a Stem row first reads them (``decoded_pages``), or, where
        # the layout cannot be read back, written at their step.
        self.write_decodes = bool(vllm_config.cache_config.enable_prefix_caching)
        if (self.write_decodes and not self.group_reason
                and self.settings.decoded_pages == "read_back"
                and page_reader(self.isa, self.dtype, self.block_size, self.num_kv_heads,
                                self.head_dim) is not None):
            self.write_decodes = False
        # With speculative decoding a decode row's drafts may be rejected: where
        # they are written, they are held back one step and written as far as
        # accepted.
        spec = vllm_config.speculative_config
        self.speculative = self.write_decodes and spec is not None
        self.rewind = getattr(spec, "num_speculative_tokens", None) or 0 if spec else 0
        self.held: list[tuple[str, int, int]] = []  # (request, first position, tokens)
        self.held_as = 0
        if self.group_reason and self.window_size == -1:
            _report_once(f"group:{self.group_reason}", "Stem: %s is not supported; these "
                         "layers run vLLM's kernel for every row (counted as dense:%s)",
                         self.group_reason, self.group_reason)
        install_step_hook(_record_step)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        md = StemAttentionMetadata(**{f.name: getattr(base, f.name)
                                      for f in dataclasses.fields(base)})
        if not isinstance(md.causal, bool) or not md.causal or md.encoder_cache is not None:
            return md
        try:
            md.step = self._plan(common_attn_metadata, md)
        except Exception as exc:  # the engine goes on: vLLM's kernel for this step
            reason = f"error:{type(exc).__name__}"
            _report_once(f"plan:{reason}", "Stem could not plan a step (%s); that step runs "
                         "vLLM's kernel (counted as dense:%s)", exc, reason, exc=exc)
            md.step = StepPlan(bulk=((reason, common_attn_metadata.num_reqs),))
        return md

    def _plan(self, cm, md: StemAttentionMetadata) -> StepPlan:
        n = cm.num_reqs
        if _STEP.error:
            return StepPlan(bulk=((_STEP.error, n),))
        prompts = _STEP.prompts
        if prompts is None or len(prompts) != n:
            return StepPlan(bulk=(("no prompt length", n),))
        if not self.write_decodes:
            decodes = decode_only(cm.query_start_loc_cpu[:n + 1].tolist(),
                                  cm.seq_lens[:n].tolist(), prompts)
            if decodes is not None:
                STATS.bulk(tuple((reason, count * self.layers) for reason, count in decodes))
                return StepPlan(bulk=decodes, write_nothing=True, decode_only=True)
        starts = cm.query_start_loc_cpu[:n + 1].to(torch.int64)
        seq_lens = cm.seq_lens[:n].to(device="cpu", dtype=torch.int64)
        q_lens = starts[1:] - starts[:-1]
        prompt = torch.tensor(prompts, dtype=torch.int64)
        context = seq_lens - q_lens
        decode = (q_lens > 0) & (context >= prompt)
        bulk = collections.Counter({"decode": int(decode.sum()),
                                    "empty row": int((q_lens == 0).sum())})
        kinds = _STEP.kinds or {}
        stem, dense = [], []
        for r in ((q_lens > 0) & (context < prompt)).nonzero().flatten().tolist():
            row = Row(r, int(starts[r]), int(q_lens[r]), int(context[r]), prompts[r],
                      kinds.get(r, "fresh"), _STEP.requests[r])
            budget = plan_row(row, self.settings)
            row = dataclasses.replace(row, visible=budget.visible)
            reason = self.group_reason or self._dense_reason(row, budget.share)
            if reason:
                dense.append((row, reason))
            else:
                stem.append(plan_stem_row(row, self.settings, md.block_table[r],
                                          self.block_size, self.num_heads, self.num_kv_heads,
                                          self.head_dim))
        plan = StepPlan(tuple(stem), tuple(dense), tuple((k, v) for k, v in bulk.items() if v))
        if not self.write_decodes:
            plan.write = decode_tokens_left_out(q_lens, decode)
            plan.write_nothing = plan.write is not None and not bool(plan.write.any())
        if self.group_reason:
            return plan  # no layer of the group keeps an indexer cache
        # Who writes each token (the rows the indexer cache takes), and who
        # must have written each page a Stem row reads.
        full = {s.row.index: token_tags(_STEP.tokens[s.row.index, :s.row.seq_len])
                for s in stem}
        writes = decode.logical_not() if plan.write is not None else torch.ones(n, dtype=bool)
        if not plan.write_nothing:
            tags = _step_tags(writes.nonzero().flatten(), context, q_lens, full,
                              self.rewind + 1)
            if plan.write is not None:  # the tokens left out get no tag
                plan.tags = torch.zeros(plan.write.shape[0], dtype=torch.int64)
                plan.tags[plan.write] = tags
            else:
                plan.tags = tags
        if self.speculative:
            self._hold(plan, decode, context, q_lens)
        plan.stage = not stem and not self.speculative and plan.write is None
        if stem:
            plan.pages = torch.cat([s.pages for s in stem])
            plan.fill = torch.cat([s.fill for s in stem])
            plan.page_tags = torch.cat([_page_tags(full[s.row.index], s.page) for s in stem])
            others = sorted(set(range(n)) - {s.row.index for s in stem})
            if others:
                plan.batch = self._dense_batch(md, others, starts, q_lens)
        return plan

    def _hold(self, plan: StepPlan, decode: torch.Tensor, context: torch.Tensor,
              q_lens: torch.Tensor) -> None:
        """Speculative decoding: which of the last step's held-back tokens were
        accepted (a request's context now reaches past them), and which of
        this step's to hold back (its decode rows')."""
        position = {req: int(c) for req, c in zip(_STEP.requests, context.tolist())}
        if self.held:
            plan.flush = torch.cat([torch.arange(n) < min(max(position.get(req, c) - c, 0), n)
                                    for req, c, n in self.held])
            plan.flush_from = self.held_as
        rows = decode.nonzero().flatten().tolist()
        self.held = [(_STEP.requests[r], int(context[r]), int(q_lens[r])) for r in rows]
        self.held_as += 1
        if rows:
            plan.held = decode.repeat_interleave(q_lens)
            plan.held_as = self.held_as
            plan.write = ~plan.held

    def _dense_reason(self, row: Row, share: float) -> str:
        s = self.settings
        if row.prompt < s.min_prompt_tokens:
            return "short prompt"
        if share >= 1.0 and s.dense_above < 1.0:
            return "budget keeps every block"
        if share > s.dense_above and not s.chunk_invariant:
            return "budget keeps most blocks"
        return ""

    def _dense_batch(self, md: StemAttentionMetadata, rows: list[int], starts: torch.Tensor,
                     q_lens: torch.Tensor) -> DenseRows:
        index = torch.tensor(rows)
        lens = q_lens[index].to(torch.int32)
        qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=qsl[1:])
        seq_lens = md.seq_lens[index]
        scheduler = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(rows), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype,
            query_start_loc=qsl, causal=True, sliding_window_size=self.window_size,
            isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=self.kv_cache_dtype)
        spans = tuple((int(starts[r]), int(starts[r] + q_lens[r])) for r in rows)
        return DenseRows(spans, qsl, seq_lens, md.block_table[index], scheduler)


def _step_of(layer) -> StepPlan | None:
    """The plan of the step this layer is in (None where the forward context
    has none for it: every token is then written)."""
    try:
        md = get_forward_context().attn_metadata
    except Exception:  # outside a forward: no plan
        return None
    if isinstance(md, dict):
        md = md.get(getattr(layer, "layer_name", ""))
    return getattr(md, "step", None)


def _page_tags(tags: torch.Tensor, page: int) -> torch.Tensor:
    """The tag each page of a sequence keeps when every token was written:
    its last token's (``tags`` of the whole sequence)."""
    n = tags.shape[0]
    last = torch.clamp(torch.arange(page, n + page, page), max=n) - 1
    return tags[last]


def _cache_dtype_reason(kv_cache_dtype: str) -> str:
    """Why a KV-cache dtype cannot run Stem ("" when it can)."""
    return "" if kv_cache_dtype in ("auto", None) else f"kv cache dtype {kv_cache_dtype}"


def _layout_reason(isa: str, page: int, settings: StemSettings) -> str:
    """Why a cache layout cannot run Stem ("" when it can)."""
    if isa not in LAYOUTS:
        return f"kv cache layout {isa}"
    if page % settings.stride:
        return f"kv cache block size {page} not a multiple of stem_stride {settings.stride}"
    return ""


# --------------------------------------------------------------------------- #
# The layer
# --------------------------------------------------------------------------- #


_LAYER_COUNT = [0]
# Requests a layer keeps a miss-check verdict for; one aborted mid-prompt is
# forgotten after this many newer ones.
_MAX_VERDICTS = 4096
# The layers that may keep an indexer cache (no reason against it when made).
_WRITING_LAYERS = [0]
# Callables given every Stem row a layer ran (``observe``) and every indexer
# cache write (``observe_writes``): for tests and diagnostics that compare the
# backend with Stem's own functions on the same inputs.
_OBSERVERS: list = []
_WRITE_OBSERVERS: list = []
# Reported once per process: the first failure of each kind, and the cache's size.
_REPORTED: set = set()
# The last indexer-cache write plan (index_cache.WritePlan): the next layer's
# write of the same step reuses it; and the last plan of held-back tokens'.
_WRITE_PLAN: list = [None]
_FLUSH_PLAN: list = [None]
# The staged writes of a step without Stem rows, every layer's at once
# (index_cache.WriteStage; made when the first indexer cache is bound).
_STAGE: list = [None]
#: the most tokens a staged step writes per layer (more: written at once)
STAGE_TOKENS = 256
# Per (layout, dtype, page, KV heads, head size): the reader of vLLM's cache
# pages (kv_read.PageReader), or None where that layout cannot be read back.
_READERS: dict = {}


def page_reader(isa: str, dtype: torch.dtype, page: int, heads: int,
                dim: int) -> PageReader | None:
    """The reader of this cache layout's pages, probed once per process with
    vLLM's own writer (None, said once, where it cannot be read back)."""
    key = (isa, dtype, page, heads, dim)
    if key not in _READERS:
        _READERS[key] = None
        try:
            if isa == "amx":  # the probe's writer runs tile instructions
                torch._C._cpu._init_amx()
            _READERS[key] = PageReader.probe(
                lambda k, v, kc, vc, slots: ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots,
                                                                           isa),
                page, heads, dim, dtype)
        except Exception as exc:
            _report_once(f"reader:{isa}", "Stem cannot read back vLLM's %s cache pages (%s); "
                         "decoded tokens are written to the indexer cache at their step",
                         isa, exc)
    return _READERS[key]


@dataclass(frozen=True)
class RowTrace:
    """One Stem row of one layer, as it ran: the row's plan, its queries
    ``[q_len, Hq, D]``, the indexer's key-side inputs from the indexer cache
    (``kflat [Hkv, Kb, Ts*D]``, ``vbias [Hkv, Kb]``), the selection
    (``indices [Hq, Qb, W]``, ``lengths [Hq, Qb]``) and the output
    ``[q_len, Hq, D]``."""

    layer: str
    plan: StemRow
    scale: float
    query: torch.Tensor
    kflat: torch.Tensor
    vbias: torch.Tensor
    indices: torch.Tensor
    lengths: torch.Tensor
    output: torch.Tensor

    @property
    def row(self) -> Row:
        return self.plan.row


def observe(fn) -> None:
    """Call ``fn(RowTrace)`` for every Stem row this process runs from now on."""
    _OBSERVERS.append(fn)


def observe_writes(fn) -> None:
    """Call ``fn(layer_name, key, value, slot_mapping, written)`` for every
    step's keys and values a Stem layer of this process writes from now on:
    ``slot_mapping`` where vLLM's cache takes them, ``written`` where the
    indexer cache does (-1 for the tokens it leaves out)."""
    _WRITE_OBSERVERS.append(fn)


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    except Exception:  # no parallel state (single process tools)
        return 0


def _report_once(key: str, message: str, *args, exc: BaseException | None = None,
                 level: int = logging.WARNING) -> None:
    if key in _REPORTED:
        return
    _REPORTED.add(key)
    _LOG.log(level, message, *args, exc_info=exc)


def _write_failed(cache: IndexCache | None, slots: torch.Tensor, exc: Exception) -> None:
    """A failed indexer-cache write: its pages become unusable (only
    those), counted and logged once."""
    if cache is not None:
        try:
            cache.invalidate(slots)
        except Exception:  # the pages cannot be told apart: none is usable
            cache.filled.fill_(-1)
    STATS.count(f"dense:error:{type(exc).__name__}")
    _report_once(f"write:{type(exc).__name__}", "Stem: writing the indexer cache "
                 "failed (%s); the pages it left unwritten run vLLM's kernel",
                 exc, exc=exc)


def flush_staged(step: "StepPlan | None" = None) -> None:
    """Carry out the staged writes of a step other than ``step`` (all of them
    without one): before a step writes or reads an indexer cache, the last
    step's staged tokens are in it. A failure leaves only the staged pages
    unusable, in the layers it hit, counted as a failed write."""
    stage = _STAGE[0]
    if stage is None or not stage.pending or (step is not None and stage.owner is step):
        return
    slots, caches = stage.slots, list(stage.caches)
    try:
        failed = stage.flush()
        STATS.stage(len(caches))
    except Exception as exc:
        failed = [(cache, exc) for cache in caches]
        stage.caches, stage.owner = [], None
    for cache, exc in failed:
        _write_failed(cache, slots, exc)


class StemAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                 sliding_window, kv_cache_dtype, logits_soft_cap=None,
                 attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, sinks)
        config = get_current_vllm_config()
        self.settings = StemSettings.from_config(config.additional_config)
        # This layer's place in its model: the layers vLLM registered before it
        self.index = len(getattr(config.compilation_config, "static_forward_context", ()))
        self.layer_reason = engine_reason(config) or self._layer_reason()
        self.budget = self.settings.layer_params(self.index)  # its layer_budgets entry's
        #: the miss check's verdicts, by request: whether this layer keeps every
        #: block for the rest of the request's prompt (``miss_check``)
        self.verdicts: dict[str, bool] = {}
        self.index_cache: IndexCache | None = None
        self.held = None  # speculative decoding: (step, key, value, slots, tags) held back
        self.staged_for = None  # the KV cache this layer's staged writes were checked for
        # (reader, paged, bf16): Stem's kernel reads the pages, packing them itself
        # where paged, multiplying as bf16 says (sparse_attention's); (None, False,
        # "auto"): vLLM's kernel
        self.sparse = None
        self.ordinal = _LAYER_COUNT[0]
        _LAYER_COUNT[0] += 1
        _WRITING_LAYERS[0] += not self.layer_reason
        STATS.layers = _LAYER_COUNT[0]
        STATS.log_requests = _tp_rank() == 0

    def _layer_reason(self) -> str:
        """Why this layer can never run Stem ("" when it can; its cache layout
        is known later, from the layer)."""
        if self.attn_type != AttentionType.DECODER:
            return f"{self.attn_type} attention"
        if self.sliding_window != -1:
            return "sliding window"
        if self.alibi_slopes is not None:
            return "alibi"
        if self.sinks is not None:
            return "attention sinks"
        if self.kv_sharing_target_layer_name is not None:
            return "kv sharing"
        if self.is_fp8_kv_cache:
            return f"kv cache dtype {self.kv_cache_dtype}"
        if self.settings.dense_layer(self.index):
            return "dense layer"
        return ""

    def _reason(self, layer, kv_cache: torch.Tensor) -> str:
        """Why this layer's rows run vLLM's kernel ("" when Stem can serve them)."""
        return self.layer_reason or _layout_reason(getattr(layer, "isa", "unknown"),
                                                    kv_cache.shape[2], self.settings)

    # The indexer cache ------------------------------------------------------

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        written = None
        try:
            step = _step_of(layer)
            if step is not None and step.write_nothing:  # a step of decodes only
                if _WRITE_OBSERVERS and not self._reason(layer, kv_cache):
                    self._observed(layer, key, value, slot_mapping,
                                   torch.full_like(slot_mapping, -1))
                return
            if step is not None and step.stage and self._stage_turn(layer, key, value, kv_cache,
                                                                     slot_mapping, step):
                return
            if self._reason(layer, kv_cache):
                return
            n = slot_mapping.shape[0]
            written = slot_mapping  # the slots the indexer cache takes (-1: none)
            cache = self._index_cache(kv_cache)
            flush_staged(step)
            if step is not None:
                self._flush(cache, step)
            if step is not None and step.write is not None:
                written = slot_mapping.clone()
                keep = step.write[:n]
                written[:keep.shape[0]].masked_fill_(~keep, -1)
            tags = None if step is None else step.tags_for(n)
            # One plan of the step's slots serves every layer (checked to fit).
            _WRITE_PLAN[0] = cache.write(key[:n], value[:n], written, _WRITE_PLAN[0],
                                         tags=tags)
            if step is not None and step.held is not None:
                held = step.held[:n]
                self.held = (step.held_as, key[:held.shape[0]][held].clone(),
                             value[:held.shape[0]][held].clone(),
                             slot_mapping[:held.shape[0]][held].clone(),
                             step.tags[:held.shape[0]][held].clone())
            self._observed(layer, key[:n], value[:n], slot_mapping, written)
        except Exception as exc:  # the engine goes on; the pages written run vLLM's kernel
            _write_failed(self.index_cache, slot_mapping if written is None else written, exc)

    def _stage_turn(self, layer, key, value, kv_cache, slot_mapping, step: StepPlan) -> bool:
        """A step the plan lets stage (``StepPlan.stage``): this layer's keys
        and values go to the write stage, with as little as can be checked
        per layer (a decode step's whole cost here). False: the general path
        takes the write."""
        stage, cache = _STAGE[0], self.index_cache
        if stage is None or cache is None:
            return False
        if self.staged_for is not kv_cache:  # asked once per KV cache
            if self._reason(layer, kv_cache) or cache.ksum.shape[0] != kv_cache.shape[0]:
                return False
            self.staged_for = kv_cache
        n = slot_mapping.shape[0]
        if key.shape[0] != n:
            key, value = key[:n], value[:n]
        if stage.owner is not step:
            flush_staged(step)
        if not stage.takes(cache, key, value):
            return False
        stage.put(step, cache, key, value, slot_mapping, step.tags_for(n))
        self._observed(layer, key, value, slot_mapping, slot_mapping)
        return True

    @staticmethod
    def _observed(layer, key, value, slot_mapping, written) -> None:
        for fn in _WRITE_OBSERVERS:
            fn(getattr(layer, "layer_name", ""), key, value, slot_mapping, written)

    def _flush(self, cache: IndexCache, step: StepPlan) -> None:
        """Speculative decoding: write the tokens held back at the last step
        as far as they were accepted (before this step's, which follow them
        on their pages); the rejected drafts never reach the indexer cache."""
        held, self.held = self.held, None
        if held is None or step.flush is None or held[0] != step.flush_from:
            return  # nothing held, or held at a step this one does not follow
        _, key, value, slots, tags = held
        accepted = step.flush[:slots.shape[0]]
        if self.ordinal == 0:
            kept = int(accepted.sum())
            STATS.speculative(kept, slots.shape[0] - kept)
        if bool(accepted.any()):
            _FLUSH_PLAN[0] = cache.write(key[accepted], value[accepted], slots[accepted],
                                         _FLUSH_PLAN[0], tags=tags[accepted])

    def bind_index_cache(self, kv_cache: torch.Tensor) -> None:
        """Allocate this layer's indexer cache for its KV cache (when vLLM
        binds the KV cache, inside its budget: ``patches.reserve_index_cache``).
        A failure is logged once and never retried: the layer's rows run
        vLLM's kernel, counted as ``dense:error:<type>``."""
        if self.layer_reason or self.index_cache is not None:
            return
        num_pages, _, page, _ = kv_cache.shape
        try:
            self.index_cache = IndexCache.allocate(num_pages, page, self.settings.stride,
                                                   self.num_kv_heads, self.head_size)
        except Exception as exc:
            self.layer_reason = f"error:{type(exc).__name__}"
            _report_once(f"allocate:{self.layer_reason}", "Stem could not allocate its "
                         "indexer cache (%s); the layers without one run vLLM's kernel "
                         "(counted as dense:%s)", exc, self.layer_reason, exc=exc)
            return
        if _STAGE[0] is None:
            try:
                _STAGE[0] = WriteStage(_WRITING_LAYERS[0], STAGE_TOKENS, self.num_kv_heads,
                                       self.head_size, kv_cache.dtype)
                STATS.bound(_STAGE[0].nbytes, 0, "write_stage_bytes")
            except Exception as exc:  # every write is then made at once
                _report_once("stage", "Stem could not allocate its write stage (%s); each "
                             "layer writes its indexer cache on its own", exc, exc=exc)
        kv_bytes = kv_cache.numel() * kv_cache.element_size()
        STATS.bound(self.index_cache.nbytes, kv_bytes)
        key = "cache size"
        if key not in _REPORTED:
            _REPORTED.add(key)
            _LOG.info("Stem indexer cache: %.1f MiB per full-attention layer beside its "
                      "%.1f MiB of KV cache (%.1f%%), inside the KV-cache budget",
                      self.index_cache.nbytes / 2**20, kv_bytes / 2**20,
                      100 * self.index_cache.nbytes / kv_bytes)

    def _index_cache(self, kv_cache: torch.Tensor) -> IndexCache:
        cache = self.index_cache
        if cache is None or cache.ksum.shape[0] != kv_cache.shape[0]:
            self.index_cache = None
            self.bind_index_cache(kv_cache)
            if self.index_cache is None:
                raise RuntimeError(f"no indexer cache ({self.layer_reason})")
        return self.index_cache

    def index_cache_bytes(self, num_pages: int, page: int) -> int:
        """Bytes of this layer's indexer cache for ``num_pages`` KV pages (0
        where the layer never runs Stem)."""
        if self.layer_reason:
            return 0
        return index_cache_bytes(num_pages, page, self.settings.stride, self.num_kv_heads,
                                 self.head_size)

    def write_stage_bytes(self, dtype: torch.dtype) -> int:
        """This layer's share of the write stage (``STAGE_TOKENS`` keys and
        values of ``dtype``; 0 where the layer never runs Stem)."""
        if self.layer_reason:
            return 0
        return 2 * STAGE_TOKENS * self.num_kv_heads * self.head_size * dtype.itemsize

    # Attention --------------------------------------------------------------

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        step = getattr(attn_metadata, "step", None)
        if step is None or output_scale is not None or step.decode_only:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        try:
            reason = self._stem_reason(layer, kv_cache, step) if step.stem else ""
            if not reason and step.stem:
                rows = self._forward_stem(layer, query, kv_cache, step, output)
                self._count(layer, step, "", rows)
                return output
        except Exception as exc:  # the engine goes on: vLLM's kernel for this step
            reason = f"error:{type(exc).__name__}"
            _report_once(reason, "Stem failed in layer %s (%s); that layer's step runs "
                         "vLLM's kernel (counted as dense:%s)",
                         getattr(layer, "layer_name", "?"), exc, reason, exc=exc)
        try:
            self._count(layer, step, reason)
        except Exception as exc:
            _report_once(f"count:{type(exc).__name__}", "Stem could not count a step's rows "
                         "(%s)", exc, exc=exc)
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)

    def _stem_reason(self, layer, kv_cache: torch.Tensor, step: StepPlan) -> str:
        """Why the step's Stem rows run vLLM's kernel in this layer ("" when
        they run Stem)."""
        reason = self._reason(layer, kv_cache)
        if not reason and self.settings.probe_queries and self._keys_reader(layer,
                                                                            kv_cache) is None:
            reason = f"probe: kv cache layout {getattr(layer, 'isa', 'unknown')} not readable"
        if not reason:
            flush_staged(step)
            cache = self.index_cache
            if cache is None:
                return "indexer cache incomplete"
            usable = cache.usable(step.pages, step.fill, step.page_tags)
            if not bool(usable.all()) and not self._read_back(layer, cache, kv_cache, step,
                                                              usable):
                reason = "indexer cache incomplete"
        return reason

    def _sparse_reader(self, layer,
                       kv_cache: torch.Tensor) -> tuple[PageReader | None, bool, str]:
        """The reader of this layer's pages where Stem's kernel attends its
        Stem rows (``sparse_kernel``), None where vLLM's kernel does on
        virtual rows; whether the kernel packs the keys and values straight
        from the pages (else the reader reads them out first); and its
        ``bf16`` (``sparse_products``). Chosen at the layer's first Stem row;
        the choice is said once per process."""
        if self.sparse is None:
            reader, why = self._choose_kernel(layer, kv_cache)
            isa = getattr(layer, "isa", "unknown")
            refused = None if reader is None else sparse_kernel.paged_refused(
                kv_cache.shape[2], self.head_size, self.settings.block_size, reader.key_view,
                reader.value_view, kv_cache.dtype)
            paged = reader is not None and refused is None
            self.sparse = (reader, paged, self._products(kv_cache, reader, paged))
            if paged:
                products = sparse_kernel.paged_products(
                    kv_cache.shape[2], self.head_size, self.settings.block_size,
                    reader.key_view, reader.value_view, self.sparse[2])
                _report_once("kernel:stem", "Stem rows run Stem's block-sparse kernel on keys "
                             "and values it packs straight from vLLM's %s cache pages: %s",
                             isa, products, level=logging.INFO)
            elif reader is not None:
                _report_once("kernel:stem", "Stem rows run Stem's block-sparse kernel on keys "
                             "and values read from vLLM's %s cache (not packed from its pages: "
                             "%s)", isa, refused, level=logging.INFO)
            elif self.settings.sparse_kernel == "stem":
                _report_once(f"kernel:{why}", "sparse_kernel='stem' cannot run here (%s); "
                             "Stem rows run vLLM's kernel on virtual rows", why)
            else:
                _report_once(f"kernel:{why}", "Stem rows run vLLM's kernel on virtual rows "
                             "(%s)", why, level=logging.INFO)
        return self.sparse

    def _products(self, kv_cache: torch.Tensor, reader: PageReader | None, paged: bool) -> str:
        """Stem's kernel's ``bf16`` for ``sparse_products``: ``"bfloat16"``
        where the micro-kernel takes these pages here, else ``"auto"`` (said
        once)."""
        want = SPARSE_PRODUCTS[self.settings.sparse_products]
        if want != "brgemm" or reader is None:
            return want
        bs = self.settings.block_size
        if kv_cache.dtype != torch.bfloat16:
            refused = f"the cache is {kv_cache.dtype}"
        elif paged:
            refused = sparse_kernel.paged_refused(kv_cache.shape[2], self.head_size, bs,
                                                  reader.key_view, reader.value_view,
                                                  kv_cache.dtype, "brgemm")
        else:
            refused = sparse_kernel.bf16_packed(self.head_size, bs)
        if refused is None:
            return want
        _report_once(f"products:{refused}", "sparse_products='bfloat16' cannot run here (%s); "
                     "Stem's kernel multiplies as 'auto' does", refused)
        return "auto"

    def _choose_kernel(self, layer, kv_cache: torch.Tensor) -> tuple[PageReader | None, str]:
        """(the reader, "") where Stem's kernel attends this layer's Stem rows;
        (None, why) where vLLM's kernel does."""
        want = self.settings.sparse_kernel
        if want == "vllm":
            return None, "sparse_kernel='vllm'"
        isa, dtype = getattr(layer, "isa", "unknown"), kv_cache.dtype
        reader = self._keys_reader(layer, kv_cache)
        if reader is None:
            return None, f"the {isa} cache layout cannot be read back"
        if not sparse_kernel.available():
            return None, f"Stem's kernel is unavailable: {sparse_kernel.status()}"
        if dtype not in sparse_kernel.DTYPES:
            return None, f"Stem's kernel takes float32 or bfloat16, not {dtype}"
        if want == "auto":
            if reader.key_view is None or reader.value_view is None:
                return None, f"the {isa} layout is read back element by element"
            if isa not in STEM_KERNEL_FASTER_ON:
                return None, (f"on the {isa} layout Stem's kernel, the read included, was not "
                              "measured faster than vLLM's")
            largest = STEM_KERNEL_FASTER_ON[isa]
            if largest is not None and self.head_size > largest:
                return None, (f"on the {isa} layout Stem's kernel, the read included, was "
                              f"measured faster only up to head size {largest} (this layer's: "
                              f"{self.head_size})")
            if dtype != torch.bfloat16:
                return None, f"Stem's kernel is the faster only in bfloat16, not {dtype}"
            refused = sparse_kernel.bf16_packed(self.head_size, self.settings.block_size)
            if refused:
                return None, f"bfloat16 would be widened: {refused}"
        return reader, ""

    def _keys_reader(self, layer, kv_cache: torch.Tensor) -> PageReader | None:
        """The reader of this layer's cache pages (the probe reads keys back)."""
        _, heads, page, width = kv_cache.shape
        return page_reader(getattr(layer, "isa", ""), kv_cache.dtype, page, heads, width // 2)

    def _read_back(self, layer, cache: IndexCache, kv_cache: torch.Tensor, step: StepPlan,
                   usable: torch.Tensor) -> bool:
        """Rebuild the entries of the pages the step's Stem rows read that the
        indexer cache does not hold as they expect (``usable`` False: pages
        that decode steps filled, say) from the tokens in vLLM's own cache,
        which this step's keys have already reached. Returns whether the
        cache is then complete (False where the layout cannot be read back)."""
        num_pages, heads, page, width = kv_cache.shape
        reader = _READERS.get((getattr(layer, "isa", ""), kv_cache.dtype, page, heads,
                               width // 2))
        if reader is None:
            return False
        missing = (~usable).cpu().nonzero().flatten()
        first = {}  # page -> its first place in the step's list (rows may share a page)
        for i, p in zip(missing.tolist(), step.pages[missing].tolist()):
            first.setdefault(p, i)
        at = torch.tensor(list(first.values()), dtype=torch.int64)
        pages, fill = step.pages[at].to(torch.int64), step.fill[at].to(torch.int64)
        keys, values = reader.read(kv_cache, pages)
        offsets = torch.arange(page)
        took = (offsets[None, :] < fill[:, None]).flatten()
        slots = (pages[:, None] * page + offsets).flatten()[took]
        tags = step.page_tags[at][:, None].expand(-1, page).flatten()[took]
        cache.write(keys[took], values[took], slots, tags=tags)
        STATS.read_back(pages.shape[0])
        return cache.complete(step.pages, step.fill, step.page_tags)

    def _count(self, layer, step: StepPlan, reason: str, sparse=()) -> None:
        """One layer's rows into the stats: the bulk rows at once, the prefill
        rows one by one (a request's record, and its log line, covers them)."""
        name = getattr(layer, "layer_name", "")
        first = self.ordinal == 0
        STATS.bulk(step.bulk)
        for row, why in step.dense:
            pairs = row.visible * self.num_heads
            STATS.row(name, row.request, row.prompt, f"dense:{why}", pairs, pairs,
                      row.seq_len >= row.prompt, first)
        if reason:
            for plan in step.stem:
                pairs = plan.row.visible * self.num_heads
                STATS.row(name, plan.row.request, plan.row.prompt, f"dense:{reason}", pairs,
                          pairs, plan.row.seq_len >= plan.row.prompt, first)
        kernel = "vllm" if self.sparse is None or self.sparse[0] is None else "stem"
        for plan, kept, widened in sparse:
            row = plan.row
            STATS.row(name, row.request, row.prompt,
                      "dense:miss check" if widened else f"sparse:{row.kind}", kept,
                      row.visible * self.num_heads, row.seq_len >= row.prompt, first,
                      getattr(layer, "isa", ""), kernel)

    def _kernel(self, layer, query, key_cache, value_cache, out, qsl, seq_lens, table,
                scheduler, *, sliding_window: int) -> None:
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=qsl, seq_lens=seq_lens, scale=self.scale, causal=True,
            alibi_slopes=None, sliding_window=sliding_window, block_table=table,
            softcap=self.logits_soft_cap, scheduler_metadata=scheduler, s_aux=None,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype)

    def _forward_stem(self, layer, query, kv_cache, step: StepPlan, output):
        """The step's Stem rows (on Stem's kernel or on vLLM's virtual rows)
        and its other rows as a batch; returns ``[(plan, kept pairs, widened
        by the miss check)]`` of the Stem rows."""
        out = output.view(-1, self.num_heads, self.head_size)
        query = query.view(-1, self.num_heads, self.head_size)
        num_pages, hkv, page, width2 = kv_cache.shape
        if step.batch is not None:
            key_cache, value_cache = kv_cache.view(num_pages, hkv, 2 * page,
                                                   -1).chunk(2, dim=2)
            self._run_dense(layer, query, key_cache, value_cache, step.batch, out)
        s, cache = self.settings, self.index_cache
        reader, paged, bf16 = self._sparse_reader(layer, kv_cache)
        checking = self._checks(layer, kv_cache)
        virtual, done, traces = [], [], []
        for plan in step.stem:
            plan = plan.for_budget(self.budget)
            row = plan.row
            q = query[row.start:row.start + row.q_len]
            keys = values = None
            if reader is not None and not paged:
                keys, values = reader.read_heads(kv_cache, plan.pages)
            elif s.probe_queries:
                keys, _ = self._keys_reader(layer, kv_cache).read_heads(kv_cache, plan.pages,
                                                                        values=False)
            wide = self.verdicts.get(row.request) if checking else None
            if wide:
                kflat = vbias = None
                idx, lengths = (x[0] for x in plan.paged.every_block())
            else:
                kflat, vbias = cache.inputs(plan.pages, row.seq_len, s.block_size, s.oam,
                                            s.oam_lambda, stat_runs=plan.paged.oam_runs)
                idx, lengths = select_blocks(q, kflat, vbias, plan, self.scale, s,
                                             None if keys is None else keys.transpose(0, 1),
                                             self.logits_soft_cap)
                if (checking and wide is None and row.prompt >= s.miss_check_min_prompt
                        and row.context >= s.miss_check_from):
                    wide = self._check(layer, kv_cache, plan, q, keys, idx, lengths)
                    if wide:
                        idx, lengths = (x[0] for x in plan.paged.every_block())
            if row.seq_len >= row.prompt:  # the prompt's last chunk: its verdict is done
                self.verdicts.pop(row.request, None)
            if paged:
                out[row.start:row.start + row.q_len] = attend_row_paged(
                    q, kv_cache, reader, idx, lengths, plan, self.scale, self.logits_soft_cap,
                    bf16)
            elif reader is not None:
                out[row.start:row.start + row.q_len] = attend_row(
                    q, keys, values, idx, lengths, plan, self.scale, self.logits_soft_cap, bf16)
            else:
                virtual.append((plan, q, virtual_rows(idx, lengths, plan, s.block_size, page,
                                                      hkv)))
            done.append((plan, int(lengths.sum()), bool(wide)))
            if _OBSERVERS:
                traces.append((plan, q, kflat, vbias, idx, lengths))
        if virtual:
            self._run_virtual(layer, kv_cache, virtual, out)
        name = getattr(layer, "layer_name", "")
        for plan, q, kflat, vbias, idx, lengths in traces:
            row = plan.row
            trace = RowTrace(name, plan, self.scale, q, kflat, vbias, idx, lengths,
                             out[row.start:row.start + row.q_len].clone())
            for fn in _OBSERVERS:
                fn(trace)
        return done

    def _checks(self, layer, kv_cache: torch.Tensor) -> bool:
        """Whether this layer's Stem rows run the miss check: set, and the
        layout's keys can be read back (else said once)."""
        if not self.settings.checks_misses:
            return False
        if self._keys_reader(layer, kv_cache) is None:
            isa = getattr(layer, "isa", "unknown")
            _report_once(f"miss check:{isa}", "miss_check is off on vLLM's %s cache layout "
                         "(its keys cannot be read back); Stem's selection stands", isa)
            return False
        return True

    def _check(self, layer, kv_cache: torch.Tensor, plan, q, keys, idx, lengths) -> bool | None:
        """The miss check of a request's Stem row in this layer (``miss_check``):
        whether the layer keeps every block for the rest of the prompt, kept
        as the request's verdict (``StemSettings.verdict``: a pass is kept
        only where the sample dropped enough to tell; else the next row is
        checked again); None where the row has no sparse query block to
        sample. ``keys [Hkv, >= seq_len, D]`` where read already."""
        s, row = self.settings, plan.row
        if keys is None:
            keys, _ = self._keys_reader(layer, kv_cache).read_heads(kv_cache, plan.pages,
                                                                    values=False)
        miss, sampled, dropped = selection_miss(
            q, keys.transpose(0, 1), idx, lengths, context=row.seq_len - row.q_len,
            seq_len=row.seq_len, block_size=s.block_size, queries=s.miss_check_queries,
            blocks=s.miss_check_blocks, scale=self.scale, softcap=self.logits_soft_cap)
        if not sampled:
            return None
        wide = s.verdict(miss, dropped)
        STATS.check(getattr(layer, "layer_name", ""), miss, bool(wide))
        if wide is None:  # this row keeps its selection; the next is checked again
            return False
        if row.request:  # (a row of no known request is checked each time)
            if len(self.verdicts) >= _MAX_VERDICTS:  # requests aborted mid-prompt
                self.verdicts.pop(next(iter(self.verdicts)))
            self.verdicts[row.request] = wide
        return wide

    def _run_virtual(self, layer, kv_cache: torch.Tensor, virtual: list, out) -> None:
        """vLLM's kernel on the virtual rows of ``virtual`` (``[(plan, q,
        VirtualRows)]``), in one call: one query head and one query block each,
        over the cache viewed as ``[num_pages * Hkv, 1, page, 2D]``."""
        num_pages, hkv, page, width2 = kv_cache.shape
        queries = [q.transpose(0, 1).reshape(-1, 1, self.head_size) for _, q, _ in virtual]
        parts = [p for _, _, p in virtual]
        vq = torch.cat(queries) if len(queries) > 1 else queries[0]
        q_lens = torch.cat([p.query_lens for p in parts])
        seq_lens = torch.cat([p.seq_lens for p in parts])
        width = max(p.block_table.shape[1] for p in parts)
        table = torch.cat([torch.nn.functional.pad(p.block_table,
                                                   (0, width - p.block_table.shape[1]))
                           for p in parts])
        qsl = torch.zeros(q_lens.shape[0] + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=qsl[1:])
        flat = kv_cache.view(num_pages * hkv, 1, 2 * page, width2 // 2)
        flat_k, flat_v = flat.chunk(2, dim=2)
        scheduler = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=q_lens.shape[0], num_heads=1, num_kv_heads=1, head_dim=self.head_size,
            seq_lens=seq_lens, dtype=vq.dtype, query_start_loc=qsl, causal=True,
            sliding_window_size=-1, isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=self.kv_cache_dtype)
        vo = torch.empty_like(vq)
        self._kernel(layer, vq, flat_k, flat_v, vo, qsl, seq_lens, table, scheduler,
                     sliding_window=-1)
        at = 0
        for plan, _, _ in virtual:
            row = plan.row
            n = self.num_heads * row.q_len
            out[row.start:row.start + row.q_len] = (
                vo[at:at + n].view(self.num_heads, row.q_len, self.head_size).transpose(0, 1))
            at += n

    def _run_dense(self, layer, query, key_cache, value_cache, dense: DenseRows, out) -> None:
        """vLLM's kernel on the step's other rows, as a batch of their own."""
        if len(dense.spans) == 1:
            (a, b), = dense.spans
            q, o = query[a:b], out[a:b]
        else:
            q = torch.cat([query[a:b] for a, b in dense.spans])
            o = torch.empty_like(q)
        self._kernel(layer, q, key_cache, value_cache, o, dense.query_start_loc,
                     dense.seq_lens, dense.block_table, dense.scheduler_metadata,
                     sliding_window=self.sliding_window)
        if len(dense.spans) > 1:
            at = 0
            for a, b in dense.spans:
                out[a:b] = o[at:at + b - a]
                at += b - a
