"""Model loading offline (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import pytest

from kvbench.model.loading import ModelNotFound, load_model, resolve_dtype


def test_hub_model_offline_fails_at_once_with_advice(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelNotFound, match="model.path"):
        load_model("llama3_8b", hf_id="meta-llama/Llama-3.1-8B")


def test_bad_local_path(tmp_path):
    with pytest.raises(ModelNotFound, match="config.json"):
        load_model("x", path=str(tmp_path))


def test_dtype_choices():
    import torch

    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="valid choices"):
        resolve_dtype("fp8", torch.device("cpu"))


@pytest.mark.slow
def test_embedded_smollm2_is_the_real_model(smollm2):
    cfg = smollm2.model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = smollm2.model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in smollm2.tokenizer.decode(out[0, ids.shape[1]:])
