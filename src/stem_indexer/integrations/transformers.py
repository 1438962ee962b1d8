"""Stem attention as an ``attn_implementation`` of Hugging Face transformers.

    import stem_indexer.integrations.transformers as stem_hf

    stem_hf.register()                      # name "stem", stem_attention's defaults
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="stem")

``register(name, **stem_kwargs)`` registers two functions under ``name``: an
attention function (``transformers.AttentionInterface``) and a mask function
(``transformers.masking_utils.AttentionMaskInterface``). Any model that calls
its attention through the attention interface and builds its masks with
``masking_utils`` (Llama, Mistral, Qwen2/3 and most current decoders) then runs
Stem for prefill.

What runs where
---------------

* **Prefill** (at least ``min_prefill_tokens`` query tokens, default one Stem
  block): ``stem_attention`` on the valid tokens of every sequence.
* **Decode** and other short queries: dense ``scaled_dot_product_attention``
  through transformers' own ``sdpa_attention_forward``.
* **Sliding-window layers** (Mistral, Gemma 2/3 local layers: transformers'
  ``sliding_window_causal_mask_function``) at prefill:
  ``stem_indexer.pipeline.window.sliding_window_attention``, the same result as SDPA
  with the sliding mask at a cost of queries x window instead of queries x
  keys (``stats["window"]``; decode steps there run dense SDPA with the
  sliding mask).
* **Dense as well**, with the exact mask transformers would give SDPA, whenever
  the mask is neither "causal over each sequence's valid tokens" nor
  transformers' plain sliding window: chunked layers, packed sequences, custom
  ``or``/``and`` mask functions, 4-D masks passed by the caller, padding with
  holes, position biases, and dropout during training (Stem has no dropout),
  and calls that record autograd (Stem attention is inference-only).

Masks
-----

For a plain causal mask the mask function returns what FlashAttention's does:
``None`` when every token is valid and queries and keys coincide, otherwise
the boolean 2-D key-validity mask ``(batch, kv_length)``, queries aligned to
the last ``q_length`` keys. The attention function reads each sequence's valid
run from it. For transformers' sliding-window causal mask of window W it
returns the same key-validity mask as int32, ``W`` at valid keys and ``-W``
at padding: the window travels with the mask (the model's ``sliding_window``
keyword is not needed, and a causal layer never reads one). Any other mask is
built by transformers' ``sdpa_mask`` and reaches the attention function as a
4-D mask, which always means dense attention.

Padding
-------

Stem takes per-sequence lengths with the valid tokens at ``[0, len)``. Right
padding is exactly that. With left padding (what ``generate()`` uses for
batched prompts), or any padding that leaves one contiguous run of valid
tokens per sequence, the queries, keys and values of each sequence are rotated
so that its valid run starts at position 0, Stem runs on the whole batch with
per-sequence lengths, and the outputs are rotated back. Each padded row thus
gets the same block partition, the same selection and the same result as the
unpadded sequence alone. Outputs at padding positions are zero (SDPA also
returns zeros for the fully masked query rows of left padding). A sequence
whose valid tokens are not one contiguous run makes the whole call dense.

The attention function reads the padding mask on the host, so it synchronises
with the device once per layer and is meant for eager prefill, not for
``torch.compile``.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
from typing import Any, Callable

import torch

try:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import (
        AttentionMaskInterface,
        causal_mask_function,
        sdpa_mask,
        sliding_window_causal_mask_function,
    )
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "stem_indexer.integrations.transformers needs Hugging Face transformers "
        "(with AttentionInterface and masking_utils.AttentionMaskInterface); install the "
        "'hf' extra: pip install 'stem-indexer[hf]'"
    ) from exc

from ..surfaces.attention import stem_attention
from ..pipeline.checks import check_stem_options
from ..operator.contract import IndexerParams, check_dense_above, check_int, fail
from ..pipeline.probe import MISS_CHECK_BLOCKS, MISS_CHECK_QUERIES, check_miss
from ..pipeline.window import _windowed, sliding_window_mask

# The first release whose mask functions are called with (q_length, q_offset)
# rather than cache_position: the signature stem_mask takes. pyproject.toml's
# extras declare the same floor.
MIN_TRANSFORMERS = "5.4"


def _check_mask_signature(mask_fn: Callable) -> None:
    """Refuse a transformers whose mask functions take cache_position (before
    5.4): stem_mask would be called with arguments it does not know."""
    if "q_length" not in inspect.signature(mask_fn).parameters:
        import transformers

        raise ImportError(
            f"stem_indexer.integrations.transformers needs transformers>={MIN_TRANSFORMERS} "
            f"(mask functions called with q_length and q_offset); found "
            f"{transformers.__version__}: pip install 'stem-indexer[hf]'")


_check_mask_signature(sdpa_mask)

__all__ = ["register", "unregister", "StemAttention", "stem_mask"]

# Arguments of stem_attention that register() cannot fix, and why: the
# integration fills them in from the model, or sets them itself (it counts
# each call's info and returns the plain output).
_FROM_MODEL = "is supplied by the model for every call"
_RESERVED = {
    **dict.fromkeys(("q", "k", "v", "causal", "scale", "softcap", "q_lens", "kv_lens"),
                    _FROM_MODEL),
    "num_prompt_tokens": "is per batch and per call (the model's lengths)",
    "return_info": "is set by the integration (it counts each call's path in stats)",
    "return_lse": "is set by the integration (the model takes the output alone)",
}

# Attention-function keyword arguments this integration cannot honour with
# Stem. Each one, when set, sends the call to dense SDPA (which either honours
# it or raises its own clear error). Logit soft-capping (``softcap``, Gemma 2)
# is honoured: stem_attention applies it before the softmax.
_DENSE_KWARGS = ("position_bias",)


# --------------------------------------------------------------------------- #
# Mask function
# --------------------------------------------------------------------------- #


def _sliding_window_of(mask_function: Callable) -> int | None:
    """W when ``mask_function`` is transformers' own
    ``sliding_window_causal_mask_function(W)`` (told by its structure: the
    ``and`` of ``sliding_window_overlay(W)`` and ``causal_mask_function``),
    else None. A mask function built another way (an extra ``or``/``and``
    function, packed sequences) is not recognised and stays dense."""
    ref = sliding_window_causal_mask_function(1)

    def cells(fn) -> dict[str, Any]:
        code = getattr(fn, "__code__", None)
        if code is None or not fn.__closure__:
            return {}
        return dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__)))

    if getattr(mask_function, "__code__", None) is not ref.__code__:
        return None
    parts, ref_parts = cells(mask_function).get("mask_functions"), cells(ref)["mask_functions"]
    if (not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not causal_mask_function
            or getattr(parts[0], "__code__", None) is not ref_parts[0].__code__):
        return None
    window = cells(parts[0]).get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        return None
    return window


def _window_form(valid: torch.Tensor, window: int) -> torch.Tensor:
    """The compact form of a sliding-window causal mask: int32 ``(batch,
    kv_length)``, ``window`` at valid keys and ``-window`` at padding."""
    return torch.where(valid, window, -window).to(torch.int32)


def stem_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask for Stem attention: compact for plain causal and sliding-window
    causal masks, else ``sdpa_mask``.

    Registered with ``AttentionMaskInterface``; transformers calls it with the
    keyword arguments of ``sdpa_mask``. For a plain causal mask whose queries
    are the last ``q_length`` of ``kv_length`` keys (no cache, or a dynamic
    cache), it returns ``None`` when all tokens are valid and
    ``q_length == kv_length``, else the 2-D boolean key-validity mask
    ``(batch_size, kv_length)``. For transformers' sliding-window causal mask
    (``sliding_window_causal_mask_function(W)``, ``local_size=W``) whose
    queries are the last keys (no cache, a dynamic or a dynamic sliding-window
    cache), it returns the same key-validity mask as int32: ``W`` at valid
    keys, ``-W`` at padding, so the window travels with the mask. Anything
    else (another mask function, a static cache's offsets, chunked attention)
    returns ``sdpa_mask``'s result: a 4-D boolean mask or ``None``, as SDPA
    would get it.
    """
    plain_causal = (
        mask_function is causal_mask_function
        and local_size is None
        and isinstance(q_offset, int) and isinstance(kv_offset, int)
        and kv_offset == 0 and q_offset + q_length == kv_length
        and (attention_mask is None
             or (attention_mask.dim() == 2 and attention_mask.shape[-1] == kv_length))
    )
    window = None if plain_causal else _sliding_window_of(mask_function)
    if (window is not None and local_size == window
            and isinstance(q_offset, int) and isinstance(kv_offset, int)
            and q_offset + q_length == kv_offset + kv_length
            and (attention_mask is None
                 or (attention_mask.dim() == 2
                     and attention_mask.shape[-1] == kv_offset + kv_length))):
        if attention_mask is None:
            valid = torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device"))
        else:
            valid = attention_mask[:, kv_offset:].to(torch.bool)
        return _window_form(valid, window)
    if plain_causal:
        if attention_mask is None:
            if q_length == kv_length:
                return None
            return torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device"))
        valid = attention_mask.to(torch.bool)
        if q_length == kv_length and bool(valid.all()):
            return None
        return valid
    return sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
        local_size=local_size, **kwargs)


