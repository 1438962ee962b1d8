"""A picture of the indexer's output: one head's map of kept key blocks.

``classify_blocks`` labels every (query block, key block) pair of one
(batch, head) as invisible, skipped, sink, window or top-k, using the
contract's own visibility and forced-block rules (``contract.visible_blocks``,
``contract.candidate_range``). ``plot_block_map`` draws that map to a PNG;
it needs matplotlib (``pip install 'stem-indexer[plot]'``), imported only
when a picture is drawn.
"""

from __future__ import annotations

import enum
from pathlib import Path

import torch

from ..operator import contract

__all__ = ["BlockKind", "classify_blocks", "block_kind_counts", "plot_block_map", "plot_example",
           "check_example"]


class BlockKind(enum.IntEnum):
    """What a (query block, key block) pair is in the selected map."""

    INVISIBLE = 0  # outside the row's visible range (causal, or past the sequence)
    SKIPPED = 1    # visible, not kept
    SINK = 2       # kept: one of the first ``initial_blocks`` visible blocks
    WINDOW = 3     # kept: one of the last ``window_size`` visible blocks (not a sink)
    TOPK = 4       # kept: a top-k pick among the candidates


# Colours per kind, in BlockKind order: greys for what is not kept, then the
# Okabe-Ito blue and orange and black, told apart with any colour vision.
_COLOURS = ("#d9d9d9", "#ffffff", "#0072b2", "#e69f00", "#000000")
_LABELS = ("invisible", "visible, skipped", "sink", "window", "top-k")


def _fail(arg: str, rule: str, got: object) -> None:
    raise ValueError(f"classify_blocks: {arg} {rule}; got {got}")


def classify_blocks(
    sparse_indices: torch.Tensor, sparse_seq_len: torch.Tensor, *, batch: int = 0,
    head: int = 0, q_len: int, kv_len: int, block_size: int, causal: bool = True,
    initial_blocks: int = 4, window_size: int = 4,
) -> torch.Tensor:
    """The ``(Qb, Kb)`` map of ``BlockKind`` values of one (batch, head).

    ``Qb = ceil(q_len / block_size)`` and ``Kb = ceil(kv_len / block_size)``
    are the valid block counts; ``causal``, ``initial_blocks`` and
    ``window_size`` must be those of the indexer call. Visible and forced
    blocks come from ``contract.visible_blocks`` and
    ``contract.candidate_range``: a kept block below the row's sink end is a
    sink, one at or past its candidate end is a window block, any other kept
    block a top-k pick.

    Raises:
        ValueError naming the argument: shapes that do not fit, a batch or
        head out of range, or a kept index outside the row's visible range.
    """
    if sparse_indices.dim() != 4:
        _fail("sparse_indices", "must be 4-D (B, Nq, Qmax, Kmax)", tuple(sparse_indices.shape))
    b_n, h_n, qmax, kmax = sparse_indices.shape
    if tuple(sparse_seq_len.shape) != (b_n, h_n, qmax):
        _fail("sparse_seq_len", f"must have shape (B, Nq, Qmax) = {(b_n, h_n, qmax)}",
              tuple(sparse_seq_len.shape))
    if not 0 <= batch < b_n:
        _fail("batch", f"must be in [0, {b_n})", batch)
    if not 0 <= head < h_n:
        _fail("head", f"must be in [0, {h_n})", head)
    if block_size < 1:
        _fail("block_size", "must be >= 1", block_size)
    qb, kb = contract.ceil_div(q_len, block_size), contract.ceil_div(kv_len, block_size)
    if not (0 <= qb <= qmax):
        _fail("q_len", f"must be in [0, Qmax*block_size = {qmax * block_size}]", q_len)
    if not (0 <= kb <= kmax):
        _fail("kv_len", f"must be in [0, Kmax*block_size = {kmax * block_size}]", kv_len)

    kinds = torch.full((qb, kb), int(BlockKind.INVISIBLE), dtype=torch.int8)
    if qb == 0 or kb == 0:
        return kinds
    rows = torch.arange(qb)
    s2 = contract.visible_blocks(rows, qb, kb, causal)
    sink_end, cand_end = contract.candidate_range(s2, initial_blocks, window_size)
    cols = torch.arange(kb)[None, :]
    kinds[cols < s2[:, None]] = int(BlockKind.SKIPPED)

    idx = sparse_indices[batch, head, :qb].to(torch.int64).cpu()
    count = sparse_seq_len[batch, head, :qb].to(torch.int64).cpu()
    kept = torch.arange(kmax)[None, :] < count[:, None]
    bad = kept & ((idx < 0) | (idx >= s2[:, None]))
    if bad.any():
        i, e = (int(x) for x in bad.nonzero()[0])
        _fail("sparse_indices", f"row {i} keeps block {int(idx[i, e])} outside its visible range "
              f"[0, {int(s2[i])})", int(idx[i, e]))
    r, e = kept.nonzero(as_tuple=True)
    j = idx[r, e]
    kind = torch.where(j < sink_end[r], int(BlockKind.SINK),
                       torch.where(j >= cand_end[r], int(BlockKind.WINDOW), int(BlockKind.TOPK)))
    kinds[r, j] = kind.to(torch.int8)
    return kinds


