"""The vLLM attention backend: vLLM's CPU backend, with Stem on long prefill rows.

Imported by vLLM (the class path registered for ``AttentionBackendEnum.CUSTOM``)
in its worker processes. Per step the metadata builder sorts the rows:

* a row of a request still in its prompt, of a prompt at least
  ``min_prompt_tokens`` long, whose budget keeps at most ``dense_above`` of its
  visible block pairs, runs **Stem**: the indexer on the row's queries and on
  the keys and values read back from the paged cache, then vLLM's own paged
  kernel on *virtual rows* that list only the kept pages (``rows.py``);
* every other row (decodes, short prompts, rows the budget keeps nearly whole)
  runs **vLLM's kernel** as it would without this backend. A step without a
  Stem row is exactly the plain backend's call.

A layer Stem cannot serve (sliding window, ALiBi, attention sinks, encoder or
cross attention, a quantised KV cache, a cache layout other than ``vec``) runs
vLLM's kernel for every row, and the reason is counted.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from .rows import Row, RowKinds, context_kv, plan_row, select_blocks, virtual_rows
from .settings import StemSettings
from .stats import STATS

__all__ = ["StemAttentionBackend", "StemAttentionImpl", "StemMetadataBuilder",
           "StemAttentionMetadata", "RowTrace", "observe"]


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
class StemAttentionMetadata(CPUAttentionMetadata):
    #: the step's rows that run Stem (empty: the step is the plain backend's)
    stem_rows: tuple[Row, ...] = ()
    #: the step's other rows, with the reason each runs vLLM's kernel
    dense_rows: tuple[tuple[Row, str], ...] = ()
    #: those rows as a batch, where Stem rows run beside them
    dense: DenseRows | None = None


# --------------------------------------------------------------------------- #
# What the runner knows and the attention metadata does not: prompt lengths
# --------------------------------------------------------------------------- #


class _Step(threading.local):
    """The step being built, as the model runner's input batch has it."""

    prompts: list[int] | None = None
    requests: list[str] | None = None
    kinds: list[str] | None = None


_STEP = _Step()
_KINDS = RowKinds()