# --------------------------------------------------------------------------- #
# Attention function
# --------------------------------------------------------------------------- #


class _Runs:
    """Per-sequence valid runs of a key-validity mask, mapped onto the queries.

    Queries are the last ``q_len`` of ``kv_len`` positions. For sequence b the
    valid keys are ``[start, end)``; the valid queries are ``[q0, q1)`` (query
    i sits at key position ``kv_len - q_len + i``).
    """

    def __init__(self, valid: torch.Tensor, q_len: int):
        b, kv_len = valid.shape
        pos = torch.arange(kv_len, device=valid.device)
        count = valid.sum(1)
        start = torch.where(valid, pos, kv_len).amin(1)
        end = torch.where(valid, pos + 1, 0).amax(1)
        empty = count == 0
        start = torch.where(empty, torch.full_like(start, kv_len), start)
        end = torch.where(empty, torch.full_like(end, kv_len), end)
        self.contiguous = bool(((end - start) == count).all())
        offset = kv_len - q_len
        self.start = start
        self.kv_lens = end - start
        self.q0 = (start - offset).clamp(0, q_len)
        self.q1 = (end - offset).clamp(0, q_len)
        self.q_lens = self.q1 - self.q0
        self.shifted = bool((self.start != 0).any())


def _rotate(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``y[b, :, j] = x[b, :, (j + shift[b]) % S]`` along dim 2 of [B, H, S, D]."""
    s = x.shape[2]
    idx = (torch.arange(s, device=x.device)[None, :] + shift[:, None].to(x.device)) % s
    return torch.gather(x, 2, idx[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def _dense_mask_from_valid(valid: torch.Tensor, q_len: int) -> torch.Tensor:
    """The 4-D boolean causal-and-padding mask of a key-validity mask."""
    kv_len = valid.shape[1]
    q_pos = torch.arange(q_len, device=valid.device)[:, None] + (kv_len - q_len)
    causal = torch.arange(kv_len, device=valid.device)[None, :] <= q_pos
    return (valid[:, None, None, :] & causal[None, None]).contiguous()


def _eager_softcap(module, query, key, value, mask, dropout: float, scaling, softcap: float):
    """Dense attention with logit soft-capping (SDPA has none): the model's
    own eager formula, for calls Stem leaves dense. ``mask`` is None or a
    boolean/additive 4-D mask; returns ``(out [B, Sq, Hq, D], None)``."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None and query.shape[2] > 1:
        mask = _dense_mask_from_valid(torch.ones(query.shape[0], key.shape[2], dtype=torch.bool,
                                                 device=query.device), query.shape[2])
    if mask is not None:
        scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                  else scores + mask)
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