def block_kind_counts(kinds: torch.Tensor) -> dict[str, int]:
    """How many pairs of each kind a ``classify_blocks`` map holds, by kind name."""
    return {k.name.lower(): int((kinds == int(k)).sum()) for k in BlockKind}


def _require_matplotlib():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError("plot_block_map needs matplotlib; install the 'plot' extra: "
                          "pip install 'stem-indexer[plot]'") from exc
    return Figure, ListedColormap, Patch


def plot_block_map(
    sparse_indices: torch.Tensor, sparse_seq_len: torch.Tensor, *, batch: int = 0,
    head: int = 0, q_len: int, kv_len: int, block_size: int, causal: bool = True,
    initial_blocks: int = 4, window_size: int = 4, path: str | Path = "stem_block_map.png",
    title: str | None = None, dpi: int = 120,
) -> dict[str, int]:
    """Draw one head's selected block map to a PNG at ``path``.

    Sink, window and top-k blocks get their own colours, visible blocks that
    were skipped are white and the invisible area is grey; the x axis is the
    key block, the y axis the query block (first query block on top). The
    arguments are those of ``classify_blocks``.

    Returns:
        The ``block_kind_counts`` of the drawn map (kept pairs are
        ``sink + window + topk``, visible ones add ``skipped``).

    Raises:
        ImportError: without matplotlib (the ``plot`` extra).
    """
    Figure, ListedColormap, Patch = _require_matplotlib()
    kinds = classify_blocks(sparse_indices, sparse_seq_len, batch=batch, head=head, q_len=q_len,
                            kv_len=kv_len, block_size=block_size, causal=causal,
                            initial_blocks=initial_blocks, window_size=window_size)
    counts = block_kind_counts(kinds)
    qb, kb = kinds.shape
    kept = counts["sink"] + counts["window"] + counts["topk"]
    visible = kept + counts["skipped"]

    width = min(14.0, max(5.0, 3.0 + 0.12 * kb))
    height = min(14.0, max(3.0, 1.5 + width * qb / max(kb, 1)))
    fig = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
    ax = fig.add_subplot()
    cmap = ListedColormap(_COLOURS)
    ax.imshow(kinds.numpy() if kinds.numel() else torch.zeros(1, 1).numpy(), cmap=cmap,
              vmin=-0.5, vmax=len(_COLOURS) - 0.5, interpolation="nearest", aspect="auto",
              extent=(-0.5, kb - 0.5, qb - 0.5, -0.5))
    ax.set_xlabel(f"key block ({block_size} tokens each)")
    ax.set_ylabel("query block")
    density = kept / visible if visible else 0.0
    heading = title or f"Stem selection, batch {batch}, head {head}"
    lines = [heading, f"kept {kept} of {visible} visible block pairs: density {density:.1%}"]
    if causal and kb > qb:
        lines.append(f"the {qb} query blocks are the last of {kb} key blocks "
                     "(causal, aligned at the end)")
    ax.set_title("\n".join(lines), fontsize="medium")
    handles = [Patch(facecolor=c, edgecolor="#777777",
                     label=f"{label} ({counts[k.name.lower()]} block pairs)")
               for c, label, k in zip(_COLOURS, _LABELS, BlockKind)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
              frameon=False)
    fig.savefig(path)
    return counts


_SOURCES = {"random": (4, 64), "synthetic": (1, 4)}  # source -> (batches, query heads)


