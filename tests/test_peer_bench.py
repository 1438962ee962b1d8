"""benchmarks/peers/peer_bench.py: the driver's pure-Python parts, without OpenVINO,
vLLM or a model: the rotating call order, the tables (Wilson intervals, spread,
first-token agreement), resumable passkey results, the seeded prompts, and the
worker protocol end to end with a fake worker process."""

from __future__ import annotations

import io
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

import peer_bench as pb
import trials


def test_rotation_puts_every_config_in_every_place():
    names = ["a", "b", "c"]
    orders = [pb.rotation(names, k) for k in range(6)]
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert orders[3:] == orders[:3]
    for place in range(3):  # each name first, second, last equally often
        assert sorted(order[place] for order in orders) == ["a", "a", "b", "b", "c", "c"]
    assert pb.rotation([], 3) == []
    assert pb.rotation(names, 0) is not names and names == ["a", "b", "c"]


def test_wilson_interval_and_cell():
    lo, hi = trials.wilson(10, 20)
    assert lo == pytest.approx(0.2993, abs=1e-3) and hi == pytest.approx(0.7007, abs=1e-3)
    assert trials.wilson(0, 0) == (0.0, 1.0)
    lo, hi = trials.wilson(20, 20)
    assert hi == 1.0 and lo == pytest.approx(0.8389, abs=1e-3)
    assert trials.wilson_cell(10, 20) == "10/20 [30%, 70%]"
    assert trials.wilson_cell(0, 0) == "-"
    assert trials.wilson_cell(0, 2) == "0/2 [0%, 66%]"


def test_spread():
    assert pb.spread([3.0, 1.0, 2.0]) == "2.00 [1.00, 3.00]"
    assert pb.spread([]) == "-"
    assert pb.spread([0.5], "{:.0%}") == "50% [50%, 50%]"


def test_parse_configs_and_labels():
    assert pb.parse_configs("vllm, ov-dense,vllm") == ["vllm", "ov-dense"]
    with pytest.raises(SystemExit):
        pb.parse_configs("vllm,llama.cpp")
    with pytest.raises(SystemExit):
        pb.parse_configs(" , ")
    assert pb.config_label("vllm-stem", {}, 0) == "vllm-stem"
    assert pb.config_label("vllm-stem", {"preset": "tight"}, 0) == 'vllm-stem {"preset": "tight"}'
    assert pb.config_label("ov-xattn", {"preset": "tight"}, 0) == "ov-xattn"
    assert pb.config_label("ov-dense", {}, 4096) == "ov-dense max_num_batched_tokens=4096"
    assert pb.config_label("vllm", {}, 4096) == "vllm"


def test_fit_length_and_kv_cache():
    assert pb.fit_length(32768, 32768, 16) == 32752  # vllm_bench's passkey length
    assert pb.fit_length(32768, 32768, 8) == 32760
    assert pb.fit_length(2048, 32768, 16) == 2048
    assert pb.kv_cache_gib(30, 3, 64, 32832) == 1  # SmolLM2 at 32K: 0.75 GiB
    assert pb.kv_cache_gib(30, 3, 64, 131072) == 4


def test_speed_rows():
    calls = {2048: {
        "vllm": [{"seconds": 2.0, "first": 5}, {"seconds": 4.0, "first": 6}],
        "ov-dense": [{"seconds": 1.0, "first": 5}, {"seconds": 4.0, "first": 7}],
        "vllm-stem": [{"seconds": 1.0, "first": 5, "density": 0.5}, None],
        "ov-xattn": [{"seconds": 2.0, "first": 5}, {"seconds": 1.0, "first": 6}],
    }}
    rows = pb.speed_rows(calls, ["ov-dense", "ov-xattn", "vllm", "vllm-stem"], "vllm")
    assert rows[0].startswith("| tokens | configuration | turns |")
    assert len(rows) == 2 + 4
    dense, xattn, vllm, stem = rows[2:]
    # speed-up per turn: 2/1 and 4/4; first tokens: 5=5, 7!=6
    assert dense == "| 2048 | ov-dense | 2 | 2.50 [1.00, 4.00] | 1.50 [1.00, 2.00]x | 1/2 |  |"
    assert xattn == "| 2048 | ov-xattn | 2 | 1.50 [1.00, 2.00] | 2.50 [1.00, 4.00]x | 2/2 |  |"
    assert vllm == "| 2048 | vllm | 2 | 3.00 [2.00, 4.00] | (baseline) | (reference) |  |"
    assert stem == ("| 2048 | vllm-stem | 2 | 1.00 [1.00, 1.00] | 2.00 [2.00, 2.00]x | 1/1 | "
                    "1 call(s) failed; Stem density 50% [50%, 50%] |")


def test_speed_rows_without_reference_and_dense_stem():
    calls = {4096: {"ov-dense": [{"seconds": 2.0, "first": 1}],
                    "vllm-stem": [{"seconds": 1.0, "first": 1, "density": None,
                                   "rows": {"dense:budget keeps every block": 30}}]}}
    rows = pb.speed_rows(calls, ["ov-dense", "vllm-stem"], "ov-dense")
    assert rows[2] == "| 4096 | ov-dense | 1 | 2.00 [2.00, 2.00] | (baseline) | - (no vllm) |  |"
    assert rows[3] == ("| 4096 | vllm-stem | 1 | 1.00 [1.00, 1.00] | 2.00 [2.00, 2.00]x | "
                       "- (no vllm) | no Stem row ran sparse; layer rows: "
                       "dense:budget keeps every block 30 |")


def _entry(model, length, trial, config, found):
    return {"model": model, "length": length, "trial": trial, "config": config, "found": found}


