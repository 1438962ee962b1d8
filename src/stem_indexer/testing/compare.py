"""Comparing two indexer outputs the way the reference test framework does.

docs/CONTRACT.md section 5. Top-k boundaries are sensitive to float summation order,
so two correct implementations may pick different blocks where scores are
(nearly) equal. The comparison is:

* shapes equal; ``sparse_seq_len`` equal everywhere; every entry past a row's
  seq_len is -1;
* per row, the valid prefix as a set; a row fails outright if it has
  duplicates, an index outside [0, s2_valid), or misses a forced block (and,
  with ``require_sorted``, if it is not ascending);
* differing dynamic picks are tolerated where each differing index's score
  (in the ranking precision) is within relative 1e-3 (absolute 2.5e-5 near
  zero) of the lowest expected dynamic score of the row;
* differing indices beyond that tolerance: none (``allowance=0``, the
  default), or at most ``allowance`` of all valid entries of the case.

This package's backends are held to the default: with the same inputs every
score they rank differs from the reference's only by summation order, so a
differing pick whose score is not within that rounding of the row's threshold
is a bug, however rare. ``FOREIGN_ALLOWANCE`` (0.5%, the reference test
framework's own figure) is for judging another implementation's output, e.g.
the NPU operator's saved results, whose scores may be computed differently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..operator import contract
from ..operator.contract import IndexerParams, ceil_div

RTOL = 1e-3
ATOL = 2.5e-5
FOREIGN_ALLOWANCE = 0.005
"""Fraction of differing picks beyond score tolerance that the reference test
framework tolerates in another implementation's output; never for this
package's own backends."""


@dataclass
class Comparison:
    """Outcome of ``compare``: whether the case passes (``ok``), what was
    found, then the allowance it was judged by."""

    ok: bool
    rows: int = 0
    valid_entries: int = 0
    differing_rows: int = 0
    tolerated_indices: int = 0
    bad_indices: int = 0
    errors: list[str] = field(default_factory=list)
    allowance: float = 0.0

    def summary(self) -> str:
        state = "PASS" if self.ok else "FAIL"
        text = (f"{state}: {self.rows} rows, {self.valid_entries} valid entries, "
                f"{self.differing_rows} rows differ, {self.tolerated_indices} indices "
                f"within score tolerance, {self.bad_indices} beyond")
        if self.allowance:
            text += f" (up to {self.allowance:.1%} allowed)"
        if self.errors:
            text += "; " + "; ".join(self.errors[:5])
            if len(self.errors) > 5:
                text += f"; ... ({len(self.errors) - 5} more)"
        return text


def _row_scores(inputs: dict, params: IndexerParams, b: int, h: int, i: int, kb: int):
    """Float32 scores of row (b, h, i) against key blocks [0, kb), ranking precision."""
    qflat, kflat, vbias = inputs["qflat"], inputs["kflat"], inputs["vbias"]
    n = h // (qflat.shape[1] // kflat.shape[1])
    dots = kflat[b, n, :kb].float().cpu() @ qflat[b, h, i].float().cpu()
    scores = dots * contract.score_scale(params) + vbias[b, n, :kb].float().cpu()
    if params.topk_score_precision == 2:
        scores = scores.to(torch.bfloat16).float()
    return scores


def _close(x: float, ref: float) -> bool:
    return abs(x - ref) <= max(RTOL * abs(ref), ATOL)


