"""Plan once, run without the host (``stem_indexer.plan``).

* ``stem_run`` on a ``stem_plan`` is ``stem_attention``, to the bit, on
  every path: sparse (padded batches, GQA, the exact tail), dense by the
  budget, dense through the block kernels (the log-sum-exp), decode.
* The run compiled with ``fullgraph=True, dynamic=True`` equals eager over
  several lengths (fullgraph: a graph break would raise).
* The run reads nothing on the host outside its kernels: a spy on every way
  a tensor's values reach Python finds none in the orchestration (the ops'
  kernels, which on CUDA are Triton and FlexAttention launches, may).
* The transformers integration plans once per forward pass, not once per
  layer.
* Bad arguments name themselves.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import cpu_dense_above, host_reads, qkv

import stem_indexer
from stem_indexer import StemIndexerInputError, plan as plan_module
from stem_indexer.plan import stem_plan, stem_run

SMALL = dict(stem_block_size=16, stem_stride=4, preset="tight")


def _both(q, k, v, lens, **kw):
    """stem_attention's (out, lse?, info) and stem_run's on one plan."""
    batch, hq, sq, dim = q.shape
    with torch.inference_mode():
        want = stem_indexer.stem_attention(q, k, v, q_lens=lens, kv_lens=lens, return_info=True,
                                           **kw)
        plan = stem_plan(lens or [sq] * batch, lens or [sq] * batch, num_heads=hq,
                         num_kv_heads=k.shape[1], head_dim=dim, device=q.device, dtype=q.dtype,
                         q_len=sq, kv_len=k.shape[2], **kw)
        got = stem_run(q, k, v, plan)
    return want, got, plan


@pytest.mark.parametrize("seq,lens,extra,path", [
    (1024, None, {}, "sparse"),
    (1000, [1000, 700], {}, "sparse"),                 # padding, a partial block
    (1024, None, {"exact_tail": 0}, "sparse"),
    (1024, None, {"oam": False}, "sparse"),
    (256, None, {}, "dense"),                          # the budget keeps every block
    (1024, None, {"dense_above": 0.1}, "dense"),       # ... more than dense_above
    (1024, None, {"return_lse": True}, "sparse"),
    (256, [256, 200], {"return_lse": True}, "dense"),  # dense through the block kernels
    (1000, [1000, 700], {"backend": "gather"}, "sparse"),
    # the lengths FlexAttention takes on the device (inductor's compile on CPU: slow)
    pytest.param(1000, [1000, 700], {"backend": "flex"}, "sparse", marks=pytest.mark.slow),
])
def test_the_run_is_stem_attention(seq, lens, extra, path, device):
    q, k, v = qkv(2, 4, 2, seq, seq, 32, seed=seq, device=device)
    kw = {**SMALL, **cpu_dense_above(device), **extra}
    want, got, plan = _both(q, k, v, lens, **kw)
    info = want[-1]
    assert info.path == plan.path == path, (info, plan.info)
    if extra.get("return_lse"):
        assert torch.equal(want[0], got[0])
        assert torch.equal(want[1], got[1])
    else:
        assert torch.equal(want[0], got)


def test_one_plan_serves_many_layers():
    q, k, v = qkv(1, 4, 2, 1024, 1024, 32, seed=1)
    with torch.inference_mode():
        plan = stem_plan([1024], [1024], num_heads=4, num_kv_heads=2, head_dim=32,
                         dtype=torch.float32, **SMALL)
        for layer in range(3):
            q2, k2, v2 = q * (layer + 1), k.roll(layer, 2), v + layer
            want = stem_indexer.stem_attention(q2, k2, v2, **SMALL)
            assert torch.equal(stem_run(q2, k2, v2, plan), want)


def test_the_run_compiles_with_fullgraph_and_dynamic_shapes():
    torch._dynamo.reset()
    run = torch.compile(stem_run, fullgraph=True, dynamic=True)
    for seq, path in ((1024, "sparse"), (1536, "sparse"), (256, "dense")):
        q, k, v = qkv(1, 4, 2, seq, seq, 32, seed=seq)
        with torch.inference_mode():
            plan = stem_plan([seq], [seq], num_heads=4, num_kv_heads=2, head_dim=32,
                             dtype=torch.float32, **SMALL)
            assert plan.path == path
            assert torch.equal(run(q, k, v, plan), stem_run(q, k, v, plan))


@pytest.mark.parametrize("seq,lens,extra", [
    (1024, None, {}), (1000, [1000, 700], {}), (256, None, {}),
    (256, [256, 200], {"return_lse": True}),
])
def test_the_run_reads_nothing_on_the_host(seq, lens, extra):
    q, k, v = qkv(2, 4, 2, seq, seq, 32, seed=3)
    with torch.inference_mode():
        plan = stem_plan(lens or [seq] * 2, lens or [seq] * 2, num_heads=4, num_kv_heads=2,
                         head_dim=32, dtype=torch.float32, q_len=seq, kv_len=seq, **SMALL,
                         **extra)
        assert host_reads(lambda: stem_run(q, k, v, plan)) == []


def test_the_spy_sees_a_host_read():
    # The planning itself reads the lengths: the spy must say so.
    reads = host_reads(lambda: stem_plan([1024], [1024], num_heads=4, num_kv_heads=2,
                                          head_dim=32, dtype=torch.float32, **SMALL))
    assert any("plan.py" in r for r in reads), reads


def test_the_transformers_integration_plans_once_per_forward(monkeypatch):
    transformers = pytest.importorskip("transformers")
    import stem_indexer.integrations.transformers as stem_hf

    built = []
    build = plan_module.build_plan
    monkeypatch.setattr(plan_module, "build_plan", lambda *a, **kw: built.append(1) or
                        build(*a, **kw))
    fn = stem_hf.register("stem-plan-test", preset="tight", stem_block_size=32, stem_stride=8)
    try:
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=3, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=4096)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
        model.set_attn_implementation("stem-plan-test")
        ids = torch.randint(0, 128, (1, 2048))
        with torch.inference_mode():
            model(ids)
        assert sum(fn.stats.values()) == 3, fn.stats  # three layers ran Stem's op ...
        assert len(built) == 1, built  # ... on one plan
    finally:
        stem_hf.unregister("stem-plan-test")


@pytest.mark.parametrize("call,arg", [
    (lambda: stem_plan(None, [8], num_heads=4, num_kv_heads=2, head_dim=8), "q_lens"),
    (lambda: stem_plan([], [], num_heads=4, num_kv_heads=2, head_dim=8), "q_lens"),
    (lambda: stem_plan([8], [8, 8], num_heads=4, num_kv_heads=2, head_dim=8), "kv_lens"),
    (lambda: stem_plan([8], [8], num_heads=4, num_kv_heads=3, head_dim=8), "num_heads"),
    (lambda: stem_plan([8], [8], num_heads=4, num_kv_heads=2, head_dim=0), "head_dim"),
    (lambda: stem_plan([9], [8], num_heads=4, num_kv_heads=2, head_dim=8, q_len=8), "q_lens"),
    (lambda: stem_plan([8], [8], num_heads=4, num_kv_heads=2, head_dim=8, preset="x"), "preset"),
    (lambda: stem_plan([8], [8], num_heads=4, num_kv_heads=2, head_dim=8,
                       num_prompt_tokens=[4]), "num_prompt_tokens"),
])
def test_bad_plans_name_the_argument(call, arg):
    with pytest.raises(StemIndexerInputError, match=arg):
        call()


def test_a_run_on_other_tensors_than_planned_is_refused():
    plan = stem_plan([64], [64], num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    q, k, v = qkv(1, 4, 2, 64, 64, 8, seed=0)
    with pytest.raises(StemIndexerInputError, match="plan's shape"):
        stem_run(q[:, :, :32], k, v, plan)
    with pytest.raises(StemIndexerInputError, match="as planned"):
        stem_run(q.double(), k, v, plan)
    with pytest.raises(StemIndexerInputError, match="inference-only"):
        stem_run(q.requires_grad_(), k, v, plan)