def test_passkey_rows_and_resume(tmp_path):
    entries = [_entry("smollm2", 2048, t, c, f) for t, c, f in
               [(0, "ov-dense", True), (0, "vllm", True), (1, "ov-dense", False),
                (1, "vllm", True)]]
    entries.append(_entry("gemma3", 2048, 0, "ov-dense", True))
    entries.append(_entry("gemma3", 2048, 0, "ov-dense max_num_batched_tokens=4096", False))
    rows = pb.passkey_rows(list(reversed(entries)))
    assert rows[0] == "| model | tokens | ov-dense | ov-dense max_num_batched_tokens=4096 | vllm |"
    assert rows[2] == "| gemma3 | 2048 | 1/1 [21%, 100%] | 0/1 [0%, 79%] | - |"
    assert rows[3] == "| smollm2 | 2048 | 1/2 [9%, 91%] | - | 2/2 [34%, 100%] |"
    path = tmp_path / "results.jsonl"
    assert trials.read(path) == []
    path.write_text("".join(json.dumps(e) + "\n" for e in entries) + "\n")
    assert trials.read(path) == entries
    keys = pb.done_keys(trials.read(path))
    assert ("smollm2", 2048, 1, "vllm") in keys and ("gemma3", 2048, 0, "vllm") not in keys


def test_random_ids_are_seeded_and_avoid_special_tokens():
    a = pb.random_ids("peer-x-2048-0", 2048, 1000, {100, 101, 500}, [2])
    assert a == pb.random_ids("peer-x-2048-0", 2048, 1000, {100, 101, 500}, [2])
    assert a != pb.random_ids("peer-x-2048-1", 2048, 1000, {100, 101, 500}, [2])
    assert len(a) == 2048 and a[0] == 2 and a.count(2) == 1  # the prefix once
    assert all(100 <= t < 1000 and t not in (100, 101, 500) for t in a[1:])


def test_serve_answers_each_request_and_reports_errors():
    def generate(ids, n):
        if not ids:
            raise ValueError("empty prompt")
        return {"seconds": 0.5, "tokens": [sum(ids)] * n}

    requests = io.StringIO("\n".join([
        json.dumps({"op": "generate", "ids": [1, 2], "max_new_tokens": 2}), "",
        json.dumps({"op": "generate", "ids": [], "max_new_tokens": 1}),
        json.dumps({"op": "quit"}),
        json.dumps({"op": "generate", "ids": [9], "max_new_tokens": 1})]) + "\n")
    reply = io.StringIO()
    pb.serve(generate, {"library": "fake"}, requests, reply)
    msgs = [json.loads(line) for line in reply.getvalue().splitlines()]
    assert msgs[0] == {"event": "ready", "info": {"library": "fake"}}
    assert msgs[1] == {"event": "result", "seconds": 0.5, "tokens": [3, 3]}
    assert msgs[2]["event"] == "error" and "ValueError: empty prompt" in msgs[2]["error"]
    assert len(msgs) == 3  # nothing after quit


FAKE_WORKER = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {bench!r})
    import peer_bench as pb
    fd = int(sys.argv[sys.argv.index("--reply-fd") + 1])
    os.set_inheritable(fd, False)
    reply = os.fdopen(fd, "w", buffering=1)
    print("a library log line on stdout: {{\\"event\\": \\"result\\"}}", flush=True)
    def generate(ids, n):
        print("log while generating", flush=True)
        if ids == [666]:
            os._exit(3)
        return {{"seconds": 0.01, "tokens": [len(ids)] + [0] * (n - 1)}}
    pb.serve(generate, {{"library": "fake " + sys.argv[1]}}, sys.stdin, reply)
""")


def _fake(tmp_path, name):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER.format(bench=str(Path(pb.__file__).parent)))
    return pb.Worker(name, [sys.executable, str(script), name], tmp_path / f"{name}.log",
                     dict(os.environ), poll_s=0.2)


def test_worker_protocol_with_fake_workers(tmp_path):
    """Two fake workers get the same ids in rotating order; library output on
    their stdout goes to their logs, never into the replies."""
    workers = {name: _fake(tmp_path, name) for name in ("w1", "w2")}
    try:
        for name, w in workers.items():
            assert w.ready() == {"library": f"fake {name}"}
        seen = []
        for k, ids in enumerate([[5] * 7, [1, 2, 3]]):
            for name in pb.rotation(list(workers), k):
                out = workers[name].call(ids, 2)
                seen.append((name, out["tokens"]))
        assert seen == [("w1", [7, 0]), ("w2", [7, 0]), ("w2", [3, 0]), ("w1", [3, 0])]
    finally:
        for w in workers.values():
            w.close(timeout=10)
    for name in workers:
        log = (tmp_path / f"{name}.log").read_text()
        assert "a library log line" in log and log.count("log while generating") == 2


def test_worker_death_is_reported_with_its_log(tmp_path):
    w = _fake(tmp_path, "dies")
    try:
        w.ready()
        with pytest.raises(pb.WorkerError, match="dies: worker") as info:
            w.call([666], 1)
        assert "log while generating" in str(info.value)
    finally:
        w.close(timeout=10)


def test_worker_start_failure_is_reported(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        fd = int(sys.argv[sys.argv.index("--reply-fd") + 1])
        with os.fdopen(fd, "w") as reply:
            reply.write(json.dumps({"event": "error", "error": "ImportError: no openvino"})
                        + "\\n")
        sys.exit(1)
    """))
    w = pb.Worker("broken", [sys.executable, str(script)], tmp_path / "broken.log", poll_s=0.2)
    try:
        with pytest.raises(pb.WorkerError, match="no openvino"):
            w.ready()
    finally:
        w.close(timeout=10)


def test_cli_rejects_unknown_configs():
    with pytest.raises(SystemExit):
        pb.main(["speed", "--configs", "llama.cpp"])
