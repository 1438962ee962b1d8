"""Plan once, run without the host (``stem_indexer.pipeline.plan``).

* ``stem_run`` on a ``stem_plan`` is float64 attention (``reference_attention``)
  on every path: over every visible block where the plan is dense (by the
  budget, by ``dense_above``, through the block kernels for the log-sum-exp),
  over the indexer's blocks where it is sparse (padded batches, GQA, the
  exact tail's rows widened, the value bias on or off), one plan serving
  several layers. The blocks come from the public ops (``stem_inputs``,
  ``stem_indexer``); on CUDA they are first held to the CPU path's
  (docs/CONTRACT.md section 5), and a CUDA graph of the run replays it on new
  inputs.
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
from stem_indexer import StemIndexerInputError
from stem_indexer.pipeline import plan as plan_module
from stem_indexer.operator.contract import DEFAULT_EXACT_TAIL, PRESETS, IndexerParams
from stem_indexer.pipeline.plan import stem_plan, stem_run
from stem_indexer.testing import compare, reference_attention, token_mask

BS, STRIDE = 16, 4
SMALL = dict(stem_block_size=BS, stem_stride=STRIDE, preset="tight")


def _plan_for(q, k, lens, **kw):
    batch, hq, sq, dim = q.shape
    return stem_plan(lens or [sq] * batch, lens or [sq] * batch, num_heads=hq,
                     num_kv_heads=k.shape[1], head_dim=dim, device=q.device, dtype=q.dtype,
                     q_len=sq, kv_len=k.shape[2], **kw)


def _picks(q, k, v, lens, kw):
    """The indexer's blocks for ``kw`` through the public ops (``stem_inputs``
    with the scale folded, ``stem_indexer`` with the preset's budget) on q's
    device, on the host. Off the CPU they must be the CPU path's, up to
    rounding of a row's threshold (docs/CONTRACT.md section 5)."""
    oam = {name: kw[name] for name in ("oam", "oam_lambda") if name in kw}
    params = dict(PRESETS["tight"], stem_block_size=BS, stem_stride=STRIDE)
    scale = q.shape[-1] ** -0.5 / STRIDE

    def pick(q, k, v):
        inputs = stem_indexer.stem_inputs(q, k, v, q_lens=lens, kv_lens=lens, scale=scale,
                                          stem_block_size=BS, stem_stride=STRIDE, **oam)
        return inputs, tuple(t.cpu() for t in stem_indexer.stem_indexer(*inputs, **params))

    _, picks = pick(q, k, v)
    if q.device.type != "cpu":
        host_inputs, want = pick(q.cpu(), k.cpu(), v.cpu())
        result = compare.compare(picks, want, host_inputs._asdict(), IndexerParams(**params))
        assert result.ok, result.summary()
    return picks


def reference(q, k, v, lens, kw, path):
    """float64 attention (``reference_attention``) of what a run with ``kw``
    attends: every block its queries see where the plan is dense; the
    indexer's blocks (``_picks``) where it is sparse, with the rows holding
    the prompt's last ``exact_tail`` tokens widened to every block they see."""
    batch, hq, seq, _ = q.shape
    nb = -(-seq // BS)
    every = torch.arange(nb, dtype=torch.int32).expand(batch, hq, nb, nb).clone()
    if path == "dense":
        idx, seq_len = every, torch.full((batch, hq, nb), nb, dtype=torch.int32)
    else:
        idx, seq_len = _picks(q, k, v, lens, kw)
        tail = kw.get("exact_tail", DEFAULT_EXACT_TAIL)
        for b, n in enumerate(lens or [seq] * batch):  # q_len = kv_len = prompt here
            for i in range(-(-n // BS)):
                if (i + 1) * BS - 1 >= n - tail:  # block i holds one of the last tokens
                    idx[b, :, i], seq_len[b, :, i] = every[b, :, i], i + 1
    mask = token_mask(idx, seq_len, BS, seq, seq, lens, lens, True)
    return reference_attention(q, k, v, mask, return_lse=kw.get("return_lse", False))


def assert_matches(got, want, lse: bool) -> None:
    got, want = ((got, want) if lse else ((got,), (want,)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu().double(), b, rtol=1e-5, atol=1e-5)


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
def test_the_run_is_attention_on_its_blocks(seq, lens, extra, path, device):
    """The run against float64 attention: dense attention where the plan is
    dense, else attention on the indexer's blocks (the exact tail's rows on
    every block they see)."""
    q, k, v = qkv(2, 4, 2, seq, seq, 32, seed=seq, device=device)
    kw = {**SMALL, **cpu_dense_above(device), **extra}
    with torch.inference_mode():
        plan = _plan_for(q, k, lens, **kw)
        got = stem_run(q, k, v, plan)
    assert plan.path == path, plan.info
    assert_matches(got, reference(q, k, v, lens, kw, path), bool(extra.get("return_lse")))


def test_one_plan_serves_many_layers(device):
    q, k, v = qkv(1, 4, 2, 1024, 1024, 32, seed=1, device=device)
    kw = {**SMALL, **cpu_dense_above(device)}
    with torch.inference_mode():
        plan = _plan_for(q, k, None, **kw)
        assert plan.path == "sparse"
        for layer in range(3):
            q2, k2, v2 = q * (layer + 1), k.roll(layer, 2), v + layer
            assert_matches(stem_run(q2, k2, v2, plan), reference(q2, k2, v2, None, kw, "sparse"),
                           False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replays_the_run():
    """A CUDA graph captures the run (warmed up on a side stream) and replays
    it on new inputs: float64 attention on the new inputs' blocks, and the
    eager run's bits."""
    q, k, v = qkv(2, 4, 2, 1000, 1000, 32, seed=2, device="cuda")
    lens = [1000, 700]
    kw = {**SMALL, **cpu_dense_above("cuda")}
    with torch.inference_mode():
        plan = _plan_for(q, k, lens, **kw)
        assert plan.path == "sparse"
        static = [x.clone() for x in (q, k, v)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                stem_run(*static, plan)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = stem_run(*static, plan)
        fresh = qkv(2, 4, 2, 1000, 1000, 32, seed=3, device="cuda")
        for x, new in zip(static, fresh):
            x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, stem_run(*fresh, plan))
        assert_matches(out, reference(*fresh, lens, kw, "sparse"), False)


# "aot_eager" traces as Inductor does (Dynamo, fake tensors, functionalisation)
# without generating and building C++; Inductor builds it too. Both in the slow
# tier: the default run compiles stem_attention, plan and run in one graph
# (tests/test_flash.py).
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_run_compiles_with_fullgraph_and_dynamic_shapes(backend):
    torch._dynamo.reset()
    run = torch.compile(stem_run, fullgraph=True, dynamic=True, backend=backend)
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