class StemAttention:
    """The attention function registered by ``register`` (one per name).

    Called by transformers as ``fn(module, query, key, value, attention_mask,
    dropout=..., scaling=..., is_causal=..., **kwargs)`` with query
    ``[B, Hq, Sq, D]`` and key/value ``[B, Hkv, Skv, D]``; returns
    ``(output [B, Sq, Hq, D], None)`` like ``sdpa_attention_forward``.

    ``stats`` counts which path each call took: ``"stem"`` (sparse attention
    ran on valid tokens at the start of each sequence), ``"stem-rotated"``
    (the same, padding before the valid tokens rotated away),
    ``"window"`` (a sliding-window layer's prefill, at window cost) or
    ``"dense:<reason>"``: ``decode``, ``dropout``, ``autograd``, ``mask``,
    ``mask-holes``, ``position_bias``, or, from ``stem_attention`` itself,
    ``budget keeps every block`` (prompts the budget keeps whole, below about
    56 blocks with the default preset) and ``budget keeps most blocks`` (more
    than ``dense_above`` of the visible block pairs: on CPU in float32,
    7.5K tokens with the default preset). ``kept_pairs`` and ``visible_pairs``
    add up the (query block, key block) pairs of the calls that ran Stem, so
    ``kept_pairs / visible_pairs`` is their density; ``layer_pairs`` keeps
    the same per layer (``density_by_layer()``), and ``layer_stats`` the
    paths per layer index (``module.layer_idx``).
    """

    def __init__(self, name: str, min_prefill_tokens: int, stem_kwargs: dict[str, Any]):
        self.name = name
        self.min_prefill_tokens = min_prefill_tokens
        self.stem_kwargs = dict(stem_kwargs)
        self.stats: collections.Counter[str] = collections.Counter()
        self.kept_pairs = 0
        self.visible_pairs = 0
        self.layer_pairs: dict[int | None, list[int]] = collections.defaultdict(lambda: [0, 0])
        self.layer_stats: dict[int | None, collections.Counter[str]] = \
            collections.defaultdict(collections.Counter)

    def _count(self, module, path: str) -> None:
        self.stats[path] += 1
        self.layer_stats[getattr(module, "layer_idx", None)][path] += 1

    def reset_stats(self) -> None:
        """Forget the counts and pairs so far (``stats``, the pairs, per layer too)."""
        self.stats.clear()
        self.kept_pairs = self.visible_pairs = 0
        self.layer_pairs.clear()
        self.layer_stats.clear()

    def density_by_layer(self) -> dict[int | None, float]:
        """Kept / visible block pairs of the sparse calls, per layer index."""
        return {layer: kept / visible for layer, (kept, visible) in
                sorted(self.layer_pairs.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
                if visible}

    def _stem(self, module, query, key, value, *, rotated: bool, **kwargs) -> torch.Tensor:
        """stem_attention, with what it did counted in ``stats``."""
        out, info = stem_attention(query, key, value, return_info=True, **kwargs,
                                   **self.stem_kwargs)
        if info.path == "sparse":
            self._count(module, "stem-rotated" if rotated else "stem")
            self.kept_pairs += info.kept_pairs
            self.visible_pairs += info.visible_pairs
            pairs = self.layer_pairs[getattr(module, "layer_idx", None)]
            pairs[0] += info.kept_pairs
            pairs[1] += info.visible_pairs
        else:
            self._count(module, f"dense:{info.reason}")
        return out

    def __repr__(self) -> str:
        kw = ", ".join(f"{k}={v!r}" for k, v in self.stem_kwargs.items())
        return (f"StemAttention(name={self.name!r}, min_prefill_tokens={self.min_prefill_tokens}"
                f"{', ' + kw if kw else ''})")

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if kwargs.get("s_aux") is not None:
            raise ValueError(f"attn_implementation={self.name!r}: attention sinks (s_aux) "
                             "are not supported by Stem attention")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        q_len, kv_len = query.shape[2], key.shape[2]

        def dense(reason: str, mask: torch.Tensor | None = attention_mask):
            self._count(module, f"dense:{reason}")
            if kwargs.get("softcap") is not None:  # SDPA cannot cap logits
                return _eager_softcap(module, query, key, value, mask, dropout, scaling,
                                      kwargs["softcap"])
            return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                          scaling=scaling, is_causal=is_causal, **kwargs)

        compact = attention_mask is not None and attention_mask.dim() == 2
        if attention_mask is not None and not compact:
            return dense("mask")
        window = None
        if compact and attention_mask.dtype != torch.bool:  # stem_mask's sliding-window form
            window = int(attention_mask.abs().amax())
            attention_mask = attention_mask > 0
        reason = None
        if q_len < self.min_prefill_tokens:
            reason = "decode"
        elif dropout:
            reason = "dropout"
        elif torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
            reason = "autograd"  # Stem attention is inference-only
        elif any(kwargs.get(k) is not None for k in _DENSE_KWARGS):
            reason = next(k for k in _DENSE_KWARGS if kwargs.get(k) is not None)
        if window is not None:
            return self._window(module, query, key, value, attention_mask, window, reason,
                                dense, scaling, kwargs.get("softcap"))
        if compact:
            valid = attention_mask
            runs = None if reason else _Runs(valid, q_len)
            if runs is not None and not runs.contiguous:
                reason = "mask-holes"
            if reason:
                if q_len == 1 and bool(valid.all()):
                    return dense(reason, None)
                return dense(reason, _dense_mask_from_valid(valid, q_len))
            return self._stem_padded(module, query, key, value, runs, scaling,
                                     kwargs.get("softcap")), None

        # No mask: every token is valid.
        if reason:
            return dense(reason)
        if causal and kv_len > q_len:
            # SDPA's reading of a mask-less causal call with more keys than
            # queries (a static cache's first prefill): upper-left alignment,
            # so only the first q_len keys are seen.
            key, value = key[:, :, :q_len], value[:, :, :q_len]
        out = self._stem(module, query, key, value, rotated=False, causal=bool(causal),
                         scale=scaling, softcap=kwargs.get("softcap"))
        return out.transpose(1, 2).contiguous(), None

    def _window(self, module, query, key, value, valid: torch.Tensor, window: int,
                reason: str | None, dense: Callable, scaling, softcap):
        """A sliding-window layer: ``sliding_window_attention`` (query x window
        work) on the key-validity mask, or dense SDPA with the sliding mask
        for ``reason`` (decode, dropout, ...)."""
        q_len, kv_len = query.shape[2], key.shape[2]
        if valid.shape != (query.shape[0], kv_len) or kv_len < q_len:
            raise ValueError(f"attn_implementation={self.name!r}: a sliding-window mask for "
                             f"{valid.shape[-1]} keys reached a layer with {kv_len} keys and "
                             f"{q_len} queries")
        if reason:
            if q_len == 1 and kv_len <= window and bool(valid.all()):
                return dense(reason, None)
            return dense(reason, sliding_window_mask(valid, q_len, window))
        self._count(module, "window")
        scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        out = _windowed(query, key, value, window, valid, scale, softcap, None)
        return out.transpose(1, 2).contiguous(), None

    def _stem_padded(self, module, query, key, value, runs: _Runs, scaling,
                     softcap) -> torch.Tensor:
        """Stem on each sequence's valid run; zeros at padding positions."""
        q_len = query.shape[2]
        int32 = dict(dtype=torch.int32, device=query.device)
        q_lens, kv_lens = runs.q_lens.to(**int32), runs.kv_lens.to(**int32)
        if runs.shifted:
            query = _rotate(query, runs.q0)
            key = _rotate(key, runs.start)
            value = _rotate(value, runs.start)
        out = self._stem(module, query, key, value, rotated=runs.shifted, causal=True,
                         scale=scaling, softcap=softcap, q_lens=q_lens, kv_lens=kv_lens)
        if runs.shifted:
            out = _rotate(out, -runs.q0)
        pos = torch.arange(q_len, device=query.device)[None, :]
        q_valid = (pos >= runs.q0[:, None].to(pos.device)) & (pos < runs.q1[:, None].to(pos.device))
        out = out * q_valid[:, None, :, None].to(out.dtype)
        return out.transpose(1, 2).contiguous()


