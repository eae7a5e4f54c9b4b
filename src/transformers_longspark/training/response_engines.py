"""The engines that write the target's responses for `longspark regenerate`: transformers' batched `generate`, or
vLLM's offline engine (`LLM.generate`), as users regenerate at scale.

Both take a batch of chat-templated prompts, one seed per prompt and the `Sampling` settings, and return each
response's token ids, up to and including the first EOS. Greedy decoding (`temperature=0`) gives the same tokens on
both in float32 (tested); sampled responses follow the same law (temperature, then top-k, then top-p) but draw from
different generators, so a record's response depends on the engine, never on the batch it was generated in.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

ENGINES = ("transformers", "vllm")
# vLLM's CPU backend otherwise reserves 92% of a memory node at start-up (see `vllm/run.py`).
VLLM_KV_CACHE_BYTES = 2 << 30


@dataclass(frozen=True)
class Sampling:
    """How responses are drawn: `temperature` (0: greedy), then top-k (0: off) and top-p (1: off), at most
    `max_new_tokens` tokens each."""

    max_new_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20

    def __post_init__(self) -> None:
        problems = [
            f"{name}={value!r} ({rule})"
            for name, value, ok, rule in (
                ("max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 1, "at least 1"),
                ("temperature", self.temperature, self.temperature >= 0, "0 for greedy, or positive"),
                ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]; 1 disables it"),
                ("top_k", self.top_k, self.top_k >= 0, "0 disables it"),
            )
            if not ok
        ]
        if problems:
            raise ValueError(f"Invalid sampling settings: {'; '.join(problems)}.")


class GumbelSampler(LogitsProcessor):
    """Samples with a separate random generator per row by adding Gumbel noise to the (warped) log-probabilities.

    ``argmax(scores + Gumbel noise)`` is an exact sample from ``softmax(scores)``, so greedy decoding after this
    processor samples like ``do_sample=True`` does, but every row draws from its own ``torch.Generator`` seeded
    with its record's seed: a record's response does not depend on the batch it was generated in.
    """

    def __init__(self, seeds: Sequence[int]):
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab = scores.shape[-1]
        uniform = torch.stack([torch.rand(vocab, generator=generator) for generator in self.generators])
        uniform = uniform.clamp_(min=torch.finfo(uniform.dtype).tiny, max=1.0 - torch.finfo(uniform.dtype).eps)
        return scores + (-torch.log(-torch.log(uniform))).to(device=scores.device, dtype=scores.dtype)


def trim_response(token_ids: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """Cuts a generated row after its first EOS token (dropping the padding after it)."""
    for position, token in enumerate(token_ids):
        if token in eos_ids:
            return list(token_ids[: position + 1])
    return list(token_ids)


def special_ids(generation_config: GenerationConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], int]:
    """The EOS ids that end a response (the target's generation config, else its tokenizer), and the padding id."""
    eos = generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("Neither the target's generation config nor its tokenizer defines an EOS token.")
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    pad = generation_config.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id
    return eos_ids, eos_ids[0] if pad is None else pad


class TransformersEngine:
    """Responses from `model.generate` on left-padded batches, each row sampled from its own seeded generator."""

    name = "transformers"

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase):
        self.model = model
        self.target = str(getattr(model, "name_or_path", ""))
        self.dtype = str(model.dtype).removeprefix("torch.")
        self.eos_ids, self.pad_id = special_ids(model.generation_config, tokenizer)

    @staticmethod
    def _processors(s: Sampling, seeds: Sequence[int]) -> LogitsProcessorList:
        """Warpers as `generate(do_sample=True)` builds them, then per-row Gumbel sampling; empty for greedy."""
        if s.temperature == 0:
            return LogitsProcessorList()
        processors: list[LogitsProcessor] = [TemperatureLogitsWarper(s.temperature)] if s.temperature != 1.0 else []
        if s.top_k:
            processors.append(TopKLogitsWarper(s.top_k))
        if s.top_p < 1.0:
            processors.append(TopPLogitsWarper(s.top_p))
        return LogitsProcessorList([*processors, GumbelSampler(seeds)])

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[list[int]], seeds: Sequence[int], sampling: Sampling) -> list[list[int]]:
        width = max(map(len, prompt_ids))
        input_ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(prompt_ids):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        output = self.model.generate(
            input_ids=input_ids.to(self.model.device),
            attention_mask=attention_mask.to(self.model.device),
            generation_config=GenerationConfig(
                max_new_tokens=sampling.max_new_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_ids,
            ),
            logits_processor=self._processors(sampling, seeds),
        )
        return [trim_response(row[width:].tolist(), self.eos_ids) for row in output]


