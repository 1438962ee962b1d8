"""How much attention Stem's selection keeps: density, mass recall, output error.

For a workload (q, k, v of one attention layer) and a configuration (OAM on or
off, the TPD decay end ``alpha``, the top-k budget), the selection comes from
``stem_inputs`` + ``stem_indexer`` and the sparse output from
``block_sparse_attention``, both compared with dense causal softmax attention
computed here in float32:

* **density**: kept (query block, key block) pairs over causally visible pairs;
* **mass recall**: the share of each query token's dense softmax mass that
  falls in its kept blocks, averaged over query tokens and heads;
* **output error**: ``||O_sparse - O_dense|| / ||O_dense||`` (Frobenius) and the
  largest absolute difference;
* **needle recall** (synthetic workload): the share of planted (query block,
  needle key block) pairs that are kept, separately for *attention needles*
  (strong query-key match) and *value needles* (a mild match on key blocks
  whose values are several times larger, which only the Output-Aware Metric
  sees).

Two workloads: ``synthetic_workload`` (random q/k/v with an attention sink,
lognormal value magnitudes and planted needles far in the past) and
``llama_workload`` (q/k/v of one layer of a tiny randomly initialised
LlamaForCausalLM; needs transformers).

Small shapes need small blocks and a proportionally small budget: with the
default budget a prompt under 56 blocks keeps every block. ``TIGHT_BUDGET``
sets ``Ks = P/8``, about the default budget's share at 128K tokens
(``0.1 * 1024 + 30 = 132`` of 1024 blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from ..operator import contract
from ..operator.contract import IndexerParams
from ..operator.api import stem_indexer

__all__ = [
    "Budget",
    "DEFAULT_BUDGET",
    "TIGHT_BUDGET",
    "EvalConfig",
    "Needle",
    "Workload",
    "EvalRow",
    "default_configs",
    "synthetic_workload",
    "llama_workload",
    "dense_probs",
    "select_blocks",
    "measure",
    "evaluate",
]


# --------------------------------------------------------------------------- #
# Configurations
# --------------------------------------------------------------------------- #


_DEFAULTS = IndexerParams()
_BUDGET_FIELDS = ("k_block_num_rate_medium", "k_block_num_bias_medium",
                  "k_block_num_rate_large", "k_block_num_bias_large")


@dataclass(frozen=True)
class Budget:
    """The top-k budget attributes of the indexer (docs/CONTRACT.md section 3, "Budget");
    unset ones take the operator's defaults."""

    name: str
    k_block_num_rate_medium: float = _DEFAULTS.k_block_num_rate_medium
    k_block_num_bias_medium: int = _DEFAULTS.k_block_num_bias_medium
    k_block_num_rate_large: float = _DEFAULTS.k_block_num_rate_large
    k_block_num_bias_large: int = _DEFAULTS.k_block_num_bias_large

    def kwargs(self) -> dict:
        return {name: getattr(self, name) for name in _BUDGET_FIELDS}


DEFAULT_BUDGET = Budget("default")
TIGHT_BUDGET = Budget("P/8", 0.125, 0, 0.125, 0)


@dataclass(frozen=True)
class EvalConfig:
    """One Stem configuration to measure."""

    oam: bool = True
    alpha: float = 1.0
    budget: Budget = TIGHT_BUDGET
    initial_blocks: int = 4
    window_size: int = 4
    oam_lambda: float = 0.3


def default_configs() -> list[EvalConfig]:
    """OAM on/off x alpha 1.0/0.7/0.5 at the P/8 budget, plus the default budget."""
    configs = [EvalConfig(oam=oam, alpha=alpha) for oam in (True, False)
               for alpha in (1.0, 0.7, 0.5)]
    configs.append(EvalConfig(oam=True, alpha=1.0, budget=DEFAULT_BUDGET))
    return configs


