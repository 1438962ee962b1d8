"""What users' own tests (and ``stem-indexer verify``) may import: not the operator.

* ``cases``: the numbered, append-only case table (ids ``SI_WB_NNN``) shared
  by the tests, ``verify`` and the benchmarks;
* ``compare``: two indexer outputs compared the way the reference test
  framework does (exact where scores are exact, else within float rounding
  of each row's selection threshold);
* ``runner``: single and batch modes, eager and graph, against the golden
  (``stem_indexer.operator.reference``), selected by ``STEM_INDEXER_CASE_ID``,
  ``STEM_INDEXER_MODE`` and ``STEM_INDEXER_DEVICE``;
* ``attention``: ``reference_attention``, the float64 softmax attention
  every attention path is tested against, and ``token_mask``, the token mask
  a block selection means;
* ``quality``: how much attention a selection keeps (density, mass recall,
  output error, needle recall) on synthetic or model workloads.

Nothing here is imported by ``import stem_indexer``.
"""

from .attention import reference_attention, token_mask

__all__ = ["reference_attention", "token_mask"]
