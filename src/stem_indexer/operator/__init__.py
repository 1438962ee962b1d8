"""The operator: the two ops' contract, their scalar reference, the metadata
work plan, their plainly named Python functions (``api.py``) and the kernels
(``ops/``: CPU C kernels in ``ops/csrc/``, Triton in ``ops/triton/``).

The lowest layer: it imports nothing else of the package. Its private modules
(``_env.py``: environment variables, ``_files.py``: atomic writes and trusted
files, ``_threads.py``: thread-count settings) live here because the kernels
use them; higher layers may import them too.
"""
