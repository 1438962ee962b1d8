"""Quality evaluation (``testing.quality``, ``benchmarks/quality/quality.py``) and the block map
(``stem-indexer plot``)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import quality as quality_bench
from stem_indexer import stem_indexer
from stem_indexer.operator import contract
from stem_indexer.surfaces import cli
from stem_indexer.testing import quality as evaluate
from stem_indexer.surfaces.plot import BlockKind, block_kind_counts, classify_blocks

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- #
# Classification of kept blocks
# --------------------------------------------------------------------------- #


def test_classify_blocks_by_hand():
    # 3 query blocks, 5 key blocks, causal: s2 = 3, 4, 5. One sink, one window.
    N, S, K, W, T = (int(BlockKind.INVISIBLE), int(BlockKind.SKIPPED), int(BlockKind.SINK),
                     int(BlockKind.WINDOW), int(BlockKind.TOPK))
    indices = torch.full((1, 1, 3, 5), -1, dtype=torch.int32)
    indices[0, 0, 0, :3] = torch.tensor([0, 1, 2])      # sink, top-k, window
    indices[0, 0, 1, :3] = torch.tensor([0, 2, 3])      # sink, top-k, window (1 skipped)
    indices[0, 0, 2, :2] = torch.tensor([0, 4])         # sink, window (1..3 skipped)
    seq_len = torch.tensor([[[3, 3, 2]]], dtype=torch.int32)
    kinds = classify_blocks(indices, seq_len, q_len=12, kv_len=20, block_size=4,
                            initial_blocks=1, window_size=1)
    assert kinds.tolist() == [[K, T, W, N, N],
                              [K, S, T, W, N],
                              [K, S, S, S, W]]
    assert block_kind_counts(kinds) == {"invisible": 3, "skipped": 4, "sink": 3, "window": 3,
                                        "topk": 2}


def test_classify_blocks_counts_match_the_contract():
    torch.manual_seed(0)
    b, nq, nk, bs, ts, d = 2, 4, 2, 8, 2, 4
    q_lens = torch.tensor([150, 61], dtype=torch.int32)     # tails: 19 and 8 query blocks
    kv_lens = torch.tensor([470, 61], dtype=torch.int32)    # 59 and 8 key blocks
    qflat = torch.randn(b, nq, 19, ts * d).to(torch.bfloat16)
    kflat = torch.randn(b, nk, 59, ts * d).to(torch.bfloat16)
    vbias = torch.rand(b, nk, 59)
    params = dict(causal=True, initial_blocks=3, window_size=2)
    indices, seq_len = stem_indexer(qflat, kflat, vbias, q_lens, kv_lens, stem_block_size=bs,
                                    stem_stride=ts, alpha=0.5, k_block_num_bias_medium=4,
                                    k_block_num_rate_medium=0.1, **params)
    for batch in range(b):
        qb = contract.ceil_div(int(q_lens[batch]), bs)
        kb = contract.ceil_div(int(kv_lens[batch]), bs)
        s2 = contract.visible_blocks(torch.arange(qb), qb, kb, True)
        sink_end, cand_end = contract.candidate_range(s2, 3, 2)
        for head in range(nq):
            kinds = classify_blocks(indices, seq_len, batch=batch, head=head,
                                    q_len=int(q_lens[batch]), kv_len=int(kv_lens[batch]),
                                    block_size=bs, **params)
            assert kinds.shape == (qb, kb)
            per_row = [{k: int((row == int(k)).sum()) for k in BlockKind} for row in kinds]
            kept = seq_len[batch, head, :qb].tolist()
            for i, row in enumerate(per_row):
                assert row[BlockKind.SINK] == int(sink_end[i])
                assert row[BlockKind.WINDOW] == int(s2[i] - cand_end[i])
                forced = int(sink_end[i] + s2[i] - cand_end[i])
                assert row[BlockKind.TOPK] == kept[i] - forced
                assert row[BlockKind.INVISIBLE] == kb - int(s2[i])
    # The budget really bit: some visible blocks were skipped.
    assert block_kind_counts(classify_blocks(indices, seq_len, q_len=150, kv_len=470,
                                             block_size=bs, **params))["skipped"] > 0


def test_classify_blocks_rejects_bad_input():
    indices = torch.tensor([[[[0, 3, -1, -1]]]], dtype=torch.int32)  # 3 is not visible
    seq_len = torch.tensor([[[2]]], dtype=torch.int32)
    with pytest.raises(ValueError, match="sparse_indices row 0 keeps block 3"):
        classify_blocks(indices, seq_len, q_len=4, kv_len=12, block_size=4)
    with pytest.raises(ValueError, match="head must be in"):
        classify_blocks(indices, seq_len, head=1, q_len=4, kv_len=12, block_size=4)
    with pytest.raises(ValueError, match="sparse_seq_len must have shape"):
        classify_blocks(indices, seq_len[0], q_len=4, kv_len=12, block_size=4)
    with pytest.raises(ValueError, match="kv_len must be in"):
        classify_blocks(indices, seq_len, q_len=4, kv_len=40, block_size=4)


# --------------------------------------------------------------------------- #
# Pictures
# --------------------------------------------------------------------------- #


def test_plot_block_map_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from stem_indexer.surfaces.plot import plot_block_map

    torch.manual_seed(1)
    qflat = torch.randn(1, 2, 6, 8).to(torch.bfloat16)
    kflat = torch.randn(1, 1, 20, 8).to(torch.bfloat16)
    lens = dict(q_seq_lens=torch.tensor([24], dtype=torch.int32),
                kv_seq_lens=torch.tensor([80], dtype=torch.int32))
    indices, seq_len = stem_indexer(qflat, kflat, torch.zeros(1, 1, 20), **lens,
                                    stem_block_size=4, stem_stride=2, alpha=0.3,
                                    window_size=2, initial_blocks=2)
    path = tmp_path / "map.png"
    counts = plot_block_map(indices, seq_len, head=1, q_len=24, kv_len=80, block_size=4,
                            initial_blocks=2, window_size=2, path=path)
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert counts == block_kind_counts(classify_blocks(
        indices, seq_len, head=1, q_len=24, kv_len=80, block_size=4, initial_blocks=2,
        window_size=2))


@pytest.mark.parametrize("source", ["random", "synthetic"])
def test_cli_plot(tmp_path, capsys, source):
    pytest.importorskip("matplotlib")
    out = tmp_path / "map.png"
    argv = ["plot", "--source", source, "--q-blocks", "24", "--kv-blocks", "24",
            "--block-size", "16", "--stride", "4", "--head", "1", "--preset", "default",
            "--out", str(out)]
    assert cli.main(argv) == 0
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    printed = capsys.readouterr().out
    assert f"wrote {out}: batch 0, head 1" in printed
    # 24 query blocks over 24 key blocks: 300 visible pairs, all kept (P < 56).
    assert "of 300 visible" in printed and "kept 300 block pairs" in printed


def test_cli_plot_reports_bad_arguments(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    argv = ["plot", "--source", "random", "--q-blocks", "2", "--kv-blocks", "4",
            "--block-size", "8", "--stride", "4", "--head", "64", "--out", str(tmp_path / "x.png")]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "head must be in [0, 64) for the random source" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_plot_default_shows_a_sparse_selection(tmp_path, capsys):
    """The default picture is a real selection: well under half of the pairs kept."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "map.png"
    assert cli.main(["plot", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    kept, visible = (int(x) for x in re.search(r"kept (\d+) block pairs .* of (\d+) visible",
                                               printed).groups())
    assert visible == 128 * 129 // 2 and kept < 0.5 * visible


# --------------------------------------------------------------------------- #
# Quality measurement
# --------------------------------------------------------------------------- #

# 1024 tokens in 64 blocks of 16: enough blocks (>= 56) for the P/8 budget to bite.
SMALL = dict(seq_len=1024, block_size=16, stride=4)
KEEP_ALL = evaluate.Budget("all", 0.0, 10_000, 0.0, 10_000)


@pytest.fixture(scope="module")
def synthetic():
    return evaluate.synthetic_workload(**SMALL)


def test_keeping_every_block_measures_as_dense(synthetic):
    (row,) = evaluate.evaluate([synthetic], [evaluate.EvalConfig(budget=KEEP_ALL)])
    assert row.density == 1.0
    assert row.mass_recall == pytest.approx(1.0, abs=1e-5)
    assert row.rel_l2 < 1e-5
    assert row.attention_needle_recall == 1.0 and row.value_needle_recall == 1.0


def test_density_and_mass_recall_follow_the_selection(synthetic):
    config = evaluate.EvalConfig(alpha=0.5)
    indices, seq_len = evaluate.select_blocks(synthetic, config)
    probs, dense_out = evaluate.dense_probs(synthetic.q, synthetic.k, synthetic.v,
                                                synthetic.scale)
    row = evaluate.measure(synthetic, config, indices, seq_len, probs, dense_out)
    # Density from the contract: every row keeps its forced blocks plus its budget.
    nb = 64
    i = torch.arange(nb)
    s2 = contract.visible_blocks(i, nb, nb, True)
    sink_end, cand_end = contract.candidate_range(s2, 4, 4)
    params = contract.IndexerParams(alpha=0.5, **{
        k: v for k, v in config.budget.kwargs().items()})
    ks = contract.prompt_budget(torch.tensor(nb), params)
    budget = contract.row_budget(i, torch.tensor(nb), ks, 0.5)
    kept = sink_end + (s2 - cand_end) + torch.minimum(budget, cand_end - sink_end)
    assert row.density == pytest.approx(float(kept.sum()) / float(s2.sum()))
    assert 0.1 < row.density < 0.6
    # Mass recall by a plain loop over a few query tokens.
    for h, t in [(0, 1000), (3, 700), (2, 37)]:
        blocks = indices[0, h, t // 16, : seq_len[0, h, t // 16]].tolist()
        mass = sum(float(probs[0, h, t, j * 16:(j + 1) * 16].sum()) for j in blocks)
        assert 0.0 < mass <= 1.0 + 1e-6
    assert row.density < row.mass_recall < 1.0
    assert 0.0 < row.rel_l2 < 1.0
    # The sparse output is block-sparse attention's, checked against dense here.
    assert row.max_abs > 0


@pytest.mark.slow
def test_default_table_has_every_configuration(synthetic):
    rows = evaluate.evaluate([synthetic])
    seen = {(r.config.budget.name, r.config.oam, r.config.alpha) for r in rows}
    assert {("P/8", oam, a) for oam in (True, False) for a in (1.0, 0.7, 0.5)} <= seen
    assert ("default", True, 1.0) in seen
    table = quality_bench.markdown_table(rows)
    assert table.count("\n") == len(rows) + 1
    assert "| synthetic | P/8 | off | 0.7 |" in table
    # Fewer blocks at a lower alpha, for both OAM settings.
    by = {(r.config.budget.name, r.config.oam, r.config.alpha): r for r in rows}
    for oam in (True, False):
        assert by["P/8", oam, 0.5].density < by["P/8", oam, 1.0].density


def test_llama_workload_captures_one_layer():
    pytest.importorskip("transformers")
    import transformers

    work = evaluate.llama_workload(seq_len=256, block_size=16, stride=4)
    assert work.q.shape == (1, 4, 256, 16) and work.k.shape == work.v.shape == (1, 2, 256, 16)
    assert work.scale == pytest.approx(16 ** -0.5)
    assert "stem-indexer-eval-capture" not in transformers.AttentionInterface._global_mapping


def test_cli_eval_prints_and_records(tmp_path, capsys):
    record = tmp_path / "QUALITY.md"
    record.write_text("# Written by hand\n")  # recording appends: this stays
    argv = ["--seq-len", "1024", "--block-size", "16", "--stride", "4", "--no-llama",
            "--record", str(record)]
    assert quality_bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| synthetic | P/8 | on | 1 |" in printed
    text = record.read_text()
    assert ("`python benchmarks/quality/quality.py --seq-len 1024 --block-size 16 --stride 4 "
            "--no-llama") in text
    assert "torch " + torch.__version__ in text and "- git: " in text
    assert "| synthetic | default | on | 1 |" in text
    assert text.startswith("# Written by hand\n\n## Selection quality on synthetic attention")


def test_cli_eval_reports_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        quality_bench.main(["--seq-len", "1000", "--block-size", "16", "--no-llama"])
    assert exc.value.code == 2
    assert "seq_len must be a multiple of block_size" in capsys.readouterr().err


def test_eval_config_is_hashable_and_frozen():
    config = evaluate.EvalConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.alpha = 0.5  # type: ignore[misc]
    assert len({config, evaluate.EvalConfig()}) == 1
