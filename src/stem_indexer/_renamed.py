"""Old spellings of public arguments, accepted for one release with a
DeprecationWarning.

The package spells the indexer's block size and stride ``stem_block_size``
and ``stem_stride`` everywhere: the operator's schema (fixed by the original
extension), ``IndexerParams``, ``stem_indexer()``, ``stem_attention``, the
FlashAttention-style functions and ``integrations.transformers.register``.
``stem_inputs`` and ``block_sparse_attention`` took ``block_size`` /
``stride``; those names still work until the next release.
"""

from __future__ import annotations

import warnings

import torch

from .contract import fail

# old spelling -> the package's spelling
RENAMED = {"block_size": "stem_block_size", "stride": "stem_stride"}


def warn_deprecated(message: str, stacklevel: int = 3) -> None:
    """A DeprecationWarning for an old spelling, outside torch.compile only
    (dynamo cannot trace ``warnings.warn`` with ``fullgraph=True``; the eager
    run of the same code warns)."""
    if not torch.compiler.is_compiling():
        warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)


def take_renamed(who: str, old_kwargs: dict, values: dict, defaults: dict) -> dict:
    """``values`` (the new names' values as passed, ``defaults`` where not
    passed) with any old spelling in ``old_kwargs`` (the function's ``**``
    catch-all) taken in its place, warned. Anything else in ``old_kwargs``,
    or an old spelling given with its new name set too, is refused."""
    out = dict(values)
    for old, value in old_kwargs.items():
        new = RENAMED.get(old)
        if new not in values:
            fail(who, old, f"is not an argument of {who}", repr(value))
        if values[new] != defaults.get(new):
            fail(who, old, f"is the old spelling of {new}; pass {new} alone", repr(value))
        warn_deprecated(f"{who}: {old} is now spelled {new}, as everywhere in the package; "
                        f"the old name goes in the next release")
        out[new] = value
    return out
