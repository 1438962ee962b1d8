"""Runs one vLLM engine configuration for tests/test_vllm.py; prints one JSON line.

    python tests/vllm_engine.py SPEC_JSON

SPEC: ``model`` (a directory), ``stem`` (settings, or null for vLLM's own
backend), ``engine`` (keyword arguments of ``vllm.LLM``), ``batches`` (lists of
``{"prompt": [ids], "max_tokens": n}``, each list one ``generate`` call) and
``check_rows`` (compare every Stem row of every layer with ``stem_attention``
on the same queries, keys and values). The result holds each request's
tokens and their log-probabilities, ``stats(llm)``, and with ``check_rows`` the
rows checked, their kinds, the largest difference from ``stem_attention``, the
selections that differ from the indexer's own lists (the prompt's tail rows,
``exact_tail``, held to every block by hand) and how many tail rows there were.
Each configuration runs in a process of its own: vLLM keeps process-wide
state (its configuration, the distributed group, the platform).
"""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


class _Shadow:
    """Every key and value the Stem layers wrote, by layer and slot: the
    checker reads a row's keys and values from here, whatever the layout of
    vLLM's own cache."""

    def __init__(self) -> None:
        self.layers: dict = {}
        self.left_out = 0  # tokens vLLM's cache took and the indexer cache did not

    def write(self, layer, key, value, slots, written) -> None:
        import torch

        keep = slots >= 0
        self.left_out += int((keep & (written < 0)).sum())
        key, value, slots = key[keep], value[keep], slots[keep].long()
        if slots.numel() == 0:
            return
        k, v = self.layers.get(layer, (None, None))
        need = int(slots.max()) + 1
        if k is None or k.shape[0] < need:
            size = max(need, 2 * (0 if k is None else k.shape[0]))
            grown = [torch.zeros(size, *key.shape[1:], dtype=key.dtype) for _ in range(2)]
            if k is not None:
                grown[0][:k.shape[0]], grown[1][:v.shape[0]] = k, v
            k, v = grown
            self.layers[layer] = (k, v)
        k[slots], v[slots] = key, value

    def row(self, layer, plan):
        """The row's keys and values [Hkv, seq_len, D]."""
        import torch

        t = torch.arange(plan.row.seq_len)
        slots = plan.pages[t // plan.page] * plan.page + t % plan.page
        k, v = self.layers[layer]
        return k[slots].transpose(0, 1), v[slots].transpose(0, 1)


def _checker(settings, record: dict, shadow: _Shadow):
    import dataclasses
    import re

    import torch

    import stem_indexer
    from stem_indexer.pipeline.probe import probe_params, probe_refine

    def op_params(p) -> dict:
        return {k: v for k, v in dataclasses.asdict(p).items() if k != "causal"}

    def check(trace) -> None:
        row, bs = trace.row, settings.block_size
        if trace.kflat is None:  # widened by the miss check's verdict: every block it sees
            first, width = row.context // bs, trace.indices.shape[-1]
            last = first + torch.arange(trace.lengths.shape[1])[:, None]
            every = torch.where(torch.arange(width) <= last, torch.arange(width), -1)
            every_len = (last + 1).T.expand_as(trace.lengths)
            record["widened"].append((row.context, torch.equal(trace.lengths, every_len) and
                                      torch.equal(trace.indices, every.expand_as(trace.indices))))
            return
        # The layer's budget: its ``layer_budgets`` entry, by the index in its name.
        layer = settings.layer_params(int(re.search(r"\.(\d+)\.", trace.layer).group(1)))
        params = op_params(layer)
        # With the probe, the indexer lists the candidates, at the widened budget.
        indexer = op_params(probe_params(layer, settings.probe_candidates)
                            if settings.probe_queries else layer)
        key, value = shadow.row(trace.layer, trace.plan)
        lead = row.context - (row.context // bs) * bs
        hq, dim = trace.query.shape[1], trace.query.shape[2]
        q = trace.query.new_zeros(1, hq, lead + row.q_len, dim)
        q[0, :, lead:] = trace.query.transpose(0, 1)
        prompt = [max(row.prompt, row.seq_len)]
        with torch.inference_mode():
            inputs = stem_indexer.stem_inputs(q, key[None], value[None],
                                              stem_block_size=bs,
                                              stem_stride=settings.stride,
                                              scale=trace.scale / settings.stride,
                                              oam=settings.oam, oam_lambda=settings.oam_lambda)
            idx, lengths = stem_indexer.stem_indexer(
                inputs.qflat, inputs.kflat, inputs.vbias, inputs.q_seq_lens,
                inputs.kv_seq_lens, num_prompt_tokens=torch.tensor(prompt, dtype=torch.int32),
                **indexer)
            if settings.probe_queries:
                # Re-ranked on the keys vLLM was given (the shadow), not on
                # those the backend read back from its cache.
                one, one_len = probe_refine(
                    trace.query, key.transpose(0, 1), idx[0], lengths[0],
                    context=row.context, seq_len=row.seq_len, prompt=prompt[0],
                    params=layer, scale=trace.scale,
                    queries=settings.probe_queries)
                idx, lengths = one[None], one_len[None]
        # The indexer cache gives stem_inputs's key-side inputs, bit for bit.
        record["cache_mismatches"] += not (torch.equal(trace.kflat, inputs.kflat[0])
                                           and torch.equal(trace.vbias, inputs.vbias[0]))
        # The indexer's lists, with each query block holding one of the
        # prompt's last exact_tail tokens widened by hand: the row's block j
        # is block first + j of the prompt and sees blocks 0 .. first + j.
        first, width = row.context // bs, trace.indices.shape[-1]
        want_idx = idx.new_full((hq, trace.lengths.shape[1], width), -1)
        want_idx[..., :min(width, idx.shape[-1])] = idx[0, ..., :width]
        want_len = lengths[0].clone()
        for j in range(want_len.shape[1]):
            last = min((first + j + 1) * bs, row.seq_len) - 1  # its last query's position
            if settings.exact_tail and last >= prompt[0] - settings.exact_tail:
                want_idx[:, j] = torch.where(torch.arange(width) <= first + j,
                                             torch.arange(width), -1)
                want_len[:, j] = first + j + 1
                record["tail_rows"] += 1
        same = torch.equal(want_len, trace.lengths) and torch.equal(want_idx, trace.indices)
        with torch.inference_mode():
            if settings.probe_queries:  # stem_attention has no probe: attend on the lists
                want = stem_indexer.block_sparse_attention(
                    q, key[None], value[None], want_idx[None], want_len[None],
                    stem_block_size=bs, scale=trace.scale)
            else:
                # The backend chose Stem for this row; stem_attention must not
                # step aside on its own density rule (dense_above=1.0: only
                # keep-all).
                want = stem_indexer.stem_attention(
                    q, key[None], value[None], scale=trace.scale, num_prompt_tokens=prompt,
                    oam=settings.oam, oam_lambda=settings.oam_lambda, min_q_blocks=0,
                    dense_above=1.0, exact_tail=settings.exact_tail, **params)
        want = want[0, :, lead:].transpose(0, 1)
        err = (trace.output.double() - want.double()).abs().max().item()
        record["rows"] += 1
        record["max_error"] = max(record["max_error"], err)
        record["selection_mismatches"] += not same
        if not same:
            record["mismatch_contexts"].append(row.context)
        record["kinds"][row.kind] = record["kinds"].get(row.kind, 0) + 1
        record["unaligned"] += row.context % bs != 0
        record["beside_other_rows"] += row.start > 0  # other rows come first in the step
        record["sparse_rows"] += int((trace.lengths < first + 1
                                      + torch.arange(trace.lengths.shape[1])).sum())

    return check


# Where a failure can be injected: (object, attribute) of the function that
# raises, in the worker (this process).
def _failure_points():
    from stem_indexer.pipeline.index_cache import IndexCache, WriteStage
    from stem_indexer.integrations.vllm import backend

    return {
        "select": (backend, "select_blocks"),  # a row's selection (forward)
        "write": (IndexCache, "write"),  # the indexer-cache write
        "stage": (WriteStage, "flush"),  # the staged writes of steps without Stem rows
        "hook": (backend._KINDS, "kind"),  # the step hook (_record_step)
        "plan": (backend, "plan_stem_row"),  # the metadata builder's plan
        "reason": (backend.StemAttentionImpl, "_reason"),  # checks atop forward and write
        "complete": (IndexCache, "usable"),  # the indexer cache's check (forward)
        "count": (backend.STATS, "row"),  # counting a layer's rows (forward)
        "allocate": (IndexCache, "allocate"),  # the indexer cache's allocation
    }


_FAILURE_CALLS = [0]


def _inject_failure(kind: str, after: int) -> None:
    """Make Stem fail in the worker (this process) at ``kind``
    (``_failure_points``), from its ``after``-th call on; ``_FAILURE_CALLS``
    counts the calls."""
    owner, name = _failure_points()[kind]
    fn = getattr(owner, name)
    calls = _FAILURE_CALLS

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] > after:
            raise RuntimeError(f"injected {kind} failure")
        return fn(*args, **kwargs)

    setattr(owner, name, failing)


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    import stem_indexer.integrations.vllm as stem_vllm

    kwargs = dict(spec.get("engine", {}))
    if spec.get("stem") is not None:
        kwargs.update(attention_backend="CUSTOM", additional_config={"stem": spec["stem"]})
    if spec.get("fail") or spec.get("check_rows"):
        assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", "needs the worker here"
    if spec.get("fail"):  # from the start: the engine's start-up runs these paths too
        _inject_failure(*spec["fail"])
    llm = LLM(model=spec["model"], seed=0, **kwargs)
    at_start = stem_vllm.stats(llm) if spec.get("stem") is not None else None
    record = {"rows": 0, "max_error": 0.0, "selection_mismatches": 0, "tail_rows": 0,
              "kinds": {}, "unaligned": 0, "beside_other_rows": 0, "cache_mismatches": 0,
              "sparse_rows": 0, "mismatch_contexts": [], "widened": []}
    if spec.get("check_rows"):
        from stem_indexer.integrations.vllm import backend
        from stem_indexer.integrations.vllm.settings import StemSettings

        shadow = _Shadow()
        backend.observe_writes(shadow.write)
        backend.observe(_checker(StemSettings.from_mapping(spec["stem"]), record, shadow))
    results = []
    batches = list(spec["batches"])
    follow = spec.get("follow_up")  # a chat's next turn: request i's prompt and answer
    if follow:
        batches.append(None)
    for batch in batches:
        if batch is None:  # the next turn, over its first turn's pages
            first = [r for b in spec["batches"] for r in b][follow["of"]]
            answer = results[follow["of"]]["tokens"][:follow["answer_tokens"]]
            batch = [{"prompt": first["prompt"] + answer + follow["extra"],
                      "max_tokens": follow["max_tokens"]}]
        prompts = [{"prompt_token_ids": r["prompt"]} for r in batch]
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, logprobs=0)
                  for r in batch]
        for out in llm.generate(prompts, params, use_tqdm=False):
            o = out.outputs[0]
            results.append({"tokens": list(o.token_ids),
                            "logprobs": [d[t].logprob for d, t in zip(o.logprobs, o.token_ids)]})
    if spec.get("check_rows"):
        record["writes_left_out"] = shadow.left_out
    result = {"outputs": results, "record": record, "failure_calls": _FAILURE_CALLS[0]}
    if spec.get("stem") is not None:
        result["stats"] = stem_vllm.stats(llm)
        result["stats_at_start"] = at_start
    print("RESULT " + json.dumps(result), flush=True)
    del llm
    gc.collect()


if __name__ == "__main__":
    main()