# --------------------------------------------------------------------------- #
# Registration
# --------------------------------------------------------------------------- #


# stem_attention's miss check, and its defaults (checked apart: not an indexer option)
_MISS_CHECK = {"miss_check": 0.0, "miss_check_queries": MISS_CHECK_QUERIES,
               "miss_check_blocks": MISS_CHECK_BLOCKS, "miss_check_from": 0}


def _stem_arguments() -> list[str]:
    """What ``register`` may fix: stem_attention's keywords and the indexer's parameters."""
    named = [name for name, p in inspect.signature(stem_attention).parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in _RESERVED]
    return named + [f.name for f in dataclasses.fields(IndexerParams) if f.name not in _RESERVED]


def register(name: str = "stem", *, min_prefill_tokens: int | None = None,
             dense_above: float | None = None, **stem_kwargs: Any) -> StemAttention:
    """Make ``attn_implementation=name`` run Stem attention in transformers models.

    Registers an attention function and a mask function under ``name``
    (registering a name again replaces both). Use the name when loading a
    model (``from_pretrained(..., attn_implementation=name)``) or switch a
    loaded one with ``model.set_attn_implementation(name)``.

    Args:
        name: the ``attn_implementation`` name.
        min_prefill_tokens: calls with fewer query tokens (decode) use dense
            SDPA; default one Stem block (``stem_block_size``).
        dense_above: ``stem_attention``'s: a prefill whose budget keeps more
            than this share of the visible block pairs runs dense attention
            (``stats["dense:budget keeps most blocks"]``); default
            ``contract.default_dense_above`` of the layer's device and dtype,
            ``1.0`` never for that reason.
        **stem_kwargs: keyword arguments for every ``stem_attention`` call
            (``preset``, ``stem_block_size``, ``stem_stride``, ``alpha``,
            ``initial_blocks``, ``window_size``, ``oam``, ``oam_lambda``,
            budget rates, ``exact_tail`` (128: the prompt's last 128 tokens
            attend to every key; 0: every row is the indexer's),
            ``miss_check`` (0: off; a layer's call whose selection misses
            more of a sample of exact attention attends every block,
            ``stats["dense:miss check"]``), ``backend``, ...). The model supplies q/k/v,
            ``causal``, ``scale``, ``softcap`` and the lengths; the
            integration asks for the info it counts.

    Returns:
        The registered attention function; its ``stats`` count the paths taken.

    Raises:
        StemIndexerInputError (a ValueError) naming the argument and the
        rule, for any argument ``stem_attention`` would refuse (checked here,
        not at the model's first call), a keyword it does not take or one the
        model or the integration supplies, an empty name, or a
        ``min_prefill_tokens`` below 1.
    """
    who = "register"
    if not isinstance(name, str) or not name:
        fail(who, "name", "must be a non-empty str", repr(name))
    allowed = _stem_arguments()
    for key, value in stem_kwargs.items():
        if key in _RESERVED:
            fail(who, key, f"{_RESERVED[key]}; it cannot be fixed at registration", repr(value))
        if key not in allowed:
            fail(who, key, f"is not an argument of stem_attention (those that can be fixed: "
                 f"{', '.join(allowed)})", repr(value))
    miss = {key: stem_kwargs[key] for key in _MISS_CHECK if key in stem_kwargs}
    check_stem_options(who, **{k: v for k, v in stem_kwargs.items() if k not in miss})
    check_miss(who, *({**_MISS_CHECK, **miss}.values()))
    check_dense_above(who, dense_above)
    if dense_above is not None:
        stem_kwargs["dense_above"] = dense_above
    if min_prefill_tokens is None:
        min_prefill_tokens = stem_kwargs.get("stem_block_size", IndexerParams.stem_block_size)
    check_int(who, "min_prefill_tokens", min_prefill_tokens, 1)
    fn = StemAttention(name, min_prefill_tokens, stem_kwargs)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, stem_mask)
    return fn


def unregister(name: str = "stem") -> None:
    """Remove what ``register(name)`` added (nothing happens for unknown names)."""
    for interface in (AttentionInterface, AttentionMaskInterface):
        if isinstance(interface._global_mapping.get(name), (StemAttention,)) \
                or interface._global_mapping.get(name) is stem_mask:
            del interface._global_mapping[name]
