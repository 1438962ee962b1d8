"""``attn_implementation="stem"`` across Hugging Face model families (tiny random models).

For each family, at 1024 tokens in 16-token blocks (64 blocks: past the 56
at which the budget starts to drop blocks):

* a keep-all budget must reproduce the model's eager attention (every
  attention layer runs through the integration, soft-capping and sliding
  windows included);
* the ``tight`` preset runs Stem (sparse) on every full-attention layer and
  sliding-window attention (``stats["window"]``, ``stem_indexer.pipeline.window``) on
  sliding-window layers, with finite logits that really differ.

Gemma 2 caps its attention logits (``attn_logit_softcapping``): the cap is
applied on the Stem path and on the dense fallback alike (checked on large
logits, where it matters, by calling the attention function directly).
"""

from __future__ import annotations

import pytest
import torch

import stem_indexer
from stem_indexer import PRESETS
from stem_indexer.operator.contract import DEFAULT_EXACT_TAIL
from stem_indexer.testing import reference_attention

from _helpers import LazyModule, needs

pytestmark = needs("transformers")
transformers = LazyModule("transformers")
stem_hf = LazyModule("stem_indexer.integrations.transformers")

BLOCKING = dict(stem_block_size=16, stem_stride=4)
KEEP_ALL = dict(k_block_num_bias_medium=10**6, k_block_num_bias_large=10**6)
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=2)
MIXED = dict(sliding_window=64, layer_types=["sliding_attention", "full_attention"])
FAMILIES = {  # name: (config class, model class, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", MIXED),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", MIXED),
}


@pytest.fixture(scope="module")
def registered():
    fns = {"all": stem_hf.register("stem-hf-all", **BLOCKING, **KEEP_ALL),
           "tight": stem_hf.register("stem-hf-tight", **BLOCKING, preset="tight")}
    yield fns
    for fn in fns.values():
        stem_hf.unregister(fn.name)


def _model(family: str, device="cpu"):
    """The family's tiny model, built on the CPU from one seed (the same
    weights on every device), on ``device``."""
    config_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**COMMON, **extra)
    return getattr(transformers, model_name)(config).eval().to(device), config


def _logits(model, impl, ids):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids).logits


# The default run: Llama (the reference), Gemma 2 (soft-capping, mixed
# sliding/full layers) and Qwen3; the other families in the slow tier.
DEFAULT_FAMILIES = ("llama", "gemma2", "qwen3")


def _sparse_reference(q, k, v, scale, softcap, params, tail=DEFAULT_EXACT_TAIL):
    """float64 attention of one layer's q/k/v on the blocks the indexer keeps
    (its own lists, from stem_inputs and the op on q's device), right-down
    causal, the scores capped as the model caps them; the query blocks
    holding the prompt's last ``tail`` tokens (the default ``exact_tail``)
    keep every block (one unpadded prompt: q_len == kv_len == the prompt).
    Computed on the CPU."""
    bs, stride = params["stem_block_size"], params["stem_stride"]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    inputs = stem_indexer.stem_inputs(q, k, v, scale=scale / stride, stem_block_size=bs,
                                      stem_stride=stride)
    idx, seq_len = (t.cpu() for t in stem_indexer.stem_indexer(*inputs, **params))
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    sq, skv = q.shape[2], k.shape[2]
    kb = -(-skv // bs)
    rows = torch.zeros(*idx.shape[:3], kb + 1, dtype=torch.bool)
    entries = torch.arange(idx.shape[-1]) < seq_len[..., None]
    rows.scatter_(-1, torch.where(entries, idx.long(), kb), True)
    assert q.shape[2] == k.shape[2]
    rows[:, :, max(q.shape[2] - tail, 0) // bs:] = True
    listed = rows[..., :kb].repeat_interleave(bs, 2)[:, :, :sq].repeat_interleave(bs, 3)
    return (reference_attention(q, k, v, listed[..., :skv], scale=scale, softcap=softcap,
                                causal=True), float(listed[..., :skv].float().mean()))


@pytest.mark.parametrize("family", [f if f in DEFAULT_FAMILIES
                                    else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_family_runs_stem_on_full_attention_layers(family, registered, monkeypatch, device):
    """Keep-all budget: the model's eager logits. Tight preset: every
    full-attention layer runs Stem, and each such layer's output is the
    float64 reference on the indexer's own selection for that layer's q/k/v
    (scale and soft-cap as the model passes them); sliding-window layers
    run the windowed path, never the dense 4-D mask."""
    model, config = _model(family, device)
    ids = torch.randint(3, 128, (1, 1024), generator=torch.Generator().manual_seed(1)).to(device)
    eager = _logits(model, "eager", ids)
    torch.testing.assert_close(_logits(model, registered["all"].name, ids), eager,
                               atol=1e-4, rtol=1e-4)

    calls = []
    real = stem_hf.stem_attention

    def recording(q, k, v, **kwargs):
        result = real(q, k, v, **kwargs)
        calls.append((q, k, v, kwargs, result))
        return result

    monkeypatch.setattr("stem_indexer.integrations.transformers.stem_attention", recording)
    fn = registered["tight"]
    before = dict(fn.stats)
    sparse = _logits(model, fn.name, ids)
    counts = {k: v - before.get(k, 0) for k, v in fn.stats.items() if v != before.get(k, 0)}
    types = getattr(config, "layer_types", None) or ["full_attention"] * 2
    full = types.count("full_attention")
    assert counts.get("stem", 0) == full
    assert counts.get("window", 0) == len(types) - full  # sliding windows at window cost
    assert "dense:mask" not in counts
    assert torch.isfinite(sparse).all()
    assert len(calls) == full
    params = dict(**PRESETS["tight"], **BLOCKING)
    for q, k, v, kwargs, (out, info) in calls:
        assert info.path == "sparse" and kwargs["causal"]
        assert out.device == q.device == ids.device
        want, density = _sparse_reference(q, k, v, kwargs["scale"], kwargs.get("softcap"),
                                          params)
        assert density < 0.9  # blocks were dropped
        torch.testing.assert_close(out.cpu().double(), want, atol=1e-5, rtol=1e-5)


class _Module(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("path", ["stem", "dense-mask"])
def test_softcap_is_applied_on_every_path(registered, path, device):
    """Large logits and a cap of 2: the capped result differs from the
    uncapped one, and the integration's output is the capped one, whether
    Stem runs (no mask) or a 4-D mask sends the call to dense attention."""
    gen = torch.Generator().manual_seed(3)
    q = 3 * torch.randn(1, 4, 256, 16, generator=gen)
    k, v = torch.randn(2, 1, 2, 256, 16, generator=gen)
    causal = torch.ones(256, 256, dtype=torch.bool).tril()[None, None]
    mask = causal.to(device) if path == "dense-mask" else None
    fn = registered["all"]
    out, _ = fn(_Module(), q.to(device), k.to(device), v.to(device), mask, scaling=0.25,
                softcap=2.0)
    assert out.device.type == torch.device(device).type
    want = reference_attention(q, k, v, causal, scale=0.25, softcap=2.0)
    torch.testing.assert_close(out.cpu().transpose(1, 2).double(), want, atol=1e-5, rtol=1e-5)
    uncapped = reference_attention(q, k, v, causal, scale=0.25)
    assert (want - uncapped).abs().max() > 1e-2
