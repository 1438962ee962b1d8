"""The pipeline: Q/K/V to the indexer's inputs (``prepare.py``), plans
(``plan.py``), the choice of kernel (``dispatch.py``), block-sparse, dense and
sliding-window attention, argument checks, and an engine's paged KV cache
(``paged.py``, ``index_cache.py``).

It imports the operator (``stem_indexer.operator``), never the surfaces, the
integrations or ``stem_indexer.testing``.
"""