def compare(actual: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor],
            inputs: dict, params: IndexerParams, *, require_sorted: bool = True,
            allowance: float = 0.0) -> Comparison:
    """Compare ``actual`` (indices, seq_len) against trusted ``expected``.

    ``inputs`` holds the op's tensors (``qflat``, ``kflat``, ``vbias``,
    ``q_seq_lens``, ``kv_seq_lens``); scores of differing rows are recomputed
    from them. ``allowance`` is the fraction of valid entries that may differ
    beyond score tolerance: 0 for this package's backends (the default),
    ``FOREIGN_ALLOWANCE`` for another implementation's output.
    """
    if not (isinstance(allowance, (int, float)) and not isinstance(allowance, bool)
            and 0.0 <= allowance <= 1.0):
        raise ValueError(f"compare: allowance must be a fraction in [0, 1]; got {allowance!r}")
    a_idx, a_len = (t.cpu() for t in actual)
    e_idx, e_len = (t.cpu() for t in expected)
    if a_idx.shape != e_idx.shape or a_len.shape != e_len.shape:
        return Comparison(False, errors=[
            f"shape mismatch: actual {tuple(a_idx.shape)}/{tuple(a_len.shape)}, "
            f"expected {tuple(e_idx.shape)}/{tuple(e_len.shape)}"])
    result = Comparison(True, rows=e_len.numel(), valid_entries=int(e_len.sum()),
                        allowance=float(allowance))

    if not torch.equal(a_len, e_len):
        where = (a_len != e_len).nonzero()[0].tolist()
        result.ok = False
        result.errors.append(f"sparse_seq_len differs at {tuple(where)}: "
                             f"{int(a_len[tuple(where)])} != {int(e_len[tuple(where)])}")
        return result
    slot = torch.arange(a_idx.shape[-1])
    tail = slot >= a_len[..., None]
    if not bool((a_idx[tail] == -1).all()):
        where = (tail & (a_idx != -1)).nonzero()[0].tolist()
        result.ok = False
        result.errors.append(f"entry past seq_len is not -1 at {tuple(where)}")
        return result

    differing = (a_idx != e_idx).any(dim=-1).nonzero().tolist()
    result.differing_rows = len(differing)
    if not differing:
        return result

    q_lens = inputs["q_seq_lens"].cpu().tolist()
    kv_lens = inputs["kv_seq_lens"].cpu().tolist()
    bs = params.stem_block_size
    for b, h, i in differing:
        n_valid = int(a_len[b, h, i])
        got = a_idx[b, h, i, :n_valid].tolist()
        want = e_idx[b, h, i, :n_valid].tolist()
        qb, kb = ceil_div(q_lens[b], bs), ceil_div(kv_lens[b], bs)
        s2 = int(contract.visible_blocks(torch.tensor([i]), qb, kb, params.causal)[0])
        sink_end, cand_end = (int(x[0]) for x in contract.candidate_range(
            torch.tensor([s2]), params.initial_blocks, params.window_size))
        forced = set(range(sink_end)) | set(range(cand_end, s2))
        row = (b, h, i)
        if len(set(got)) != len(got):
            result.errors.append(f"row {row}: duplicate indices")
        elif any(j < 0 or j >= s2 for j in got):
            result.errors.append(f"row {row}: index outside [0, {s2})")
        elif not forced <= set(got):
            result.errors.append(f"row {row}: misses forced blocks {sorted(forced - set(got))}")
        elif require_sorted and got != sorted(got):
            result.errors.append(f"row {row}: indices not ascending")
        else:
            extra, missing = set(got) - set(want), set(want) - set(got)
            if not extra and not missing:
                continue  # same set, other order (require_sorted=False)
            scores = _row_scores(inputs, params, b, h, i, kb)
            dynamic = [j for j in want if j not in forced]
            threshold = min(float(scores[j]) for j in dynamic) if dynamic else 0.0
            for j in extra | missing:
                if _close(float(scores[j]), threshold):
                    result.tolerated_indices += 1
                else:
                    result.bad_indices += 1
            continue
        result.ok = False
    if result.bad_indices > allowance * result.valid_entries:
        result.ok = False
        allowed = (f"allowed {allowance:.1%} of {result.valid_entries}" if allowance
                   else "allowed none")
        result.errors.append(f"{result.bad_indices} differing indices beyond score tolerance "
                             f"({allowed})")
    return result