def check_example(*, source: str, q_blocks: int, kv_blocks: int, block_size: int, stride: int,
                  batch: int, head: int) -> None:
    """The checks of ``plot_example``'s arguments, before any work.

    Raises:
        ValueError naming the argument; ImportError without matplotlib.
    """
    if source not in _SOURCES:
        raise ValueError(f"plot_example: source must be one of {sorted(_SOURCES)}; "
                         f"got {source!r}")
    for name, value in (("q_blocks", q_blocks), ("kv_blocks", kv_blocks),
                        ("block_size", block_size), ("stride", stride)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plot_example: {name} must be an int >= 1; got {value!r}")
    if q_blocks > kv_blocks:
        raise ValueError(f"plot_example: q_blocks must be <= kv_blocks ({kv_blocks}); "
                         f"got {q_blocks}")
    if block_size % stride:
        raise ValueError(f"plot_example: block_size must be a multiple of stride ({stride}); "
                         f"got {block_size}")
    batches, heads = _SOURCES[source]
    if source == "synthetic" and kv_blocks < 24:
        raise ValueError(f"plot_example: the synthetic source needs kv_blocks >= 24; "
                         f"got {kv_blocks}")
    if not 0 <= batch < batches:
        raise ValueError(f"plot_example: batch must be in [0, {batches}) for the {source} "
                         f"source; got {batch}")
    if not 0 <= head < heads:
        raise ValueError(f"plot_example: head must be in [0, {heads}) for the {source} "
                         f"source; got {head}")
    _require_matplotlib()


def plot_example(
    *, source: str = "synthetic", q_blocks: int = 128, kv_blocks: int = 128,
    block_size: int = 128, stride: int = 16, alpha: float = 1.0, preset: str = "tight",
    batch: int = 0, head: int = 0, seed: int = 0, path: str | Path = "stem_block_map.png",
) -> dict[str, int]:
    """Run the indexer on an example and draw one head's map (``stem-indexer plot``).

    ``source="synthetic"`` runs ``stem_inputs`` on the quality evaluation's
    synthetic Q/K/V (1 batch, 4 query heads; planted needles show up as
    isolated top-k picks far from the diagonal), keeping the last
    ``q_blocks`` query blocks; ``"random"`` uses random block representations
    in the article's example shape (4 batches, 64 query heads, 8 KV heads,
    Df = stride * 128). Both use 4 sink and 4 window blocks; ``preset``
    names the budget (``stem_indexer.PRESETS``; every preset keeps every
    block below 56 prompt blocks).

    Returns:
        The ``block_kind_counts`` of the drawn map.
    """
    from ..operator.api import stem_indexer
    from ..operator.contract import PRESETS, fail

    if preset not in PRESETS:
        fail("plot_example", "preset", f"must be one of {', '.join(map(repr, PRESETS))}",
             repr(preset))
    check_example(source=source, q_blocks=q_blocks, kv_blocks=kv_blocks, block_size=block_size,
                  stride=stride, batch=batch, head=head)
    q_len, kv_len = q_blocks * block_size, kv_blocks * block_size
    if source == "random":
        gen = torch.Generator().manual_seed(seed)
        b, nq, nk, d = 4, 64, 8, 128
        qflat = torch.randn(b, nq, q_blocks, stride * d, generator=gen).to(torch.bfloat16)
        kflat = torch.randn(b, nk, kv_blocks, stride * d, generator=gen).to(torch.bfloat16)
        vbias = torch.randn(b, nk, kv_blocks, generator=gen)
        q_lens = torch.full((b,), q_len, dtype=torch.int32)
        kv_lens = torch.full((b,), kv_len, dtype=torch.int32)
        what = "random qflat/kflat/vbias"
    else:
        from ..pipeline.prepare import stem_inputs
        from ..testing.quality import synthetic_workload

        work = synthetic_workload(seq_len=kv_len, block_size=block_size, stride=stride, seed=seed)
        inputs = stem_inputs(work.q[:, :, kv_len - q_len:], work.k, work.v,
                             stem_block_size=block_size, stem_stride=stride,
                             scale=work.scale / stride)
        qflat, kflat, vbias = inputs.qflat, inputs.kflat, inputs.vbias
        q_lens, kv_lens = inputs.q_seq_lens, inputs.kv_seq_lens
        what = "synthetic Q/K/V with needles"
    indices, seq_len = stem_indexer(qflat, kflat, vbias, q_lens, kv_lens, causal=True,
                                    stem_block_size=block_size, stem_stride=stride, alpha=alpha,
                                    **PRESETS[preset])
    title = (f"Stem selection ({what}), batch {batch}, head {head}, preset {preset}, "
             f"alpha {alpha:g}, blocks of {block_size} tokens")
    return plot_block_map(indices, seq_len, batch=batch, head=head, q_len=q_len, kv_len=kv_len,
                          block_size=block_size, path=path, title=title)