class VLLMEngine:
    """Responses from vLLM's offline engine: one `LLM` for the run, one `SamplingParams` (with its seed) per prompt.

    vLLM is imported here, so this runs in the environment where it is installed (`scripts/install_vllm.sh`:
    `.venv-vllm/bin/longspark regenerate --engine vllm ...`). `max_batch_tokens` is the engine's token budget per
    step; a batch whose prompts exceed it is generated in parts, so that each part's prefill runs in one step: vLLM
    0.32's CPU runner fails on seeded requests whose prefill is split ("CPU Generator does not use offset").
    """

    name = "vllm"

    def __init__(
        self,
        target: str | os.PathLike,
        tokenizer: PreTrainedTokenizerBase,
        *,
        dtype: str = "float32",
        max_batch_tokens: int = 32768,
        max_model_len: int = 4096,
        kv_cache_bytes: int = VLLM_KV_CACHE_BYTES,
    ):
        try:
            import vllm  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "--engine vllm needs vLLM, which lives in its own environment: run `bash scripts/install_vllm.sh`, "
                "then `.venv-vllm/bin/longspark regenerate --engine vllm ...` (or keep --engine transformers)."
            ) from error
        self.max_batch_tokens, self.dtype = max_batch_tokens, dtype
        self.target = os.fspath(target)
        self.eos_ids, _ = special_ids(GenerationConfig.from_pretrained(self.target), tokenizer)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # vLLM's CPU backend keeps one core for its front end unless told otherwise; an offline batch run has no
        # server to serve, and on a small machine that core is much of the compute (2 cores: 1.9x the tokens/s).
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        # A step of a large batch on a small, shared CPU can outlast vLLM's 300 s limit, which kills the engine.
        os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
        # Started at the first batch to sample: a run whose records all come from archives never waits for it.
        self._llm_options = dict(
            dtype=dtype,
            enforce_eager=True,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_batch_tokens,
            kv_cache_memory_bytes=kv_cache_bytes,
        )
        self._llm: Any = None

    @property
    def llm(self) -> Any:
        """vLLM's `LLM` on the target (started on first use)."""
        if self._llm is None:
            from vllm import LLM

            self._llm = LLM(self.target, **self._llm_options)
        return self._llm

    def generate(self, prompt_ids: Sequence[list[int]], seeds: Sequence[int], sampling: Sampling) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(prompt_ids) > 1 and sum(map(len, prompt_ids)) + len(prompt_ids) > self.max_batch_tokens:
            half = len(prompt_ids) // 2  # one step must hold the whole batch's prefill: split it
            return self.generate(prompt_ids[:half], seeds[:half], sampling) + self.generate(
                prompt_ids[half:], seeds[half:], sampling
            )
        options: dict[str, Any] = dict(
            max_tokens=sampling.max_new_tokens, stop_token_ids=self.eos_ids, temperature=sampling.temperature
        )
        if sampling.temperature > 0:
            options.update(top_p=sampling.top_p, top_k=sampling.top_k or -1)
        params = [SamplingParams(**options, seed=seed) for seed in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids], params,
                                    use_tqdm=False)  # fmt: skip
        return [trim_response(output.outputs[0].token_ids, self.eos_ids) for output in outputs]


__all__ = ["ENGINES", "GumbelSampler", "Sampling", "TransformersEngine", "VLLMEngine", "special_ids", "trim_response"]
