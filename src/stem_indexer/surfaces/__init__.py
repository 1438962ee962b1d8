"""The surfaces: what users call by name, built on the pipeline:
``stem_attention`` (``attention.py``), the FlashAttention conventions
(``flash.py``), the ``stem-indexer`` command (``cli.py``) and its plots
(``plot.py``).

It imports the pipeline, the operator and ``stem_indexer.testing`` (the
command runs the test cases), never the integrations.
"""