def _install_step_hook() -> None:
    """Wrap the runner's metadata build so that each step records its
    requests' prompt lengths (idempotent; in the calling process only)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    build = GPUModelRunner._build_attention_metadata
    if getattr(build, "_stem_step_hook", False):
        return

    @functools.wraps(build)
    def hooked(self, *args, **kwargs):
        batch = self.input_batch
        n = batch.num_reqs
        prompts = batch.num_prompt_tokens_cpu_tensor[:n].tolist()
        computed = batch.num_computed_tokens_cpu_tensor[:n].tolist()
        requests = list(batch.req_ids[:n])
        scheduled = kwargs.get("num_scheduled_tokens") or {}
        _STEP.prompts, _STEP.requests = prompts, requests
        _STEP.kinds = [_KINDS.kind(r, c, p, scheduled.get(r, 1))
                       for r, c, p in zip(requests, computed, prompts)]
        try:
            return build(self, *args, **kwargs)
        finally:
            _STEP.prompts = _STEP.requests = _STEP.kinds = None

    hooked._stem_step_hook = True
    GPUModelRunner._build_attention_metadata = hooked


# --------------------------------------------------------------------------- #
# Metadata
# --------------------------------------------------------------------------- #


class StemMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.settings = StemSettings.from_config(vllm_config.additional_config)
        self.settings.check_kv_block_size(self.block_size)
        _install_step_hook()

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        md = StemAttentionMetadata(**{f.name: getattr(base, f.name)
                                      for f in dataclasses.fields(base)})
        if not isinstance(md.causal, bool) or not md.causal or md.encoder_cache is not None:
            return md
        stem, dense = self._sort_rows(common_attn_metadata)
        md.stem_rows, md.dense_rows = tuple(stem), tuple(dense)
        if stem and dense:
            md.dense = self._dense_batch(md, [row for row, _ in dense])
        return md

    def _sort_rows(self, cm) -> tuple[list[Row], list[tuple[Row, str]]]:
        n = cm.num_reqs
        starts = cm.query_start_loc_cpu[:n + 1].tolist()
        seq_lens = cm.seq_lens[:n].tolist()
        prompts, requests, kinds = _STEP.prompts, _STEP.requests, _STEP.kinds
        known = prompts is not None and len(prompts) == n
        stem, dense = [], []
        for r in range(n):
            q_len = starts[r + 1] - starts[r]
            context = seq_lens[r] - q_len
            if not known:
                dense.append((Row(r, starts[r], q_len, context, seq_lens[r]),
                              "no prompt length"))
                continue
            row = Row(r, starts[r], q_len, context, prompts[r], kinds[r], requests[r])
            if q_len == 0 or context >= row.prompt:
                dense.append((row, "decode" if q_len else "empty row"))
                continue
            plan = plan_row(row, self.settings)  # once a step, for every layer
            row = dataclasses.replace(row, visible=plan.visible)
            reason = self._dense_reason(row, plan.share)
            if reason:
                dense.append((row, reason))
            else:
                stem.append(row)
        return stem, dense

    def _dense_reason(self, row: Row, share: float) -> str:
        s = self.settings
        if row.prompt < s.min_prompt_tokens:
            return "short prompt"
        if share >= 1.0 and s.dense_above < 1.0:
            return "budget keeps every block"
        if share > s.dense_above:
            return "budget keeps most blocks"
        return ""

    def _dense_batch(self, md: StemAttentionMetadata, rows: list[Row]) -> DenseRows:
        lens = torch.tensor([row.q_len for row in rows], dtype=torch.int32)
        qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=qsl[1:])
        index = torch.tensor([row.index for row in rows])
        seq_lens = md.seq_lens[index]
        scheduler = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(rows), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype,
            query_start_loc=qsl, causal=True, sliding_window_size=self.window_size,
            isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=self.kv_cache_dtype)
        spans = tuple((row.start, row.start + row.q_len) for row in rows)
        return DenseRows(spans, qsl, seq_lens, md.block_table[index], scheduler)


# --------------------------------------------------------------------------- #
# The layer
# --------------------------------------------------------------------------- #


_LAYER_COUNT = [0]
# Callables given every Stem row a layer ran (``observe``): for tests and
# diagnostics that compare a row with Stem's own functions on the same inputs.
_OBSERVERS: list = []


@dataclass(frozen=True)
class RowTrace:
    """One Stem row of one layer, as it ran: the row, its queries
    ``[q_len, Hq, D]``, all its keys and values ``[Hkv, seq_len, D]`` read
    from the cache, the selection (``indices [Hq, Qb, W]``, ``lengths [Hq, Qb]``)
    and the output ``[q_len, Hq, D]``."""

    layer: str
    row: Row
    scale: float
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    indices: torch.Tensor
    lengths: torch.Tensor
    output: torch.Tensor


def observe(fn) -> None:
    """Call ``fn(RowTrace)`` for every Stem row this process runs from now on."""
    _OBSERVERS.append(fn)


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    except Exception:  # no parallel state (single process tools)
        return 0


class StemAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                 sliding_window, kv_cache_dtype, logits_soft_cap=None,
                 attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, sinks)
        self.settings = StemSettings.from_config(get_current_vllm_config().additional_config)
        self.layer_reason = self._layer_reason()
        self.ordinal = _LAYER_COUNT[0]
        _LAYER_COUNT[0] += 1
        STATS.layers = _LAYER_COUNT[0]
        STATS.log_requests = _tp_rank() == 0

    def _layer_reason(self) -> str:
        """Why this layer can never run Stem ("" when it can)."""
        if self.attn_type != AttentionType.DECODER:
            return f"{self.attn_type} attention"
        if self.sliding_window != -1:
            return "sliding window"
        if self.alibi_slopes is not None:
            return "alibi"
        if self.sinks is not None:
            return "attention sinks"
        if self.is_fp8_kv_cache:
            return f"kv cache dtype {self.kv_cache_dtype}"
        return ""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        stem_rows = getattr(attn_metadata, "stem_rows", ())
        reason = self.layer_reason
        if not reason and stem_rows:
            isa = getattr(layer, "isa", None)
            if isa != "vec":
                reason = f"kv cache layout {isa}"
            elif not kv_cache.is_contiguous():
                reason = "kv cache not contiguous"
        if attn_metadata is not None:
            self._count_dense(layer, attn_metadata, reason)
        if reason or not stem_rows or output_scale is not None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        out = output.view(-1, self.num_heads, self.head_size)
        query = query.view(-1, self.num_heads, self.head_size)
        num_pages, _, page, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(num_pages, self.num_kv_heads, 2 * page,
                                               -1).chunk(2, dim=2)
        if attn_metadata.dense is not None:
            self._run_dense(layer, query, key_cache, value_cache, attn_metadata.dense, out)
        self._run_stem(layer, query, kv_cache, key_cache, value_cache, attn_metadata, out)
        return output

    def _count_dense(self, layer, md, layer_reason: str) -> None:
        rows = list(getattr(md, "dense_rows", ()))
        if layer_reason:
            rows += [(row, layer_reason) for row in md.stem_rows]
        name = getattr(layer, "layer_name", "")
        first = self.ordinal == 0
        for row, reason in rows:
            # A request's own record (and its log line) covers its prompt's rows.
            request = row.request if row.context < row.prompt else ""
            pairs = row.visible * self.num_heads
            STATS.row(name, request, row.prompt, f"dense:{reason}", pairs, pairs,
                      row.seq_len >= row.prompt, first)

    def _kernel(self, layer, query, key_cache, value_cache, out, qsl, seq_lens, table,
                scheduler, *, sliding_window: int) -> None:
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=qsl, seq_lens=seq_lens, scale=self.scale, causal=True,
            alibi_slopes=None, sliding_window=sliding_window, block_table=table,
            softcap=self.logits_soft_cap, scheduler_metadata=scheduler, s_aux=None,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype)

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

    def _run_stem(self, layer, query, kv_cache, key_cache, value_cache, md, out) -> None:
        """Stem's selection per row, then one kernel call over every row's
        virtual rows (one query head each, on the cache viewed per KV head)."""
        s = self.settings
        num_pages, hkv, page, width2 = kv_cache.shape
        name = getattr(layer, "layer_name", "")
        queries, parts, traces = [], [], []
        for row in md.stem_rows:
            pages = md.block_table[row.index]
            k, v = context_kv(key_cache, value_cache, pages, row.seq_len)
            q = query[row.start:row.start + row.q_len]
            idx, lengths = select_blocks(q, k, v, row, self.scale, s)
            parts.append(virtual_rows(idx, lengths, row, s.block_size, page, pages, hkv))
            queries.append(q.transpose(0, 1).reshape(-1, 1, self.head_size))
            if _OBSERVERS:
                traces.append((row, q, k, v, idx, lengths))
            kept = int(lengths.sum())
            visible = row.visible * self.num_heads
            STATS.row(name, row.request, row.prompt, f"sparse:{row.kind}", kept, visible,
                      row.seq_len >= row.prompt, self.ordinal == 0)
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
            seq_lens=seq_lens, dtype=query.dtype, query_start_loc=qsl, causal=True,
            sliding_window_size=-1, isa="vec", enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=self.kv_cache_dtype)
        vo = torch.empty_like(vq)
        self._kernel(layer, vq, flat_k, flat_v, vo, qsl, seq_lens, table, scheduler,
                     sliding_window=-1)
        at = 0
        for row in md.stem_rows:
            n = self.num_heads * row.q_len
            out[row.start:row.start + row.q_len] = (
                vo[at:at + n].view(self.num_heads, row.q_len, self.head_size).transpose(0, 1))
            at += n
        for row, q, k, v, idx, lengths in traces:
            trace = RowTrace(name, row, self.scale, q, k, v, idx, lengths,
                             out[row.start:row.start + row.q_len].clone())
            for fn in _OBSERVERS:
                fn(trace)
