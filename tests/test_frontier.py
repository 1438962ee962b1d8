"""benchmarks/engines/frontier.py: settings are named and checked, a part runs only the cells
the results file lacks, the tables judge "at dense's accuracy" as their legend says (against
hand-computed rates, perplexities and speed-ups), and the oracle's attention masses are the
exact ones (uniform and one-hot attention, computed by hand)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import frontier as fr
from stem_indexer import StemIndexerInputError


# --------------------------------------------------------------------------- #
# Settings
# --------------------------------------------------------------------------- #


def test_a_setting_is_a_preset_with_overrides():
    assert fr.parse_setting("vllm") is None
    assert fr.parse_setting("tight") == {"preset": "tight"}
    assert fr.parse_setting("tight+exact_tail=0+oam=false") == {
        "preset": "tight", "exact_tail": 0, "oam": False}
    assert fr.parse_setting("balanced+k_block_num_bias_large=24") == {
        "preset": "balanced", "k_block_num_bias_large": 24}


def test_settings_split_on_commas_outside_json_values():
    text = ('default,default+layer_budgets={"0 3-10":{"alpha":1,"k_block_num_rate_large":0.3},'
            '"20":"tight"}, balanced+exact_tail=0,')
    names = fr.split_settings(text)
    assert names == ['default', 'default+layer_budgets={"0 3-10":{"alpha":1,'
                     '"k_block_num_rate_large":0.3},"20":"tight"}', 'balanced+exact_tail=0']
    assert fr.parse_setting(names[1]) == {"preset": "default", "layer_budgets": {
        "0 3-10": {"alpha": 1, "k_block_num_rate_large": 0.3}, "20": "tight"}}


def test_a_plot_label_is_the_setting_shortened():
    assert fr.short_setting("vllm") == "vllm"
    assert fr.short_setting("balanced+k_block_num_bias_large=24+oam=false") == (
        "balanced+bias_large=24+oam=false")
    assert fr.short_setting('default+layer_budgets={"3-10":{"k_block_num_rate_large":1.0},'
                            '"20 22":"tight"}') == "default+L3-10:rate_large=1.0+L20 22:tight"


def test_the_layers_the_indexer_misses_are_those_past_the_margin():
    # (picked, oracle): misses of 0.01, 0.12, 0.04, 0.2 and 0
    per_layer = {"0": (0.86, 0.87), "3": (0.85, 0.97), "4": (0.90, 0.94), "10": (0.7, 0.9),
                 "12": (1.0, 1.0)}
    assert fr.missed_layers(per_layer, 0.05) == [3, 10]
    assert fr.missed_layers(per_layer, 0.0) == [0, 3, 4, 10]
    assert fr.missed_layers(per_layer, 0.5) == []


@pytest.mark.parametrize("name, words", [
    ("loose", "preset"),                      # no such preset
    ("tight+exact_tail", "KEY=VALUE"),        # no value
    ("tight+exact_tail=zero", "JSON"),        # not a JSON value
    ("tight+no_such_key=1", "no_such_key"),   # not a Stem setting
    ("tight+exact_tail=-1", "exact_tail"),    # a setting's own rule
])
def test_a_bad_setting_is_refused_by_name(name, words):
    with pytest.raises(StemIndexerInputError, match=words):
        fr.parse_setting(name)


# --------------------------------------------------------------------------- #
# Parts
# --------------------------------------------------------------------------- #


def _row(setting, task, trial, nominal=16384, model="smollm2", **extra):
    return dict(model=model, nominal=nominal, setting=setting, task=task, trial=trial, **extra)


def test_a_part_runs_only_missing_cells_and_reruns_the_reference_for_timing():
    done = [_row("vllm", "passkey", 0), _row("tight", "passkey", 0),
            _row("vllm", "passkey", 1),
            _row("vllm", "perplexity", 0)]
    trials = {"perplexity": 1, "passkey": 2, "multikey": 1}
    plan = fr.todo(done, "smollm2", [16384], trials, ["vllm", "tight", "default"])
    assert plan == [
        # perplexity first; its reference is not rerun (perplexity is not timed)
        (16384, "perplexity", 0, ["tight", "default"]),
        # vLLM's backend reruns its trial beside the settings that lack it
        (16384, "passkey", 0, ["vllm", "default"]),
        (16384, "multikey", 0, ["vllm", "tight", "default"]),
        (16384, "passkey", 1, ["vllm", "tight", "default"]),
    ]
    # another model's or length's cells do not count as done
    assert len(fr.todo(done, "gemma3", [16384], trials, ["vllm"])) == 4
    everything = done + [_row(s, t, i) for s in ("tight", "default")
                         for t, i in (("perplexity", 0), ("passkey", 0), ("passkey", 1),
                                      ("multikey", 0))] + [_row("vllm", "multikey", 0)]
    assert fr.todo(everything, "smollm2", [16384], trials, ["vllm", "tight", "default"]) == []


def test_trial_orders_rotate():
    names = ["vllm", "a", "b"]
    assert [fr.rotate(names, t)[0] for t in range(4)] == ["vllm", "a", "b", "vllm"]


def test_trials_argument():
    assert fr.parse_trials("passkey=20,perplexity=2") == {"passkey": 20, "perplexity": 2}
    with pytest.raises(SystemExit, match="TASK=N"):
        fr.parse_trials("needle=3")


class _Logprob(SimpleNamespace):
    pass


def test_perplexity_of_a_window_from_prompt_logprobs():
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    # position p's prompt token has log-probability -p/10; the top token is
    # the prompt's own at even positions, token 0 at odd ones
    logprobs = [None]
    for p in range(1, len(ids)):
        entry = {ids[p]: _Logprob(logprob=-p / 10, rank=1 if p % 2 == 0 else 2)}
        if p % 2:
            entry[0] = _Logprob(logprob=-0.01, rank=1)
        logprobs.append(entry)
    row = fr.perplexity_row(logprobs, ids)
    assert row["tokens"] == 7 and row["nll"] == pytest.approx(sum(range(1, 8)) / 10)
    assert row["tail_tokens"] == 2 and row["tail_nll"] == pytest.approx((6 + 7) / 10)
    assert row["greedy"] == [0, 7, 0, 9, 0, 11, 0]


# --------------------------------------------------------------------------- #
# Tables
# --------------------------------------------------------------------------- #


def _ppl_row(setting, ppl, tail_ppl, trial=0, greedy=(1, 2, 3, 4), seconds=100.0):
    return _row(setting, "perplexity", trial, nll=1000 * math.log(ppl), tokens=1000,
                tail_nll=250 * math.log(tail_ppl), tail_tokens=250, greedy=list(greedy),
                seconds=seconds)


def _hits(setting, task, found, run="r1", ttft=None):
    return [_row(setting, task, t, found=f, run=run, ttft=ttft[t] if ttft else None,
                 depth=t / 10) for t, f in enumerate(found)]


def _results(tight_ppl=10.05, tight_found=9):
    rows = [_ppl_row("vllm", 10.0, 20.0),
            _ppl_row("tight", tight_ppl, 21.0, greedy=(1, 2, 0, 4), seconds=40.0)]
    rows += _hits("vllm", "passkey", [True] * 10, ttft=[10.0] * 10)
    rows += _hits("tight", "passkey", [True] * tight_found + [False] * (10 - tight_found),
                  ttft=[4.0] * 5 + [5.0] * 5)
    rows += _hits("vllm", "multikey", [True] * 5 + [False] * 5)
    rows += _hits("tight", "multikey", [True] * 4 + [False] * 6)
    return rows


def test_the_summary_is_the_hand_computed_one():
    entries = {e["setting"]: e for e in fr.summary(_results())}
    tight = entries["tight"]
    assert tight["passkey"] == (9, 10) and tight["multikey"] == (4, 10)
    assert tight["ppl"] == pytest.approx(10.05)
    assert tight["ppl_change"] == pytest.approx(0.005)
    assert tight["tail_change"] == pytest.approx(0.05)
    assert tight["agreement"] == pytest.approx(3 / 1000)
    assert tight["ppl_speedup"] == pytest.approx(2.5)  # 100 s / 40 s
    assert sorted(tight["speedup"]) == [2.0] * 5 + [2.5] * 5
    assert tight["missed_at"] == [0.9]  # trial 9's passkey
    # 9/10 lies inside 10/10's Wilson interval [72%, 100%], 4/10 inside 5/10's
    # [24%, 76%], and +0.5% perplexity is within +1%
    assert tight["accurate"] is True
    assert entries["vllm"]["accurate"] is True


@pytest.mark.parametrize("change, reason", [
    (dict(tight_ppl=10.2), "perplexity +2%"),
    (dict(tight_found=6), "6/10 passkeys, below 10/10's interval (72%)"),
])
def test_a_setting_off_dense_accuracy_is_marked(change, reason):
    entries = {e["setting"]: e for e in fr.summary(_results(**change))}
    assert entries["tight"]["accurate"] is False, reason


def test_a_rerun_of_the_reference_counts_once_and_times_only_its_run():
    rows = _results()
    # a second run: vLLM's backend reruns passkey trial 0 (missed this time)
    # beside a new setting; that trial still counts once for vLLM's accuracy
    rows += [_row("vllm", "passkey", 0, found=False, run="r2", ttft=12.0),
             _row("default", "passkey", 0, found=True, run="r2", ttft=8.0),
             _row("balanced", "passkey", 0, found=True, run="r3", ttft=8.0)]
    entries = {e["setting"]: e for e in fr.summary(rows)}
    assert entries["vllm"]["passkey"] == (10, 10)
    assert entries["default"]["speedup"] == [1.5]  # 12 / 8, the same run's
    assert entries["balanced"]["speedup"] == []  # no reference in its run
    assert entries["default"]["accurate"] is None  # no perplexity measured


def test_openvino_settings_run_retrieval_only_and_are_timed_against_both_dense_engines():
    assert fr.parse_setting("ov-xattn-t09") is None  # not a Stem setting: a peer's
    trials = {"perplexity": 1, "passkey": 1}
    plan = fr.todo([], "smollm2", [16384], trials, ["vllm", "ov-dense", "ov-xattn"])
    # the pipeline gives no prompt log-probabilities: no perplexity cell
    assert plan == [(16384, "perplexity", 0, ["vllm"]),
                    (16384, "passkey", 0, ["vllm", "ov-dense", "ov-xattn"])]
    rows = _results()
    rows += _hits("ov-dense", "passkey", [True] * 10, ttft=[5.0] * 10)
    rows += _hits("ov-xattn", "passkey", [True] * 6 + [False] * 4, ttft=[2.0] * 10)
    rows += _hits("ov-xattn", "multikey", [True] * 5 + [False] * 5)
    entries = {e["setting"]: e for e in fr.summary(rows)}
    xattn = entries["ov-xattn"]
    assert xattn["speedup"] == [5.0] * 10  # vLLM's 10 s over its 2 s
    assert xattn["over_ov_dense"] == [2.5] * 10  # OpenVINO dense's 5 s over its 2 s
    assert "over_ov_dense" not in entries["ov-dense"]
    lines = "\n".join(fr.table_lines(rows))
    # 6/10 passkeys lie below 10/10's Wilson interval (72%); no multi-key for ov-dense
    assert ("| OpenVINO XAttention, threshold 0.8 | 5.00x [5.00, 5.00] (10); 2.50x over "
            "OpenVINO dense | - | 6/10") in lines
    assert "no perplexity; retrieval below dense's interval on the same trials |" in lines
    assert ("| OpenVINO GenAI, dense | 2.00x [2.00, 2.00] (10) | - | 10/10 [72%, 100%] | - | - "
            "| - | - | - | no perplexity; retrieval within dense's interval on the same trials |"
            ) in lines


def test_a_peer_with_fewer_trials_is_judged_on_the_reference_s_same_trials():
    # vLLM misses trials 1 to 3 of 20 (17/20, interval [64%, 95%]); a peer that
    # ran trials 0 to 7 and missed the same three has 5/8 (63%): below the
    # 20 trials' interval, but vLLM's own 5/8 on those trials is its reference
    vllm = [t not in (1, 2, 3) for t in range(20)]
    rows = _hits("vllm", "passkey", vllm, ttft=[10.0] * 20)
    rows += _hits("ov-dense", "passkey", vllm[:8], ttft=[5.0] * 8)
    lines = "\n".join(fr.table_lines(rows))
    assert ("| OpenVINO GenAI, dense | 2.00x [2.00, 2.00] (8) | - | 5/8 [31%, 86%] | 0.10, "
            "0.20, 0.30 | - | - | - | - | no perplexity; retrieval within dense's interval on "
            "the same trials (n=8) |") in lines


def test_the_frontier_keeps_only_undominated_accurate_settings():
    def entry(name, up, change, accurate=True):
        return dict(setting=name, speedup=[up], ppl_change=change, accurate=accurate)
    entries = [entry("slow", 1.2, 0.001), entry("fast", 1.8, 0.004),
               entry("dominated", 1.5, 0.006), entry("fastest", 2.5, 0.03, accurate=False)]
    assert fr.frontier(entries) == {"slow", "fast"}


def test_the_table_shows_the_verdicts():
    text = "\n".join(fr.table_lines(_results(tight_ppl=10.2)))
    assert "| `tight` | 2.25x [2.00, 2.50] (10) | - | 9/10 [60%, 98%] | 0.90 |" in text
    assert "(+2.00%)" in text and "| no |" in text
    assert "| vLLM's backend |" in text and "(the reference)" in text


# --------------------------------------------------------------------------- #
# Oracle
# --------------------------------------------------------------------------- #


def test_block_mass_of_uniform_attention():
    """Zero queries attend uniformly: position p gives each of its p + 1
    visible keys 1 / (p + 1)."""
    q = torch.zeros(1, 2, 6, 4)
    k = torch.randn(1, 1, 6, 4)
    mass = fr.block_mass(q, k, 0.5, row=1, bs=2)  # positions 2 and 3
    expected = torch.tensor([(2 / 3 + 2 / 4) / 2, (1 / 3 + 2 / 4) / 2], dtype=torch.float64)
    assert torch.allclose(mass, expected.expand(2, 2))
    mass = fr.block_mass(q, k, 0.5, row=2, bs=2)  # positions 4 and 5
    expected = torch.tensor([(2 / 5 + 2 / 6) / 2, (2 / 5 + 2 / 6) / 2, (1 / 5 + 2 / 6) / 2],
                            dtype=torch.float64)
    assert torch.allclose(mass[0], expected)


def test_block_mass_follows_a_dominant_key_per_head():
    q = torch.zeros(1, 2, 4, 2)
    q[0, 0, :, 0] = 1.0  # head 0 looks along dimension 0, head 1 along 1
    q[0, 1, :, 1] = 1.0
    k = torch.zeros(1, 2, 4, 2)
    k[0, 0, 0, 0] = 100.0  # head 0's key 0 (block 0)
    k[0, 1, 3, 1] = 100.0  # head 1's key 3 (block 1)
    mass = fr.block_mass(q, k, 1.0, row=1, bs=2)
    assert mass[0, 0] > 0.999 and mass[1, 1] > 0.49  # key 3 is visible to position 3 only
    got, best = fr.kept_mass(mass, [[1], [0]])
    assert got == pytest.approx((float(mass[0, 1]) + float(mass[1, 0])) / 2)
    assert best == pytest.approx((float(mass[0].max()) + float(mass[1].max())) / 2)
    assert best > got


def test_block_mass_of_a_blocks_last_queries():
    q = torch.zeros(1, 1, 6, 4)
    k = torch.randn(1, 1, 6, 4)
    # the last query (position 5) sees 6 keys alike; the last two average 5 and 6
    last = fr.block_mass(q, k, 1.0, row=2, bs=2, last=1)
    assert torch.allclose(last[0], torch.tensor([2 / 6] * 3, dtype=torch.float64))
    two = fr.block_mass(q, k, 1.0, row=2, bs=2, last=2)
    want = [(2 / 5 + 2 / 6) / 2, (2 / 5 + 2 / 6) / 2, (1 / 5 + 2 / 6) / 2]
    assert torch.allclose(two[0], torch.tensor(want, dtype=torch.float64))


def test_the_miss_check_per_chunk_of_uniform_attention():
    """Zero queries attend uniformly. Chunks of 4 tokens, blocks of 2; only
    the last block (positions 6 and 7) drops blocks 1 and 2: 2 kept of 4.
    Its queries give blocks 0-2 (2/7 + 2/8) / 2 each and block 3 (1/7 +
    2/8) / 2: kept blocks 0 and 3 hold 1/14 less than the two heaviest."""
    q, k = torch.zeros(1, 1, 8, 4), torch.randn(1, 1, 8, 4)
    idx = torch.tensor([[[[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, -1], [0, 3, -1, -1]]]],
                       dtype=torch.int32)
    lengths = torch.tensor([[[1, 2, 3, 2]]], dtype=torch.int32)
    got = fr.chunk_misses(q, k, idx, lengths, 1.0, bs=2, chunk=4)
    assert got[0] is None and got[1] == pytest.approx(1 / 14, abs=1e-4)


def test_sampled_picks_keep_the_forced_blocks_and_the_count():
    sampled = torch.tensor([[0.1, 0.5, 0.2, 0.15, 0.05], [0.3, 0.0, 0.0, 0.6, 0.1]])
    picks = fr.sampled_picks(sampled, [[0, 1, 4], [2, 4]], forced={4})
    assert picks == [[4, 1, 2], [4, 3]]


def test_starved_queries_are_counted_per_query_not_per_block():
    """Two heads of two queries over three blocks: head 0's second query puts
    0.7 on block 2, which head 0 does not keep; the block mean (0.4) would
    not show that it loses more than half."""
    per_query = torch.tensor([[[0.9, 0.0, 0.1], [0.2, 0.1, 0.7]],
                              [[0.5, 0.5, 0.0], [0.3, 0.3, 0.4]]], dtype=torch.float64)
    assert fr.starved(per_query, [[0, 1], [0, 1, 2]]) == (1, 4)
    assert fr.starved(per_query, [[2], [0]], below=0.5) == (2, 4)  # 0.5 is not under it


def test_sampled_picks_among_candidates_take_only_those():
    """The probe's rule: the heaviest of the listed candidates, even where
    heavier blocks lie outside the list (and fewer where it lists fewer)."""
    sampled = torch.tensor([[0.1, 0.5, 0.2, 0.15, 0.05], [0.3, 0.0, 0.0, 0.6, 0.1]])
    picks = fr.sampled_picks(sampled, [[0, 1, 4], [2, 4]], forced={4},
                             among=[{0, 2, 3}, {1}])
    assert picks == [[4, 2, 3], [4, 1]]


def test_a_cell_leaves_room_for_its_answer_within_the_window():
    import ruler
    # perplexity generates one token; a retrieval task its longest answer
    assert fr.cell_length("perplexity", 32768, 32768) == 32760
    assert fr.cell_length("perplexity", 16384, 32768) == 16384
    longest = max(ruler.ANSWER_TOKENS.values())
    assert fr.cell_length("passkey", 32768, 32768) == 32768 - longest - 8


def test_a_settings_greedy_agreement_is_kept_as_a_count():
    """A setting's perplexity row keeps how many greedy tokens equal vLLM's
    (``same``) rather than its 16K to 32K tokens; both forms give one answer."""
    rows = _results()
    as_count = [dict(r, same=3) if r["task"] == "perplexity" and r["setting"] == "tight"
                else r for r in rows]
    for r in as_count:
        if "same" in r:
            del r["greedy"]
    assert fr.same_greedy(rows[1], rows[0]) == 3
    entries = {e["setting"]: e for e in fr.summary(as_count)}
    assert entries["tight"]["agreement"] == pytest.approx(3 / 1000)


def test_perplexity_that_would_not_fit_in_memory_is_refused_before_any_engine():
    """Two float32 [tokens, vocab] arrays: Gemma-3's vocabulary at 16K tokens
    is 32 GiB (2 x 16384 x 262144 x 4 bytes); SmolLM2's at 32K is 12 GiB."""
    gib = 2**30
    with pytest.raises(SystemExit, match=r"gemma3 at 16384 tokens needs about 32.0 GiB"):
        fr.logprob_memory_check("gemma3", 16384, 262144, 20 * gib)
    fr.logprob_memory_check("smollm2", 32760, 49152, 20 * gib)  # 12.0 GiB: fits
    with pytest.raises(SystemExit, match="12.0 GiB"):
        fr.logprob_memory_check("smollm2", 32768, 49152, 11 * gib)