# --------------------------------------------------------------------------- #
# Workloads
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Needle:
    """A planted dependency: ``query_blocks`` of ``batch`` and every query head
    of KV head ``kv_head`` attend to ``key_block``."""

    batch: int
    kv_head: int
    key_block: int
    query_blocks: tuple[int, ...]
    kind: str  # "attention" or "value"


@dataclass
class Workload:
    """One attention layer's inputs: q [B, Hq, S, D], k/v [B, Hkv, S, D]."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    block_size: int
    stride: int
    needles: list[Needle] = field(default_factory=list)
    description: str = ""


def synthetic_workload(
    *, seq_len: int = 2048, q_heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
    block_size: int = 32, stride: int = 8, needles_per_head: int = 4, seed: int = 0,
) -> Workload:
    """Random q/k/v shaped like real attention: sink, locality, needles, OAM signal.

    * background: q, k ~ N(0, 0.7^2) per dim, logits scaled by 1/sqrt(head_dim);
    * an attention sink: the first 4 keys and every query share a direction
      worth +6 in the logits;
    * locality: q and k share a slowly varying direction (white noise smoothed
      over about ``block_size`` tokens), worth up to +3 for nearby pairs;
    * values carry a lognormal magnitude per token (sigma 0.5), so the OAM
      bias varies from block to block;
    * per KV head, ``needles_per_head`` *attention needles*: a key block in the
      first half (past the sink) and two query blocks in the last third whose
      tokens share a random direction, worth +2 to +4 in the logits;
    * as many *value needles*: the same with +0.5 to +1.5 on a key block whose
      values are 6 times larger (they matter for the output, not for the
      attention weights).
    """
    if seq_len % block_size:
        raise ValueError(f"synthetic_workload: seq_len must be a multiple of block_size "
                         f"({block_size}); got {seq_len}")
    nb = seq_len // block_size
    if nb < 24:
        raise ValueError(f"synthetic_workload: seq_len must hold at least 24 blocks of "
                         f"{block_size}; got {seq_len}")
    if q_heads % kv_heads:
        raise ValueError(f"synthetic_workload: q_heads must be a multiple of kv_heads "
                         f"({kv_heads}); got {q_heads}")
    gen = torch.Generator().manual_seed(seed)
    group = q_heads // kv_heads
    scale = head_dim ** -0.5
    q = 0.7 * torch.randn(1, q_heads, seq_len, head_dim, generator=gen)
    k = 0.7 * torch.randn(1, kv_heads, seq_len, head_dim, generator=gen)
    v = torch.randn(1, kv_heads, seq_len, head_dim, generator=gen)
    v = v * torch.exp(0.5 * torch.randn(1, kv_heads, seq_len, 1, generator=gen))

    def unit() -> torch.Tensor:
        u = torch.randn(head_dim, generator=gen)
        return u / u.norm()

    def amplitude(logit: float) -> float:
        # a component a * u on both q and k adds a * a * scale to their logit
        return math.sqrt(logit / scale)

    sink = unit()
    k[:, :, :4] += amplitude(6.0) * sink
    q += amplitude(6.0) * sink

    # Locality: smoothed white noise, normalised per token.
    width = max(block_size, 8)
    taps = torch.exp(-0.5 * (torch.arange(-2 * width, 2 * width + 1) / (width / 2)) ** 2)
    noise = torch.randn(kv_heads * head_dim, 1, seq_len + 4 * width, generator=gen)
    drift = torch.nn.functional.conv1d(noise, taps.view(1, 1, -1)).view(kv_heads, head_dim,
                                                                         seq_len)
    drift = (drift / drift.norm(dim=1, keepdim=True)).transpose(1, 2)[None]  # [1,Hkv,S,D]
    k += amplitude(3.0) * drift
    q += amplitude(3.0) * drift.repeat_interleave(group, 1)

    planted: list[Needle] = []
    first_key, last_key = 4, nb // 2            # needle key blocks: past the sink, first half
    first_query = nb - nb // 3                  # queries in the last third
    for n in range(kv_heads):
        heads = slice(n * group, (n + 1) * group)
        key_blocks = torch.randperm(last_key - first_key, generator=gen)[:2 * needles_per_head]
        for t, kb in enumerate((key_blocks + first_key).tolist()):
            kind = "attention" if t < needles_per_head else "value"
            qbs = (first_query + torch.randperm(nb - first_query, generator=gen)[:2]).tolist()
            lo, hi = (2.0, 4.0) if kind == "attention" else (0.5, 1.5)
            a = amplitude(lo + (hi - lo) * float(torch.rand((), generator=gen)))
            u = unit()
            keys = slice(kb * block_size, (kb + 1) * block_size)
            k[0, n, keys] += a * u
            if kind == "value":
                v[0, n, keys] *= 6.0
            for qb in qbs:
                q[0, heads, qb * block_size:(qb + 1) * block_size] += a * u
            planted.append(Needle(0, n, kb, tuple(sorted(qbs)), kind))
    desc = (f"synthetic: B=1, Hq={q_heads}, Hkv={kv_heads}, S={seq_len}, D={head_dim}, "
            f"{len(planted)} needles")
    return Workload("synthetic", q, k, v, scale, block_size, stride, planted, desc)


def llama_workload(
    *, seq_len: int = 2048, layer: int = -1, block_size: int = 32, stride: int = 8,
    seed: int = 0,
) -> Workload:
    """q/k/v (after RoPE) of one layer of a tiny random LlamaForCausalLM.

    2 layers, hidden 64, 4 heads of 16, 2 KV heads, vocabulary 128, random
    token ids; the attention inputs are captured through a registered
    attention function. A randomly initialised model attends almost
    uniformly, so this workload checks the plumbing of real model tensors
    (RoPE, GQA) more than the selection's quality.

    Raises:
        ImportError naming the ``hf`` extra when transformers is missing.
    """
    try:
        from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError as exc:
        raise ImportError("llama_workload needs transformers; install the 'hf' extra: "
                          "pip install 'stem-indexer[hf]'") from exc

    captured: dict[int, tuple] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured[module.layer_idx] = (query.detach(), key.detach(), value.detach(),
                                      kwargs.get("scaling"))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    name = "stem-indexer-eval-capture"
    AttentionInterface.register(name, capture)
    try:
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=max(seq_len, 2048),
                             attn_implementation=name)
        model = LlamaForCausalLM(config).eval()
        ids = torch.randint(0, config.vocab_size, (1, seq_len),
                            generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            model(ids)
    finally:
        del AttentionInterface._global_mapping[name]
    layer_idx = layer % config.num_hidden_layers
    q, k, v, scaling = captured[layer_idx]
    desc = (f"tiny Llama layer {layer_idx} (random init): B=1, Hq=4, Hkv=2, S={seq_len}, D=16")
    return Workload("llama", q.float(), k.float(), v.float(),
                    float(scaling if scaling is not None else q.shape[-1] ** -0.5),
                    block_size, stride, [], desc)


# --------------------------------------------------------------------------- #
# Measurement
# --------------------------------------------------------------------------- #


def dense_probs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention in float32: ``(probs [B,Hq,S,S], out [B,Hq,S,D])``.

    Query and key counts are equal (self-attention over one sequence).
    """
    group = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(group, 1)
    vv = v.float().repeat_interleave(group, 1)
    s = q.shape[2]
    logits = torch.einsum("bhqd,bhkd->bhqk", q.float(), kk) * scale
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1)
    return probs, probs @ vv


