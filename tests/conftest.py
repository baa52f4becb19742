"""Shared fixtures: offline environment, the real data folder, tiny and real models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def pytest_configure(config):
    """Under pytest-xdist each worker runs torch on one intra-op thread: the workers already fill
    the cores, and two threads per worker on a 2-core machine only add spin-waits."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


def pytest_report_header(config):
    """The CPU kernels the results came from (``ATEN_CPU_CAPABILITY`` picks lower ones)."""
    return (f"torch {torch.__version__}: CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} intra-op threads")


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (restored after): per-token loops of tiny ops only gain
    spin-waits from a second thread (up to 50x slower on a shared 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer (the converted checkpoint; skips where the model package is absent)."""
    from transformers import AutoTokenizer

    from kvbench.model.loading import ModelNotFound, smollm2_checkpoint

    try:
        return AutoTokenizer.from_pretrained(smollm2_checkpoint())
    except ModelNotFound as err:
        pytest.skip(str(err))


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is absent (only on the project's own machines)")
    return SHARED_DATA


def tiny_llama(seed: int = 0, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16):
    """A random Llama built in memory (GQA, RoPE): seconds, no files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=heads * head_dim,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).eval()
    return model


def save_tiny_checkpoint(path: Path, tokenizer, max_positions: int, **config) -> Path:
    """A random 2-layer GQA Llama (head_dim 16, seed 0) with ``tokenizer``, saved to ``path`` like
    any local checkpoint (``model.path=``); ``config`` adds LlamaConfig fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=max_positions, **config,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def configured_method(model, name, options, bpd, v_bpd, stats, seed: int = 0):
    """A registered method configured for ``model``'s shape and calibrated on ``stats``."""
    from kvbench.model.integrate import model_shape
    from methods import build_method

    method = build_method(name, **options)
    method.configure(model_shape(model), bpd, v_bpd)
    if method.needs_calibration:
        method.calibrate(stats, seed=seed)
    return method


@pytest.fixture
def tiny_model():
    return tiny_llama()


def tiny_tokenizer(vocab_size: int = 128):
    """A word-level tokenizer over ``w0 .. w{vocab_size-1}`` built in memory (no files): any other
    word is ``w0`` (unk); ``w1`` is EOS and padding. Enough for lm-eval's HFLM over tiny_llama."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="w0", eos_token="w1", pad_token="w1"
    )


class OneByOne:
    """A mixin for CompressedLM stand-ins that answer one prompt at a time (``generate``,
    ``generate_query_agnostic``): ``generate_rows`` asks them row by row, in row order."""

    def generate_rows(self, prompts, max_new_tokens, stop_ids=(), n_context=None):
        out = []
        for p, n in zip(prompts, n_context or [None] * len(prompts)):
            ids = torch.as_tensor(p, dtype=torch.long).reshape(1, -1)
            if n is None:
                out.append(self.generate(ids, max_new_tokens, stop_ids))
            else:
                out.append(self.generate_query_agnostic(ids, n, max_new_tokens, stop_ids))
        return out


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (converted once into $KVBENCH_CACHE)."""
    from kvbench.model.loading import load_model

    return load_model("smollm2_135m", embedded=True)
