"""The vLLM backend on a real engine (vLLM's CPU build; skipped where the
``vllm`` extra is not installed).

A tiny random Llama made here (2 layers, 4 query / 2 KV heads, head dim 32)
runs through ``vllm.LLM`` with KV pages and Stem blocks of 32 tokens and
``max_num_batched_tokens=97``: a 2,400-token prompt arrives in about 25
chunks whose boundaries are not multiples of the block, beside two shorter
prompts that decode meanwhile (mixed batches), and a second prompt sharing
its first 2,000 tokens is a prefix-cache hit. Each configuration runs in a process of its own
(``tests/vllm_engine.py``); the comparisons are between those runs, against
vLLM's own backend, or, row by row, against ``stem_attention`` on the same
queries, keys and values (the keys and values as the Stem layers wrote them,
recorded beside the engine: the backend itself never reads them back).

In bfloat16 vLLM packs its cache for the CPU's instruction set: ``amx`` on
Xeons with AMX, ``vec`` elsewhere on x86. The bfloat16 runs check Stem on
whichever layout the machine gives; ``test_amx_engine_runs_stem_on_the_amx_layout``
asserts the ``amx`` one and is skipped, with the reason, on a CPU without AMX.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (pip install "
                    "'stem-indexer[vllm]')")

HERE = Path(__file__).parent
BLOCK = 32
KEEP_ALL = {"stem_block_size": BLOCK, "stem_stride": 8, "k_block_num_bias_medium": 1000,
            "k_block_num_bias_large": 1000}
# The selection as the ops give it: the miss check, which may widen a layer's
# rows, has tests of its own.
SPARSE = {"stem_block_size": BLOCK, "stem_stride": 8, "preset": "tight", "miss_check": 0}
ENGINE = {"dtype": "float32", "max_model_len": 4096, "block_size": BLOCK,
          "max_num_batched_tokens": 97, "enforce_eager": True}
BF16 = {"dtype": "bfloat16"}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


HAS_AMX = {"amx_bf16", "amx_tile"} <= _cpu_flags()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    vocab = {f"t{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                         eos_token="t2").save_pretrained(out)
    return str(out)


def _prompts() -> list[list[dict]]:
    rng = random.Random(1)
    long = [rng.randrange(3, 512) for _ in range(2400)]
    medium = [rng.randrange(3, 512) for _ in range(300)]
    short = [rng.randrange(3, 512) for _ in range(40)]
    hit = long[:2000] + [rng.randrange(3, 512) for _ in range(150)]
    # The short prompts first: they decode while the long one's chunks prefill.
    return [[{"prompt": short, "max_tokens": 24}, {"prompt": medium, "max_tokens": 24},
             {"prompt": long, "max_tokens": 6}],
            [{"prompt": hit, "max_tokens": 6}]]


def run_engine(model: str, stem: dict | None, *, engine: dict | None = None,
               check_rows: bool = False, env: dict | None = None,
               fail: tuple[str, int] | None = None, batches: list | None = None,
               follow_up: dict | None = None) -> dict:
    spec = {"model": model, "stem": stem, "engine": {**ENGINE, **(engine or {})},
            "batches": batches or _prompts(), "check_rows": check_rows, "fail": fail,
            "follow_up": follow_up}
    run_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    proc = subprocess.run([sys.executable, str(HERE / "vllm_engine.py"), json.dumps(spec)],
                          capture_output=True, text=True, env=run_env, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    result["log"] = proc.stdout + proc.stderr  # vLLM logs to stdout
    return result


_RUNS: dict = {}


def cached(model: str, name: str, stem, **kwargs) -> dict:
    if name not in _RUNS:
        _RUNS[name] = run_engine(model, stem, **kwargs)
    return _RUNS[name]


def plain(model, engine: dict | None = None):
    name = "plain" + ("-" + "-".join(f"{k}={v}" for k, v in engine.items()) if engine else "")
    return cached(model, name, None, engine=engine)


def assert_same_tokens(a: dict, b: dict, logprob_tol: float) -> None:
    assert len(a["outputs"]) == len(b["outputs"]) == 4
    for x, y in zip(a["outputs"], b["outputs"]):
        assert x["tokens"] == y["tokens"]
        worst = max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"]))
        assert worst <= logprob_tol, worst


# --------------------------------------------------------------------------- #
# vLLM's cache and kernel, without an engine
# --------------------------------------------------------------------------- #


def _paged(k, v, page: int, num_pages: int, seed: int, isa: str):
    """k, v [Hkv, S, D] written by vLLM's own cache writer, in layout ``isa``,
    onto shuffled pages, and into an indexer cache with the same slots."""
    import torch
    from vllm import _custom_ops as ops

    from stem_indexer.pipeline.index_cache import IndexCache

    hkv, seq, dim = k.shape
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(num_pages, generator=gen)[:-(-seq // page)].to(torch.int32)
    kv = torch.zeros(num_pages, hkv, page, 2 * dim, dtype=k.dtype)
    key_cache, value_cache = kv.view(num_pages, hkv, 2 * page, dim).chunk(2, dim=2)
    slots = pages[torch.arange(seq) // page].long() * page + torch.arange(seq) % page
    keys, values = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    cache = IndexCache.allocate(num_pages, page, 8, hkv, dim)
    cache.write(keys, values, slots)
    return kv, cache, pages


LAYOUTS = [("vec", "float32"), ("vec", "bfloat16"), ("vec16", "bfloat16"),
           pytest.param("amx", "bfloat16", marks=pytest.mark.skipif(
               not HAS_AMX, reason="the amx layout needs a CPU with AMX (amx_bf16)"))]


@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("isa, dtype", LAYOUTS)
def test_pages_read_back_are_what_vllms_writer_packed(isa, dtype, page):
    """kv_read.PageReader, probed with vLLM's own writer in each layout,
    reads back exactly the keys and values that writer packed on shuffled
    pages (the decoded pages a Stem row rebuilds its entries from)."""
    import torch

    from stem_indexer.integrations.vllm.backend import page_reader

    if isa in ("vec", "amx") and page % 32:
        pytest.skip(f"vLLM's {isa} layout takes pages of a multiple of 32 tokens")
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(page)
    k = torch.randn(2, 3 * page + 7, 64, generator=gen).to(dtype)
    v = torch.randn(2, 3 * page + 7, 64, generator=gen).to(dtype)
    kv, _, pages = _paged(k, v, page, 9, page, isa)
    reader = page_reader(isa, dtype, page, 2, 64)
    assert reader is not None
    keys, values = reader.read(kv, pages)
    n = k.shape[1]
    assert torch.equal(keys[:n], k.transpose(0, 1)) and torch.equal(values[:n], v.transpose(0, 1))


@pytest.mark.parametrize("page", [32, 128])
@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])  # LAYOUTS' bfloat16 ones
def test_stems_kernel_packs_vllms_own_pages(isa, page):
    """Stem's kernel packing the keys and values itself from pages that
    vLLM's own writer filled, in each bfloat16 layout it packs (``amx`` and
    ``vec``; where it cannot, the reason), against float64 attention masked
    to a random selection."""
    import torch

    from stem_indexer.integrations.vllm.backend import page_reader
    from stem_indexer.operator.ops import sparse_attention
    from stem_indexer.testing import reference_attention, token_mask

    if isa == "amx" and not HAS_AMX:
        pytest.skip("the amx layout needs a CPU with AMX (amx_bf16)")
    if isa in ("vec", "amx") and page % 32:
        pytest.skip(f"vLLM's {isa} layout takes pages of a multiple of 32 tokens")
    hq, hkv, dim, bs, seq, q_len = 4, 2, 64, 32, 3 * page + 45, 100
    gen = torch.Generator().manual_seed(page)
    k, v = (torch.randn(hkv, seq, dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    kv, _, pages = _paged(k, v, page, 9, page, isa)
    reader = page_reader(isa, torch.bfloat16, page, hkv, dim)
    why = sparse_attention.paged_refused(page, dim, bs, reader.key_view, reader.value_view)
    if why is not None:
        assert isa not in ("vec", "amx"), why  # the two layouts the pack is for
        pytest.skip(f"the {isa} layout is read first: {why}")
    q = torch.randn(1, hq, q_len, dim, generator=gen).to(torch.bfloat16)
    qb, kb = -(-q_len // bs), -(-seq // bs)
    keep = (torch.rand(1, hq, qb, kb, generator=gen) < 0.5) | (
        torch.arange(kb) == torch.arange(qb)[:, None] + kb - qb)
    idx = torch.where(keep, torch.arange(kb), kb).sort(-1).values
    idx, lengths = torch.where(idx < kb, idx, -1), keep.sum(-1)
    q_lens, kv_lens = torch.tensor([q_len]), torch.tensor([seq])
    out = sparse_attention.sparse_attention_paged(
        q, kv, pages[None], page, reader.key_view, reader.value_view, idx, lengths, q_lens,
        kv_lens, bs, True, dim ** -0.5)
    vis = token_mask(idx, lengths, bs, q_len, seq, q_lens, kv_lens, True)
    want = reference_attention(q, k[None], v[None], vis, scale=dim ** -0.5)
    assert (out.double() - want).abs().max().item() < 2e-2


@pytest.mark.parametrize("tail", [0, 200], ids=["no-tail", "tail"])
@pytest.mark.parametrize("isa, dtype", LAYOUTS)
@pytest.mark.parametrize("context, q_len", [(0, 900), (1000, 333), (2047, 1), (1601, 700)])
def test_virtual_rows_on_vllms_kernel_equal_stem_attention(context, q_len, isa, dtype, tail):
    """The backend's row, outside an engine: the indexer cache's inputs, the
    selection and vLLM's kernel on virtual rows, in each cache layout,
    against ``stem_attention`` on the same tensors. With ``exact_tail`` the
    row ends its prompt: its last 200 tokens' blocks list every block."""
    import math

    import torch
    from vllm import _custom_ops as ops

    import stem_indexer
    from stem_indexer.integrations.vllm.rows import (Row, plan_stem_row, select_blocks,
                                                      virtual_rows)
    from stem_indexer.integrations.vllm.settings import StemSettings

    if isa == "amx":
        torch._C._cpu._init_amx()  # the process's first tile instruction needs it
    bs, page, hq, hkv, dim = 64, 32, 6, 2, 32
    prompt = context + q_len if tail else 4000
    s = StemSettings.from_mapping({"preset": "tight", "stem_block_size": bs, "stem_stride": 8,
                                   "exact_tail": tail})
    torch.manual_seed(context)
    row = Row(0, 0, q_len, context, prompt)
    dt = getattr(torch, dtype)
    query = torch.randn(q_len, hq, dim).to(dt)
    k, v = torch.randn(2, hkv, row.seq_len, dim).to(dt)
    kv, cache, pages = _paged(k, v, page, 140, context, isa)
    scale = 1 / math.sqrt(dim)
    plan = plan_stem_row(row, s, pages, page, hq, hkv, dim)
    assert cache.complete(plan.pages, plan.fill)
    kflat, vbias = cache.inputs(plan.pages, row.seq_len, bs, True, s.oam_lambda)
    idx, lengths = select_blocks(query, kflat, vbias, plan, scale, s)
    vr = virtual_rows(idx, lengths, plan, bs, page, hkv)
    qsl = torch.zeros(vr.query_lens.shape[0] + 1, dtype=torch.int32)
    torch.cumsum(vr.query_lens, 0, out=qsl[1:])
    flat_k, flat_v = kv.view(-1, 1, 2 * page, dim).chunk(2, dim=2)
    md = ops.cpu_attn_get_scheduler_metadata(vr.query_lens.shape[0], 1, 1, dim, vr.seq_lens,
                                             dt, qsl, True, -1, isa, True)
    vq = query.transpose(0, 1).reshape(-1, 1, dim)
    out = torch.empty_like(vq)
    ops.cpu_attention_with_kv_cache(vq, flat_k, flat_v, out, qsl, vr.seq_lens, scale, True,
                                    None, -1, vr.block_table, 0.0, md, None)
    lead = context % bs
    q = torch.zeros(1, hq, lead + q_len, dim, dtype=dt)
    q[0, :, lead:] = query.transpose(0, 1)
    want, info = stem_indexer.stem_attention(
        q, k[None], v[None], scale=scale, preset="tight", num_prompt_tokens=[prompt],
        stem_block_size=bs, stem_stride=8, min_q_blocks=0, dense_above=1.0, exact_tail=tail,
        return_info=True)
    want = want[0, :, lead:]
    assert info.kept_pairs == int(lengths.sum())  # the same selection
    tol = 1e-5 if dtype == "float32" else 2e-2  # two bf16 kernels' roundings
    torch.testing.assert_close(out.view(hq, q_len, dim), want, rtol=tol, atol=tol)
    if row.seq_len > 1500 and not tail:
        assert int(lengths.sum()) < hq * sum(range(context // bs + 1, -(-row.seq_len // bs) + 1))
    if tail:  # the blocks of positions prompt - 200 .. prompt - 1 list 0 .. i
        i = (prompt - 200) // bs
        row_of = max(i, context // bs) - context // bs
        assert lengths[:, row_of].tolist() == [max(i, context // bs) + 1] * hq


# --------------------------------------------------------------------------- #
# Every row dense: exactly vLLM's backend
# --------------------------------------------------------------------------- #


def test_without_the_option_the_plugin_changes_nothing(model):
    """Plugin loaded (the entry point) but no CUSTOM: bit-identical to a run
    with plugins off."""
    off = run_engine(model, None, env={"VLLM_PLUGINS": ""})
    assert off["outputs"] == plain(model)["outputs"]


def test_rows_the_budget_keeps_whole_run_vllms_kernel_bit_for_bit(model):
    run = cached(model, "keep-all", KEEP_ALL)
    assert run["outputs"] == plain(model)["outputs"]
    rows = run["stats"]["rows"]
    assert rows.get("dense:budget keeps every block", 0) > 0
    assert not any(k.startswith("sparse") for k in rows)
    # Every decode row counted once per layer (2), whether its step held only
    # decodes (counted by the builder) or prefill rows too (by each layer).
    decodes = sum(p["max_tokens"] - 1 for batch in _prompts() for p in batch)
    assert rows.get("dense:decode", 0) == 2 * decodes, rows


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory, model) -> str:
    """The tiny model as a Mistral whose layers attend over a 64-token window."""
    import shutil

    import torch
    import transformers

    out = tmp_path_factory.mktemp("tiny-mistral")
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096, sliding_window=64, tie_word_embeddings=False)
    transformers.MistralForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model) / name, out / name)
    return str(out)


def assert_vllms_kernel_only(run: dict, want: dict, reason: str) -> None:
    """Every row of ``run`` ran vLLM's kernel for ``reason``: the tokens of
    vLLM's own backend (``want``), bit for bit, and no sparse row."""
    assert run["outputs"] == want["outputs"]
    rows = run["stats"]["rows"]
    assert rows.get(f"dense:{reason}", 0) > 0, rows
    assert not any(k.startswith("sparse") for k in rows), rows


def test_sliding_window_layers_run_vllms_kernel_and_say_so(windowed_model):
    want = run_engine(windowed_model, None)
    run = run_engine(windowed_model, {**SPARSE, "dense_above": 1.0})
    assert_vllms_kernel_only(run, want, "sliding window")


def test_a_quantised_kv_cache_runs_vllms_kernel_and_says_so(model):
    engine = {"kv_cache_dtype": "fp8"}
    want = run_engine(model, None, engine=engine)
    run = run_engine(model, {**SPARSE, "dense_above": 1.0}, engine=engine)
    assert_vllms_kernel_only(run, want, "kv cache dtype fp8")
    # Said once at start-up, naming it.
    assert run["log"].count("Stem: kv cache dtype fp8 is not supported") == 1, run["log"][-3000:]


def test_a_kv_connector_keeps_stem_off_and_says_so(model, tmp_path):
    """A KV connector loads pages into the KV cache without the backend's
    cache writer (here vLLM's ExampleConnector, which stores every prompt's
    KV on disk and loads it back for a later prompt sharing it), so the
    indexer cache could not vouch for them: Stem refuses the engine with one
    start-up line, every row runs vLLM's kernel and is counted so."""
    engine = {"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                     "kv_connector_extra_config": {
                                         "shared_storage_path": str(tmp_path / "a")}}}
    want = run_engine(model, None, engine=engine)
    engine["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"] = \
        str(tmp_path / "b")
    run = run_engine(model, {**SPARSE, "dense_above": 1.0}, engine=engine)
    assert_vllms_kernel_only(run, want, "kv connector")
    assert run["log"].count("Stem: kv connector is configured") == 1, run["log"][-3000:]
    assert run["stats"]["memory"] == {}  # no indexer cache kept back or allocated