def select_blocks(work: Workload, config: EvalConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Stem's selection for ``work`` under ``config``: ``(sparse_indices, sparse_seq_len)``."""
    from ..pipeline.prepare import stem_inputs

    # The scale stem_attention folds into qflat by default: a block pair's
    # score is then the mean attention logit of the token pairs it samples.
    inputs = stem_inputs(work.q, work.k, work.v, stem_block_size=work.block_size,
                         stem_stride=work.stride, scale=work.scale / work.stride, oam=config.oam,
                         oam_lambda=config.oam_lambda)
    return stem_indexer(
        inputs.qflat, inputs.kflat, inputs.vbias, inputs.q_seq_lens, inputs.kv_seq_lens,
        causal=True, stem_block_size=work.block_size, stem_stride=work.stride,
        alpha=config.alpha, initial_blocks=config.initial_blocks,
        window_size=config.window_size, **config.budget.kwargs())


def _kept_blocks(indices: torch.Tensor, seq_len: torch.Tensor, kb: int) -> torch.Tensor:
    """Boolean [B, Hq, Qb, Kb]: key block j kept for query block i."""
    b, h, qb = seq_len.shape
    kept = torch.zeros(b, h, qb, kb + 1, dtype=torch.bool)
    valid = torch.arange(indices.shape[-1]) < seq_len[..., None].long()
    idx = torch.where(valid, indices.long(), kb)
    kept.scatter_(-1, idx, True)
    return kept[..., :kb]


@dataclass
class EvalRow:
    """The measurements of one (workload, configuration) pair."""

    workload: str
    config: EvalConfig
    density: float
    mass_recall: float
    rel_l2: float
    max_abs: float
    attention_needle_recall: float | None = None
    value_needle_recall: float | None = None


def measure(work: Workload, config: EvalConfig, indices: torch.Tensor, seq_len: torch.Tensor,
            probs: torch.Tensor, dense_out: torch.Tensor) -> EvalRow:
    """Density, mass recall, output error and needle recall of one selection."""
    from ..surfaces.attention import block_sparse_attention

    bs = work.block_size
    s = work.q.shape[2]
    nb = contract.ceil_div(s, bs)
    visible = contract.visible_blocks(torch.arange(nb), nb, nb, causal=True)
    rows = seq_len.shape[0] * seq_len.shape[1]
    density = float(seq_len.long().sum()) / float(visible.sum() * rows)

    kept = _kept_blocks(indices, seq_len, nb)                            # [B,H,Qb,Kb]
    token_block = torch.arange(s) // bs
    kept_tokens = kept[:, :, token_block][:, :, :, token_block]           # [B,H,S,S]
    mass = (probs * kept_tokens).sum(-1)                                  # [B,H,S]
    mass_recall = float(mass.mean())

    out = block_sparse_attention(work.q, work.k, work.v, indices, seq_len,
                                 stem_block_size=bs, causal=True, scale=work.scale).float()
    diff = out - dense_out
    rel_l2 = float(diff.norm() / dense_out.norm())
    max_abs = float(diff.abs().max())

    recall: dict[str, float | None] = {"attention": None, "value": None}
    group = work.q.shape[1] // work.k.shape[1]
    for kind in recall:
        hits = [bool(kept[n.batch, h, qb, n.key_block])
                for n in work.needles if n.kind == kind
                for h in range(n.kv_head * group, (n.kv_head + 1) * group)
                for qb in n.query_blocks]
        recall[kind] = sum(hits) / len(hits) if hits else None
    return EvalRow(work.name, config, density, mass_recall, rel_l2, max_abs,
                   recall["attention"], recall["value"])


def evaluate(workloads: Iterable[Workload],
             configs: Sequence[EvalConfig] | None = None) -> list[EvalRow]:
    """Measure every configuration on every workload (dense reference once each)."""
    configs = list(default_configs() if configs is None else configs)
    rows = []
    for work in workloads:
        probs, dense_out = dense_probs(work.q, work.k, work.v, work.scale)
        for config in configs:
            indices, seq_len = select_blocks(work, config)
            rows.append(measure(work, config, indices, seq_len, probs, dense_out))
    return rows
