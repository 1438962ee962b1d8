"""Integrations of Stem attention with other libraries.

Each integration lives in its own module and imports its library only when
that module is imported, so that ``stem_indexer`` itself needs nothing but
torch:

* ``stem_indexer.integrations.transformers``: ``attn_implementation="stem"``
  for Hugging Face transformers models (``pip install 'stem-indexer[hf]'``).
"""