def test_the_indexer_cache_is_allocated_at_start_inside_the_kv_budget(model):
    """The Stem layers' indexer caches and write stage exist before the first
    request and, with the KV cache beside them, fit the budget vLLM was given (1 GiB:
    ``VLLM_CPU_KVCACHE_SPACE`` in tests/vllm_engine.py); start-up says how
    much of it they took."""
    run = cached(model, "sparse", SPARSE, check_rows=True)
    memory = run["stats_at_start"]["memory"]
    index, kv = memory["index_cache_bytes"], memory["kv_cache_bytes"]
    # The write stage: 256 keys and values of 2 heads of 32 per layer, float32.
    assert memory["write_stage_bytes"] == 2 * (2 * 256 * 2 * 32 * 4), memory
    # Per KV page of 32 tokens and 2 KV heads of 32: float32 sums of 8 groups
    # and 4 run maxima per head, a count and a tag; K and V in float32.
    per_page_index, per_page_kv = 2 * (8 * 32 + 32 // 8) * 4 + 12, 2 * 32 * 2 * 32 * 4
    assert index * per_page_kv == kv * per_page_index, memory
    stage = memory["write_stage_bytes"]
    assert 2**30 - 2 * (per_page_index + per_page_kv) < index + kv + stage <= 2**30, memory
    assert "MiB of the 1024.0 MiB KV-cache budget go to the indexer cache" in run["log"]
    assert run["stats"]["memory"] == memory  # nothing allocated later


def test_the_first_layers_kept_dense_run_vllms_kernel_and_keep_no_indexer_cache(model):
    """``dense_layers: 1``: layer 0 runs vLLM's kernel for every row (its
    pairs all kept, counted as such) and gets no indexer cache; layer 1's
    rows stay sparse and equal Stem's own functions."""
    run = cached(model, "sparse-dense-layer", {**SPARSE, "dense_layers": 1}, check_rows=True)
    stats = run["stats"]
    assert list(stats["layers"]) == ["model.layers.1.self_attn.attn"], stats  # sparse rows'
    second = stats["layers"]["model.layers.1.self_attn.attn"]
    assert 0 < second["kept"] < second["visible"], stats
    # each row layer 1 ran sparse, layer 0 ran on vLLM's kernel
    sparse = sum(v for k, v in stats["rows"].items() if k.startswith("sparse"))
    assert stats["rows"].get("dense:dense layer", 0) == sparse > 10, stats
    rec = run["record"]
    assert rec["rows"] == sparse and rec["selection_mismatches"] == 0, rec
    assert rec["cache_mismatches"] == 0 and rec["max_error"] < 1e-5, rec
    memory = run["stats_at_start"]["memory"]
    # One layer's write stage and indexer cache (the sizes of the test above);
    # the memory counts the KV cache of the layers with an indexer cache
    index, kv, stage = (memory[k] for k in ("index_cache_bytes", "kv_cache_bytes",
                                            "write_stage_bytes"))
    assert stage == 2 * 256 * 2 * 32 * 4, memory
    per_page_index, per_page_kv = 2 * (8 * 32 + 32 // 8) * 4 + 12, 2 * 32 * 2 * 32 * 4
    assert index * per_page_kv == kv * per_page_index, memory
    # both layers' KV cache and one indexer cache fill the budget of 1 GiB
    assert 2**30 - (per_page_index + 2 * per_page_kv) < index + 2 * kv + stage <= 2**30, memory


def test_a_layer_with_a_budget_of_its_own_keeps_its_blocks(model):
    """``layer_budgets``: layer 0's budget keeps every block of its Stem
    rows, layer 1 keeps the ``tight`` budget; each row of each layer equals
    Stem's own functions run with that layer's budget."""
    keep_all = {"k_block_num_bias_medium": 1000, "k_block_num_bias_large": 1000}
    run = cached(model, "sparse-layer-budget", {**SPARSE, "layer_budgets": {"0": keep_all}},
                 check_rows=True)
    layers = run["stats"]["layers"]
    first, second = (layers[f"model.layers.{n}.self_attn.attn"] for n in (0, 1))
    assert first["kept"] == first["visible"] > 0, layers
    assert 0 < second["kept"] < second["visible"] == first["visible"], layers
    rec = run["record"]
    assert rec["rows"] > 10 and rec["selection_mismatches"] == 0, rec
    assert rec["cache_mismatches"] == 0 and rec["max_error"] < 1e-5, rec
    assert "layer_budgets[0]=k_block_num_bias_medium=1000,k_block_num_bias_large=1000" in run["log"]


def test_the_miss_check_widens_a_layer_whose_selection_misses(model):
    """``miss_check`` under any miss: each layer's first sampled row widens
    it for the rest of its request's prompt; every Stem row then keeps every
    block and the answers are vLLM's own. Over any miss: nothing widens and
    every row is Stem's selection."""
    names = {f"model.layers.{i}.self_attn.attn" for i in range(2)}
    wide = cached(model, "miss-wide", {**SPARSE, "dense_above": 1.0, "miss_check": 1e-9,
                                       "miss_check_min_prompt": 0})
    checks, rows = wide["stats"]["checks"], wide["stats"]["rows"]
    assert set(checks) == names, checks
    for c in checks.values():
        assert c["widened"] == c["checked"] > 0 and 0 < c["mean_miss"] < 1, checks
    # Later chunks of a widened request are widened without a check of their own.
    assert rows["dense:miss check"] > sum(c["checked"] for c in checks.values()), rows
    assert wide["stats"]["density"] is None or wide["stats"]["density"] == 1.0, wide["stats"]
    assert_same_tokens(wide, plain(model), 1e-4)
    assert "miss_check=1e-09 (queries=16 blocks=1 min_prompt=0 from=0)" in wide["log"]

    narrow = cached(model, "miss-narrow", {**SPARSE, "miss_check": 0.999,
                                           "miss_check_min_prompt": 0}, check_rows=True)
    _assert_rows_match_stem(narrow, 1e-5)
    checks = narrow["stats"]["checks"]
    assert set(checks) == names and all(c["widened"] == 0 < c["checked"]
                                        for c in checks.values()), checks
    assert "dense:miss check" not in narrow["stats"]["rows"]

    # Prompts under miss_check_min_prompt (the default 20480 here) are not checked.
    short = cached(model, "miss-short", {**SPARSE, "miss_check": 1e-9})
    assert short["stats"]["checks"] == {} and "dense:miss check" not in short["stats"]["rows"]
    assert "min_prompt=20480" in short["log"]


def test_the_miss_check_starts_at_its_first_position(model):
    """``miss_check_from``: under any miss, every Stem row whose queries start
    before it keeps the indexer's selection (as ``stem_indexer`` picks on
    the same keys), and from it on each layer's first sampled row widens the
    layer for the rest of its request's prompt (every block it sees)."""
    start = 1200
    run = cached(model, "miss-from", {**SPARSE, "miss_check": 1e-9, "miss_check_min_prompt": 0,
                                      "miss_check_from": start}, check_rows=True)
    rec, checks = run["record"], run["stats"]["checks"]
    assert set(checks) == {f"model.layers.{i}.self_attn.attn" for i in range(2)}, checks
    assert all(c["widened"] == c["checked"] > 0 for c in checks.values()), checks
    # The sampled rows: widened after the indexer ran, so their lists are not its.
    assert rec["mismatch_contexts"] and min(rec["mismatch_contexts"]) >= start, rec
    # The rows after them: every block, from the first position on only.
    assert rec["widened"] and all(ok for _, ok in rec["widened"]), rec["widened"]
    assert min(context for context, _ in rec["widened"]) >= start, rec["widened"]
    before = rec["rows"] - len(rec["mismatch_contexts"])
    assert before > 10 and rec["sparse_rows"] > 0, rec
    assert "min_prompt=0 from=1200" in run["log"]


# --------------------------------------------------------------------------- #
# Stem's path with a budget that keeps every block: vLLM's results
# --------------------------------------------------------------------------- #


def test_stem_path_keeping_every_block_matches_vllm(model):
    run = cached(model, "keep-all-sparse", {**KEEP_ALL, "dense_above": 1.0})
    assert_same_tokens(run, plain(model), 1e-4)
    rows = run["stats"]["rows"]
    for kind in ("fresh", "continuation", "prefix hit"):
        assert rows.get(f"sparse:{kind}", 0) > 0, rows
    assert rows.get("dense:decode", 0) > 0  # the mixed batches' decodes
    assert run["stats"]["density"] == 1.0


# --------------------------------------------------------------------------- #
# A sparse budget: Stem's own functions, row by row
# --------------------------------------------------------------------------- #


def test_sparse_rows_equal_stem_attention_on_the_same_inputs(model):
    run = cached(model, "sparse", SPARSE, check_rows=True)
    _assert_rows_match_stem(run, 1e-5)
    # Decoded tokens are left out (read back from vLLM's cache where a row needs them).
    assert run["record"]["writes_left_out"] > 0
    stats = run["stats"]
    assert stats["density"] < 0.7, stats
    assert set(stats["layers"]) == {f"model.layers.{i}.self_attn.attn" for i in range(2)}
    for layer in stats["layers"].values():
        assert 0 < layer["kept"] < layer["visible"], stats


def test_probe_rows_equal_the_probe_on_the_keys_vllm_was_given(model):
    """The probe reads each row's keys back from vLLM's packed bf16 cache;
    its lists are the probe's on the keys the model produced (recorded as
    written), and the output is block-sparse attention on those lists."""
    probe = {**SPARSE, "probe_queries": 4, "probe_candidates": 2}
    run = cached(model, "probe-bf16", probe, check_rows=True, engine=BF16)
    _assert_rows_match_stem(run, 2e-2)
    assert not any(k.startswith("dense:") and "error" in k for k in run["stats"]["rows"])
    plain_rows = cached(model, "sparse-bf16", SPARSE, check_rows=True, engine=BF16)
    # As many pairs kept as without the probe: only which ones changes.
    assert run["stats"]["density"] == pytest.approx(plain_rows["stats"]["density"], abs=0.02)


def test_without_prefix_caching_decode_tokens_stay_out_of_the_indexer_cache(model):
    """No page outlives its request, so no Stem row reads a decode row's
    tokens: the indexer cache leaves them out, and every Stem row still
    equals Stem's own functions on every key vLLM wrote."""
    run = cached(model, "sparse-no-prefix", SPARSE, check_rows=True,
                 engine={"enable_prefix_caching": False})
    rec = run["record"]
    assert rec["writes_left_out"] > 0, rec
    assert rec["rows"] > 20 and rec["selection_mismatches"] == 0, rec
    assert rec["cache_mismatches"] == 0 and rec["max_error"] < 1e-5, rec
    assert rec["beside_other_rows"] > 0 and "prefix hit" not in rec["kinds"], rec
    assert_close_tokens(run, plain(model))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallel 2 needs two cores")
def test_sparse_selections_with_tensor_parallel_2(model):
    """Each rank runs its half of the heads on its own indexer cache: every
    row counted by both ranks, the density of one worker (the budget keeps
    the same share of every head's pairs; the engines' chunk boundaries may
    differ, so not the same rows), and the prompts that stay dense the same
    tokens as vLLM's."""
    run = run_engine(model, SPARSE, engine={"tensor_parallel_size": 2},
                     env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                          "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    single = cached(model, "sparse", SPARSE, check_rows=True)["stats"]
    rows = run["stats"]["rows"]
    for kind in ("sparse:continuation", "sparse:prefix hit"):
        assert rows.get(kind, 0) > 0 and rows[kind] % 2 == 0, rows
    assert abs(run["stats"]["density"] - single["density"]) < 0.02, (run["stats"], single)
    assert run["stats"]["density"] < 0.7
    assert_close_tokens(run, plain(model))


def test_sparse_selections_in_vllms_compiled_mode(model):
    """vLLM's torch.compile mode (the attention is an opaque op there): the
    same Stem rows, each equal to stem_attention on its inputs."""
    run = cached(model, "compiled", SPARSE, check_rows=True, engine={"enforce_eager": False})
    _assert_rows_match_stem(run, 1e-5)
    eager = cached(model, "sparse", SPARSE, check_rows=True)["stats"]["rows"]
    assert run["stats"]["rows"] == eager


def test_each_prefill_logs_one_line_with_its_rows_and_density(model):
    run = cached(model, "sparse", SPARSE, check_rows=True)
    lines = [x for x in run["log"].splitlines() if "Stem prefill of request" in x]
    assert len(lines) == 4, lines  # four requests
    (long,) = [x for x in lines if "2400 prompt tokens" in x]
    # 2,400 tokens in chunks of 97 (the first beside the short prompts' rows):
    # each chunk is one row per layer, so the rows are twice the chunks.
    chunks = int(long.split(" in ", 1)[1].split(" chunk")[0])
    assert chunks >= 2400 // 97
    assert f"of {2 * chunks} (layer, chunk) rows sparse (continuation " in long, long
    assert "density" in long and "%" in long


def _assert_rows_match_stem(run: dict, tol: float) -> None:
    rec = run["record"]
    assert rec["rows"] > 20 and rec["selection_mismatches"] == 0, rec
    assert rec["cache_mismatches"] == 0, rec  # the indexer cache is stem_inputs's
    assert rec["tail_rows"] > 0, rec  # the default exact_tail: the prompts' last rows
    assert rec["sparse_rows"] > 0, rec  # rows that really dropped blocks
    assert rec["max_error"] < tol, rec
    assert rec["kinds"].get("continuation", 0) > 0 and rec["kinds"].get("prefix hit", 0) > 0, rec
    assert rec["unaligned"] > 0, rec  # chunks starting inside a block
    assert rec["beside_other_rows"] > 0, rec  # Stem rows in steps with decodes
    sparse_rows = sum(v for k, v in run["stats"]["rows"].items() if k.startswith("sparse"))
    assert sparse_rows == rec["rows"], (run["stats"], rec)
    assert sum(run["stats"]["layouts"].values()) == rec["rows"], run["stats"]


def _auto_kernel(dtype: str) -> str:
    """The kernel ``sparse_kernel="auto"`` attends the test model's Stem rows
    with on this machine, by the rule docs/VLLM.md states: Stem's in bfloat16
    on the packed micro-kernel and a layout read as a strided view (``vec``,
    and ``amx`` up to head size 128: the test model's is 32), vLLM's
    elsewhere."""
    from stem_indexer.operator.ops import sparse_attention

    if dtype != "bfloat16" or not sparse_attention.available():
        return "vllm"
    return "vllm" if sparse_attention.bf16_packed(32, BLOCK) else "stem"


def test_bf16_sparse_rows_equal_stem_attention_on_the_machines_layout(model):
    """In bfloat16 the cache is packed for the CPU (``amx`` with AMX, else
    ``vec``); Stem rows run on it all the same, on the kernel ``auto`` picks."""
    run = cached(model, "sparse-bf16", SPARSE, check_rows=True, engine=BF16)
    _assert_rows_match_stem(run, 2e-2)  # two bf16 attention kernels' roundings
    assert set(run["stats"]["layouts"]) == {"amx" if HAS_AMX else "vec"}, run["stats"]
    assert not any("kv cache layout" in k for k in run["stats"]["rows"]), run["stats"]
    assert run["stats"]["kernels"] == {_auto_kernel("bfloat16"): run["record"]["rows"]}


@pytest.mark.parametrize("want, isa, dtype, why, head", [
    ("vllm", "vec", "bfloat16", "sparse_kernel='vllm'", 64),
    ("stem", "neon", "bfloat16", "the neon cache layout cannot be read back", 64),
    ("auto", "vec", "float32", "faster only in bfloat16", 64),
    ("auto", "amx", "bfloat16", "faster only up to head size 128 (this layer's: 256)", 256),
])
def test_where_stems_kernel_does_not_attend_the_choice_says_why(want, isa, dtype, why, head):
    """The backend's choice of kernel (``sparse_kernel``), without an engine:
    each rule that leaves the rows to vLLM's kernel names itself."""
    import types

    import torch

    from stem_indexer.integrations.vllm import backend
    from stem_indexer.integrations.vllm.settings import StemSettings

    if isa == "amx" and not HAS_AMX:
        pytest.skip("the amx layout's writer needs a CPU with AMX")
    impl = backend.StemAttentionImpl.__new__(backend.StemAttentionImpl)
    impl.settings = StemSettings.from_mapping({"sparse_kernel": want})
    impl.head_size = head
    kv_cache = torch.zeros(2, 2, 128, 2 * head, dtype=getattr(torch, dtype))
    reader, said = impl._choose_kernel(types.SimpleNamespace(isa=isa), kv_cache)
    assert reader is None and why in said, said


@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_auto_picks_stems_kernel_on_the_layouts_measured_faster(isa, head):
    """``sparse_kernel="auto"`` in bfloat16 on the ``vec`` and ``amx``
    layouts (benchmarks/VLLM.md, each kernel per kept pair): Stem's kernel,
    on a reader of the layer's pages."""
    import types

    import torch

    from stem_indexer.integrations.vllm import backend
    from stem_indexer.integrations.vllm.settings import StemSettings
    from stem_indexer.operator.ops import sparse_attention

    if isa == "amx" and not HAS_AMX:
        pytest.skip("the amx layout's writer needs a CPU with AMX")
    if not sparse_attention.available() or sparse_attention.bf16_packed(head, BLOCK):
        pytest.skip("Stem's kernel would widen bfloat16 here")
    impl = backend.StemAttentionImpl.__new__(backend.StemAttentionImpl)
    impl.settings = StemSettings.from_mapping({})
    impl.head_size = head
    kv_cache = torch.zeros(2, 2, 128, 2 * head, dtype=torch.bfloat16)
    reader, said = impl._choose_kernel(types.SimpleNamespace(isa=isa), kv_cache)
    assert reader is not None and said == "", said


@pytest.mark.parametrize("kernel, dtype, products", [
    ("stem", "float32", "auto"), ("stem", "bfloat16", "auto"), ("stem", "bfloat16", "float32"),
    ("vllm", "bfloat16", "auto")])
def test_each_sparse_kernel_gives_stem_attention(model, kernel, dtype, products):
    """``sparse_kernel`` forced either way, in each dtype the kernels take,
    Stem's kernel on either product where it packs bfloat16 pages
    (``sparse_products``): every Stem row still equals ``stem_attention`` on
    the keys vLLM was given (Stem's kernel on keys and values read from
    vLLM's cache; vLLM's kernel on virtual rows), every sparse row is counted
    under its kernel, and the log says which kernel ran, and how it
    multiplied."""
    engine = BF16 if dtype == "bfloat16" else {}
    name = f"sparse-{kernel}-{dtype}" + ("" if products == "auto" else f"-{products}")
    run = cached(model, name, {**SPARSE, "sparse_kernel": kernel, "sparse_products": products},
                 check_rows=True, engine=engine)
    _assert_rows_match_stem(run, 2e-2 if dtype == "bfloat16" else 1e-5)
    assert run["stats"]["kernels"] == {kernel: run["record"]["rows"]}, run["stats"]
    said = ("Stem rows run Stem's block-sparse kernel" if kernel == "stem"
            else "Stem rows run vLLM's kernel on virtual rows (sparse_kernel='vllm')")
    assert run["log"].count(said) == 1, run["log"][-3000:]
    if products == "float32":
        assert run["log"].count("it packs straight from vLLM's vec cache pages: float32 "
                                "products, the pages widened once per KV head (as asked)") == 1


def test_bfloat16_products_asked_where_the_micro_kernel_cannot_run_are_auto(monkeypatch,
                                                                             caplog):
    """``sparse_products="bfloat16"`` where torch's micro-kernel cannot take
    the pages: Stem's kernel multiplies as ``"auto"`` does, said once."""
    import logging
    import types

    import torch

    from stem_indexer.integrations.vllm import backend
    from stem_indexer.integrations.vllm.settings import StemSettings
    from stem_indexer.operator.ops import sparse_attention

    monkeypatch.setattr(sparse_attention, "paged_refused",
                        lambda *args: "no micro-kernel" if args[-1] == "brgemm" else None)
    monkeypatch.setattr(sparse_attention, "bf16_packed", lambda *args: "no micro-kernel")
    impl = backend.StemAttentionImpl.__new__(backend.StemAttentionImpl)
    impl.head_size = 64
    kv_cache = torch.zeros(2, 2, 128, 128, dtype=torch.bfloat16)
    reader = types.SimpleNamespace(key_view=None, value_view=None)  # paged_refused's stand-in
    monkeypatch.setattr(backend, "_REPORTED", set())
    for paged in (True, False):
        impl.settings = StemSettings.from_mapping({"sparse_products": "bfloat16"})
        with caplog.at_level(logging.WARNING):
            assert impl._products(kv_cache, reader, paged) == "auto"
        impl.settings = StemSettings.from_mapping({"sparse_products": "float32"})
        assert impl._products(kv_cache, reader, paged) == "widen"
    assert "sparse_products='bfloat16' cannot run here (no micro-kernel)" in caplog.text


@pytest.mark.skipif(not HAS_AMX, reason="needs a CPU with AMX (amx_bf16 and amx_tile in "
                    "/proc/cpuinfo): vLLM packs its bf16 cache for AMX only there")
def test_amx_engine_runs_stem_on_the_amx_layout(model):
    run = cached(model, "sparse-bf16", SPARSE, check_rows=True, engine=BF16)
    rows = run["stats"]["rows"]
    assert run["stats"]["layouts"].get("amx", 0) == sum(
        v for k, v in rows.items() if k.startswith("sparse")) > 0, run["stats"]
    for kind in ("continuation", "prefix hit"):
        assert rows.get(f"sparse:{kind}", 0) > 0, rows
    # ... and the requests' log lines say so.
    lines = [x for x in run["log"].splitlines() if "Stem prefill of request" in x]
    for kind in ("continuation", "prefix hit"):
        assert any(re.search(rf"rows sparse \([^)]*{kind} [1-9]", x) for x in lines), lines
    if _auto_kernel("bfloat16") == "stem":  # the kernel packs the amx pages itself
        assert run["log"].count("Stem rows run Stem's block-sparse kernel on keys and values "
                                "it packs straight from vLLM's amx cache pages") == 1
    # The long prompts' tokens on the amx layout: not yet measured on a CPU with AMX.
    assert assert_close_tokens(run, plain(model, BF16), long_prompts=False)


@pytest.mark.parametrize("decoded, speculative", [
    ("read_back", False), ("read_back", True), ("write", False), ("write", True)],
    ids=["read-back", "read-back-speculative", "staged", "speculative"])
def test_the_decoded_pages_are_usable_at_the_next_turn(model, decoded, speculative):
    """A chat's first turn decodes 120 tokens with prefix caching; its second
    turn hits the pages the first decoded, and its rows run Stem on them (no
    row finds its pages incomplete), each equal to ``stem_attention`` on the
    keys vLLM wrote.

    * ``decoded_pages="read_back"`` (the default): decode steps write nothing
      to the indexer cache; the pages they filled are rebuilt from vLLM's
      cache when the second turn's rows read them, with or without ngram
      speculative decoding (whose rejected drafts never reach vLLM's cache
      for good).
    * ``"write"``, plain decoding: the decode steps' writes are staged and
      carried out for every layer at once, at the next step's first write.
    * ``"write"``, ngram speculative decoding, many drafts rejected: the
      drafts are held back a step and only the accepted ones reach the
      indexer cache."""
    rng = random.Random(3)
    motif = [rng.randrange(3, 512) for _ in range(40)]
    # The tiny model soon repeats token 221; ngram then proposes "17 18 19" from
    # the prompt's traps, which the model rejects.
    trap = [221, 221, 221, 17, 18, 19]
    first = [{"prompt": motif * 40 + trap * 20, "max_tokens": 120}]
    follow = {"of": 0, "answer_tokens": 100, "max_tokens": 4,
              "extra": [rng.randrange(3, 512) for _ in range(300)]}
    engine = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_max": 4, "prompt_lookup_min": 2}
              } if speculative else {}
    run = run_engine(model, {**SPARSE, "decoded_pages": decoded}, engine=engine,
                     check_rows=True, batches=[first], follow_up=follow)
    stats = run["stats"]
    held, staged, read_back = stats["held"], stats["staged"], stats["read_back"]
    if decoded == "read_back":
        # The pages the first turn's decode filled (about 120 tokens: at least
        # 3 of 32 tokens), rebuilt in both layers; no decode step writes: the
        # steps staged are the first turn's prefill chunks (97 tokens a step).
        assert read_back.get("pages", 0) >= 2 * 3, read_back
        assert staged.get("steps", 0) <= -(-len(first[0]["prompt"]) // 97), staged
        assert not held, held
    elif speculative:
        # Beyond the last step's 4 tokens (held when the request ended), drafts
        # were rejected along the way; held steps are never staged.
        assert held.get("dropped", 0) > 4 and held.get("written", 0) > 0, held
        assert not staged and not read_back, (staged, read_back)
    else:  # every decode step but the last, both layers at once
        assert staged["steps"] >= 118 and staged["layers"] == 2 * staged["steps"], staged
        assert not held and not read_back, (held, read_back)
    rows = stats["rows"]
    assert rows.get("sparse:prefix hit", 0) > 0, rows
    assert not rows.get("dense:indexer cache incomplete"), rows
    rec = run["record"]
    assert rec["selection_mismatches"] == 0 and rec["cache_mismatches"] == 0, rec
    assert rec["max_error"] < 1e-5, rec


# The long prompts' sparse rows move the logits a little: their greedy tokens
# were vLLM's, each chosen token's log-probability at most 0.033 apart in
# float32 and 0.031 in bfloat16 (vec layout), on this file's prompts; the
# bound keeps a 3x margin.
LONG_LOGPROB_TOL = 0.1


def assert_close_tokens(run: dict, want: dict, *, long_prompts: bool = True) -> bool:
    """Greedy continuations of a sparse run against vLLM's: the short
    prompts (every row vLLM's kernel) token for token; with ``long_prompts``
    the long ones (sparse rows) token for token too, each chosen token's
    log-probability within ``LONG_LOGPROB_TOL`` of vLLM's."""
    assert len(run["outputs"]) == len(want["outputs"]) == 4
    for x, y in zip(run["outputs"][:2], want["outputs"][:2]):
        assert x["tokens"] == y["tokens"]
    if long_prompts:
        for x, y in zip(run["outputs"][2:], want["outputs"][2:]):
            assert x["tokens"] == y["tokens"]
            worst = max(abs(a - b) for a, b in zip(x["logprobs"], y["logprobs"]))
            assert worst <= LONG_LOGPROB_TOL, worst
    return True


# --------------------------------------------------------------------------- #
# Failures: the engine never dies of Stem
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("where, counted", [
    ("select", "dense:error:RuntimeError"),
    ("write", "dense:error:RuntimeError"),
    ("stage", None),
    ("hook", "dense:error:RuntimeError"),
    ("plan", "dense:error:RuntimeError"),
    ("reason", "dense:error:RuntimeError"),
    ("complete", "dense:error:RuntimeError"),
    ("allocate", "dense:error:RuntimeError"),
    ("count", None),
])
def test_a_stem_failure_runs_vllms_kernel_and_is_counted(model, where, counted):
    """Stem raises, from the engine's start on, at one place of the plugin:
    a row's selection, the indexer-cache write (at once, or staged for every
    layer of a step without Stem rows, here decode steps with
    ``decoded_pages="write"``), the step hook, the metadata builder's plan,
    the checks atop ``forward`` and the cache write, the indexer cache's
    check, its allocation (never retried), or the counting of a layer's
    rows. The engine answers exactly as vLLM's own backend (after a staged
    write, as without the failure: no row reads the decoded pages it leaves
    unusable), counts the rows (where counting itself works), and logs each
    failure once with its traceback. A failed write leaves its pages to be
    read back from vLLM's cache, which writes them too: that fails likewise,
    and the rows over them run vLLM's kernel."""
    stem = {**SPARSE, "dense_above": 1.0}
    if where == "stage":
        stem["decoded_pages"] = "write"
    run = run_engine(model, stem, fail=(where, 0))
    if where == "stage":  # only the decoded tokens' pages are lost; no row here reads them
        assert run["outputs"] == run_engine(model, stem)["outputs"]
    else:
        assert run["outputs"] == plain(model)["outputs"]
    rows = run["stats"]["rows"]
    if counted:
        assert rows.get(counted, 0) > 0, rows
        assert not any(k.startswith("sparse") for k in rows), rows
    if where in ("write", "stage"):
        assert rows.get("dense:error:RuntimeError", 0) > 0, rows
    warnings = [x for x in run["log"].splitlines()
                if "Stem" in x and f"(injected {where} failure)" in x]
    assert warnings and len(warnings) == len(set(x.split("(injected")[0] for x in warnings)), \
        warnings  # each place says so once
    assert "Traceback" in run["log"] and f"RuntimeError: injected {where} failure" in run["log"]
    if where == "allocate":  # tried once per layer at start-up, then never again
        assert run["failure_calls"] == 2, run["failure_calls"]


# --------------------------------------------------------------------------- #
# Settings
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("stem, key", [({"preset": "fast"}, "preset"),
                                       ({"stem_block_size": 48}, "stem_block_size"),
                                       ({"dense_above": 2}, "dense_above"),
                                       ({"windows": 4}, "'windows'")])
def test_bad_settings_stop_the_engine_naming_the_key(model, stem, key):
    code = ("import json, sys\n"
            "from vllm.engine.arg_utils import EngineArgs\n"
            "try:\n"
            "    EngineArgs(model=sys.argv[1], attention_backend='CUSTOM', block_size=32,"
            " additional_config={'stem': json.loads(sys.argv[2])}).create_engine_config()\n"
            "except Exception as exc:\n"
            "    print('ERROR', str(exc).replace(chr(10), ' '))\n")
    proc = subprocess.run([sys.executable, "-c", code, model, json.dumps(stem)],
                          capture_output=True, text=True, timeout=300)
    line = [x for x in proc.stdout.splitlines() if x.startswith("ERROR")]
    assert line, proc.stderr[-2000:]
    # vLLM's configuration is a pydantic model: the message comes wrapped in its
    # ValidationError ("1 validation error for VllmConfig ... Value error, ...").
    assert f"additional_config['stem']: {key}" in line[0], line[0]


def test_registration_is_idempotent_and_leaves_a_foreign_backend(caplog):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    import stem_indexer.integrations.vllm as stem_vllm

    custom = AttentionBackendEnum.CUSTOM
    before = custom.get_path() if custom.is_overridden() else None
    try:
        custom.clear_override()
        stem_vllm.register()
        stem_vllm.register()
        assert custom.get_path() == stem_vllm.BACKEND_PATH
        register_backend(custom, "other_package.Backend")
        with caplog.at_level("WARNING", logger="vllm.stem_indexer"):
            stem_vllm.register()
        assert custom.get_path() == "other_package.Backend"
        assert "already registered by another package" in caplog.text
    finally:
        custom.clear_override()
        if before:
            register_backend(custom, before)


def _registered_by_stem() -> bool:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import stem_indexer.integrations.vllm as stem_vllm

    custom = AttentionBackendEnum.CUSTOM
    return custom.is_overridden() and custom.get_path() == stem_vllm.BACKEND_PATH


@pytest.fixture
def fresh_registration(monkeypatch):
    """CUSTOM unregistered and the plugin's warnings not yet given; both as
    they were after the test."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    import stem_indexer.integrations.vllm as stem_vllm

    custom = AttentionBackendEnum.CUSTOM
    before = custom.get_path() if custom.is_overridden() else None
    custom.clear_override()
    monkeypatch.setattr(stem_vllm, "_WARNED", set())
    stem_vllm.patches = sys.modules["stem_indexer.integrations.vllm.patches"]
    yield stem_vllm
    custom.clear_override()
    if before:
        register_backend(custom, before)


def test_an_untested_vllm_release_is_left_alone_unless_asked(fresh_registration, monkeypatch,
                                                              caplog):
    """On a vLLM release it was not tested with, ``register()`` warns once and
    patches nothing (the platform's methods stay vLLM's); with
    ``STEM_VLLM_ALLOW_UNTESTED=1`` it registers."""
    import vllm
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(vllm, "__version__", "9.9.9")
    monkeypatch.delenv(fresh_registration.patches.UNTESTED_ENV, raising=False)
    methods = {name: CpuPlatform.__dict__[name] for name in
               ("get_attn_backend_cls", "check_and_update_config")}
    for name, method in methods.items():  # vLLM's own, whatever earlier tests did
        original = getattr(method.__func__, "__wrapped__", method.__func__)
        monkeypatch.setattr(CpuPlatform, name, classmethod(original))
    with caplog.at_level("WARNING", logger="vllm.stem_indexer"):
        fresh_registration.register()
        fresh_registration.register()
    warned = [r for r in caplog.records if "not 9.9.9" in r.getMessage()]
    assert len(warned) == 1 and fresh_registration.TESTED_VLLM in warned[0].getMessage()
    assert "is not registered" in warned[0].getMessage()
    assert not _registered_by_stem()
    assert not getattr(CpuPlatform.get_attn_backend_cls.__func__, "_stem", False)

    monkeypatch.setenv(fresh_registration.patches.UNTESTED_ENV, "1")
    monkeypatch.setattr(fresh_registration, "_WARNED", set())
    fresh_registration.register()
    assert _registered_by_stem()  # CUSTOM reaches Stem when asked for


def test_patches_fall_back_to_vllm_on_changed_signatures(monkeypatch, caplog):
    """A vLLM whose platform methods take other arguments, or whose
    configuration renamed a field: the wrappers pass every argument through,
    and where Stem's part fails they warn once and return vLLM's own
    result; nothing raises."""
    from types import SimpleNamespace

    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import stem_indexer.integrations.vllm as stem_vllm
    from stem_indexer.integrations.vllm import patches

    seen = []

    def select(cls, selected_backend, attn_selector_config, num_heads=None, *, new_arg=0):
        seen.append(("select", new_arg))
        return "vllm.own.Backend"

    def check(cls, vllm_config, new_arg=0):
        seen.append(("check", new_arg))

    monkeypatch.setattr(CpuPlatform, "get_attn_backend_cls", classmethod(select))
    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(check))
    monkeypatch.setattr(patches, "_WARNED", set())
    patches.patch_platform(lambda chosen: chosen == "ours", stem_vllm.BACKEND_PATH)
    config = SimpleNamespace(use_mla=False, use_sparse=False)
    with caplog.at_level("WARNING", logger="vllm.stem_indexer"):
        assert CpuPlatform.get_attn_backend_cls("ours", config, 4, new_arg=1) \
            == stem_vllm.BACKEND_PATH
        assert CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, config,
                                                new_arg=2) == "vllm.own.Backend"
        # A selector config without the fields Stem reads: vLLM's choice.
        assert CpuPlatform.get_attn_backend_cls("ours", object(), new_arg=3) \
            == "vllm.own.Backend"
        # A configuration whose attention settings moved: checked by vLLM only.
        CpuPlatform.check_and_update_config(SimpleNamespace(), new_arg=4)
        CpuPlatform.check_and_update_config(vllm_config=SimpleNamespace(), new_arg=5)
    assert seen == [("select", 2), ("select", 3), ("check", 4), ("check", 5)]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("could not read vLLM's backend selection" in m for m in messages) == 1
    assert sum("could not read vLLM's configuration" in m for m in messages) == 1


def test_on_another_platform_nothing_is_registered(fresh_registration, monkeypatch, caplog):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    with caplog.at_level("WARNING", logger="vllm.stem_indexer"):
        fresh_registration.register()
        fresh_registration.register()
    assert not _registered_by_stem()
    warned = [r for r in caplog.records if "serves the CPU platform" in r.getMessage()]
    assert len(warned) == 1


def test_registration_never_raises(fresh_registration, monkeypatch, caplog):
    from vllm.v1.attention.backends import registry

    def broken(*args, **kwargs):
        raise RuntimeError("registry changed")

    monkeypatch.setattr(registry, "register_backend", broken)
    with caplog.at_level("WARNING", logger="vllm.stem_indexer"):
        fresh_registration.register()
    assert not _registered_by_stem()
    assert "could not be registered (registry changed)" in caplog.text


# --------------------------------------------------------------------------- #
# The OpenAI-compatible server
# --------------------------------------------------------------------------- #


def test_server_streams_a_completion_with_stem(model, tmp_path):
    from vllm_serve_bench import ServerProcess

    server = ServerProcess(["--model", model, "--dtype", "float32", "--block-size", str(BLOCK),
                            "--max-model-len", "4096", "--attention-backend", "CUSTOM",
                            "--additional-config", json.dumps({"stem": SPARSE})],
                           tmp_path / "server.log",
                           {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, seconds=300)
    port = server.port
    try:
        rng = random.Random(2)
        prompt = " ".join(f"t{rng.randrange(3, 512)}" for _ in range(2500))
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 5,
                           "temperature": 0, "stream": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            events = [x.decode().strip() for x in resp if x.strip()]
        chunks = [json.loads(e[len("data: "):]) for e in events
                  if e.startswith("data: ") and e != "data: [DONE]"]
        assert events[-1] == "data: [DONE]"
        assert len(chunks) >= 2 and any(c["choices"][0]["text"] for c in chunks)
        deadline = time.time() + 30
        while "Stem prefill of request" not in (tmp_path / "server.log").read_text():
            assert time.time() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        assert "Using Stem sparse-prefill attention" in (tmp_path / "server.log").read_text()
    finally:
        server.stop()


# --------------------------------------------------------------------------- #
# The README's "Serve with vLLM" example on the converted SmolLM2 (--run-model)
# --------------------------------------------------------------------------- #


@pytest.mark.model
def test_readme_serving_example_runs(tmp_path):
    """The README's Python example (its ``py`` block) as written, on the model
    ``benchmarks/engines/vllm_bench.py convert`` makes (converted here if absent)."""
    import re

    readme = (HERE.parent / "README.md").read_text()
    section = readme.split("## Serve with vLLM", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```py\n(.*?)```", section, flags=re.S)
    model = Path.home() / ".cache" / "stem_indexer" / "smollm2-135m-yarn4"
    if not (model / "config.json").exists():
        convert = HERE.parent / "benchmarks" / "engines" / "vllm_bench.py"
        subprocess.run([sys.executable, str(convert), "convert"], check=True, timeout=900)
    script = tmp_path / "serve_example.py"
    script.write_text(block)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "sparse:" in last and "density" in last, last
