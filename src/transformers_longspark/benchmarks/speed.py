"""Decoding speed side by side, on the same prompts, interleaved: the plain paths, prompt lookup, LongSpark (what each
of its sources adds, and A/B variants) and the full-prefix drafter (`settings.METHOD_LABELS`).

A *round* is one target verification forward after the prefill; `tau = (new tokens - 1) / rounds`
(`inference.stats.tau`): the prefill yields the first new token and every round the accepted drafts plus one, so plain
`generate`'s tau is 1. Prompt lookup may already verify candidates with the prefill (`tokens_per_forward` counts that
exactly). Speculative methods verify on the fast path, which speeds up plain decoding too, so every speedup is also
reported over the fastest plain path of the same run (`speed_summary.add_speedups`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from ..inference.calibration import calibration_for_generate
from ..inference.knobs import DraftingKnobs, pinned_costs
from ..inference.verification import fast_verification
from ..modeling_longspark import LongSparkDrafterModel
from ..packed_linear import drafter_linear_dtype
from .common import generate_kwargs, machine_info, pad_token_id, time_forward_calls, timed_call
from .models import make_full_prefix_drafter
from .settings import DRAFTER_METHODS, DRAFTER_SWITCHES, METHODS, PLAIN_METHODS, SpeedSettings
from .speed_summary import add_speedups, summarize_runs

# Methods without a drafter that `generate` runs inside `fast_verification`, with a cache of reserved rows.
FAST_PATH_METHODS = ("plain_fast", "prompt_lookup_fast")
# Devices on which `generate` compiles the decoding step of a static cache (transformers'
# `_valid_auto_compile_criteria`). There `plain_static` gets one cache size for the whole run (the longest prompt's),
# so that the graph compiled in the warm-up serves every call; elsewhere the cache is sized per call.
AUTO_COMPILE_DEVICES = ("cuda", "xpu", "neuron", "tpu")
_ABSENT = object()


@contextlib.contextmanager
def drafter_settings(drafter: LongSparkDrafterModel, settings: Mapping[str, Any]) -> Iterator[None]:
    """Applies `settings` to `drafter` inside the block, then restores them, exceptions included: its
    `fast_verification` and `packed_weights` (default True), its `linear_dtype` if given (a torch dtype, its name, or
    "auto"), and any other key as a field of its `generation_config` (one it lacked is removed again)."""
    config, switches = drafter.generation_config, {**DRAFTER_SWITCHES, "linear_dtype": drafter.linear_dtype}
    config_fields = {name: value for name, value in settings.items() if name not in switches}
    previous = {name: getattr(drafter, name) for name in switches}
    previous_fields = {name: vars(config).get(name, _ABSENT) for name in config_fields}
    for name, default in switches.items():
        value = settings.get(name, default)
        if name == "linear_dtype" and isinstance(value, str) and value != "auto":
            value = getattr(torch, value, value)  # "qint8" -> torch.qint8; a wrong name is refused by generate
        setattr(drafter, name, value)
    for name, value in config_fields.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(drafter, name, value)
        for name, value in previous_fields.items():
            if value is _ABSENT:
                delattr(config, name)
            else:
                setattr(config, name, value)


def _as_prompt(prompt: Any, index: int) -> dict[str, Any]:
    """`{"name", "input_ids": [...], ...metadata}` of a prompt given as such a dict, a tensor `(t,)` or token ids."""
    metadata = dict(prompt) if isinstance(prompt, Mapping) else {"input_ids": prompt}
    ids = metadata["input_ids"]
    ids = ids.flatten().tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return {**metadata, "name": metadata.get("name", f"prompt-{index}"), "input_ids": ids}


@dataclass
class _Runner:
    """What every run of one benchmark shares, and one timed `generate` call (`run`)."""

    target: PreTrainedModel
    device: torch.device
    drafters: dict[str, LongSparkDrafterModel]
    drafter_settings: dict[str, dict[str, Any]]
    pad_token_id: int | None
    settings: SpeedSettings
    static_cache_len: int | None  # None: each static cache sized for its own call
    # The row counts the fast path runs on packed weights (`fast_verification`'s `blas_max_rows`, `max_packed_rows`)
    # as this machine's calibration measured them for LongSpark: the plain fast-path methods use the same kernels.
    packed_rows: dict[str, int] = field(default_factory=dict)

    @contextlib.contextmanager
    def decoding(self, method: str, mode: str, max_new_tokens: int, prompt_length: int) -> Iterator[dict[str, Any]]:
        """`generate`'s keyword arguments for one call of `method` in `mode`, inside the decoding path it runs on."""
        settings, target, path = self.settings, self.target, contextlib.nullcontext()
        kwargs = generate_kwargs(mode, max_new_tokens, settings, self.pad_token_id)
        if method in ("prompt_lookup", "prompt_lookup_fast"):
            kwargs["prompt_lookup_num_tokens"] = settings.prompt_lookup_num_tokens
        elif method in self.drafters:
            kwargs["assistant_model"] = self.drafters[method]
            path = drafter_settings(self.drafters[method], self.drafter_settings[method])
        elif method == "plain_static":
            kwargs["cache_implementation"] = "static"
            if self.static_cache_len is not None:
                kwargs["max_cache_len"] = self.static_cache_len
            # `generate` sizes a static cache for the longest call so far; sized for this call (or `max_cache_len`)
            # instead, a short prompt does not attend over the masked rows of a longer earlier one.
            vars(target).pop("_previous_max_cache_length", None)
        elif method not in PLAIN_METHODS:
            raise ValueError(f"Unknown method {method!r}; choose from {', '.join([*METHODS, *self.drafters])}.")
        if method in FAST_PATH_METHODS:
            # From outside `generate` only the attention can be switched, unless the cache is passed in: then its
            # layers get reserved rows too: the prompt's and the new tokens' (for prompt lookup, room for the last
            # round's candidates and bonus token too).
            cache = kwargs["cache"] = DynamicCache(config=target.config)
            candidates = kwargs.get("prompt_lookup_num_tokens", 0)
            rows = prompt_length + max_new_tokens + (candidates + 1 if candidates else 0)
            path = fast_verification(target, cache, rows, **self.packed_rows)
        with path:
            yield kwargs

    def run(self, input_ids: torch.LongTensor, method: str, mode: str, max_new_tokens: int, seed: int | None):
        """One timed `generate` call of `method` on `input_ids` `(1, t)`: tokens, seconds, target forwards and
        their times, and for drafters the drafting stats (lookup rounds and per-position acceptance included)."""
        if seed is not None:
            torch.manual_seed(seed)
        target, device, drafter = self.target, self.device, self.drafters.get(method)
        with (
            self.decoding(method, mode, max_new_tokens, input_ids.shape[1]) as kwargs,
            time_forward_calls(target, device) as calls,
        ):
            seconds, output = timed_call(
                lambda: target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs), device=device
            )
        new_ids = output[0, input_ids.shape[1] :].tolist()
        run = {
            "new_tokens": len(new_ids),
            "seconds": seconds,
            "target_forwards": len(calls),
            "rounds": len(calls) - 1,
            "prefill_seconds": calls[0] if calls else 0.0,
            "verify_seconds": sum(calls[1:]),
            "new_ids": new_ids,
        }
        if drafter is not None:
            stats = drafter.drafting_stats
            run.update(asdict(stats), acceptance_rates=stats.acceptance_rates())
        return run


def _run_prompts(runner: _Runner, items, names, mode: str, max_new_tokens: int, seed: int, bar, workload: str):
    """Runs every method of `names` on every prompt of `items`, back to back per prompt in an order rotated from
    prompt to prompt (A/B/A/B interleaving). Greedy runs are compared with plain `generate`'s output
    (`identical_to_plain`). Returns `{method: [run per prompt]}`."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for index, prompt in enumerate(items):
        input_ids = torch.tensor([prompt["input_ids"]], device=runner.device)
        shift = index % len(names)
        for method in names[shift:] + names[:shift]:
            bar.set_postfix_str(f"{workload} {mode} {prompt['name']} ({input_ids.shape[1]} tokens) {method}")
            run = runner.run(input_ids, method, mode, max_new_tokens, seed + index if mode == "sampled" else None)
            run.update(prompt=prompt["name"], prompt_tokens=input_ids.shape[1])
            runs[method].append(run)
            bar.update(1)
        if mode == "greedy":
            reference = runs["plain"][-1]["new_ids"]
            for method in names:
                runs[method][-1]["identical_to_plain"] = runs[method][-1]["new_ids"] == reference
    return runs


def run_speed_benchmark(
    target: PreTrainedModel,
    drafter: LongSparkDrafterModel,
    prompts: Mapping[str, Sequence[Any]] | Sequence[Any],
    settings: SpeedSettings | None = None,
    *,
    drafter_info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every method of `settings` on the same prompts, interleaved (`_run_prompts`).

    Args:
        prompts: `{workload: [prompt, ...]}` or one list (workload `"prompts"`). A prompt is a dict with `input_ids`
            (and optional `name`/metadata), a 1-D tensor `(t,)` or a list of token ids.
        drafter_info: what the report says of the drafter (its folder, whether it is trained).

    Returns:
        `{"machine", "settings", "drafter", "workloads": {name: {"prompts": [...], mode: {"methods": {method:
        summary}, "runs": [...]}}}, "rows": [flat summaries with workload and mode]}`.
    """
    settings = settings or SpeedSettings()
    workloads = dict(prompts) if isinstance(prompts, Mapping) else {"prompts": prompts}
    workloads = {name: [_as_prompt(p, i) for i, p in enumerate(items)] for name, items in workloads.items()}
    workloads = {name: items for name, items in workloads.items() if items}
    if not workloads:
        raise ValueError("No prompts to benchmark.")
    modes, max_new_tokens, seed, variants = settings.modes, settings.max_new_tokens, settings.seed, settings.variants
    per_mode = settings.methods_per_mode()
    device = next(target.parameters()).device
    drafters = {name: drafter for name in [*DRAFTER_METHODS, *variants] if name != "full_prefix"}
    if any("full_prefix" in names for names in per_mode.values()):
        drafters["full_prefix"] = make_full_prefix_drafter(drafter)
    longest = max(len(p["input_ids"]) for items in workloads.values() for p in items)
    static_cache_len = longest + max_new_tokens if device.type in AUTO_COMPILE_DEVICES else None
    methods_settings = {**DRAFTER_METHODS, **variants}
    calibration = calibration_for_generate(target, drafter)
    rows = {} if calibration is None else calibration.fast_path_rows
    runner = _Runner(target, device, drafters, methods_settings, pad_token_id(target), settings, static_cache_len, rows)

    num_runs = sum(len(items) * len(per_mode[mode]) for items in workloads.values() for mode in modes)
    num_warmups = sum(len(per_mode[mode]) for mode in modes) if settings.warmup else 0
    bar = tqdm(total=num_warmups + num_runs, desc="speed", unit="run", disable=not settings.progress)
    if settings.warmup:
        input_ids = torch.tensor([next(iter(workloads.values()))[0]["input_ids"]], device=device)
        for mode in modes:
            for method in per_mode[mode]:
                bar.set_postfix_str(f"warm-up {mode} {method}")
                runner.run(input_ids, method, mode, min(max_new_tokens, 8), seed)
                bar.update(1)

    report_workloads: dict[str, Any] = {}
    rows = []
    for workload, items in workloads.items():
        info = [
            {**{k: v for k, v in p.items() if k != "input_ids"}, "prompt_tokens": len(p["input_ids"])} for p in items
        ]
        entry: dict[str, Any] = {"prompts": info}
        for mode in modes:
            runs = _run_prompts(runner, items, per_mode[mode], mode, max_new_tokens, seed, bar, workload)
            summaries = {method: summarize_runs(method_runs, method) for method, method_runs in runs.items()}
            add_speedups(summaries)
            rows += [{"workload": workload, "mode": mode, **summary} for summary in summaries.values()]
            for run in (run for method_runs in runs.values() for run in method_runs):
                run.pop("new_ids")
            entry[mode] = {"methods": summaries, "runs": runs}
        report_workloads[workload] = entry
    bar.close()

    return {
        "benchmark": "speed",
        "machine": machine_info(device),
        "settings": {
            "max_new_tokens": max_new_tokens,
            "modes": list(modes),
            "methods": per_mode,
            "temperature": settings.temperature,
            "prompt_lookup_num_tokens": settings.prompt_lookup_num_tokens,
            "variants": {name: _json_settings(changed) for name, changed in variants.items()},
            "static_cache_len": static_cache_len or "per call",
            **{name: getattr(settings, name) for name in ("ignore_eos", "warmup", "seed")},
            "dtype": str(next(target.parameters()).dtype),
            "target": getattr(target.config, "_name_or_path", "") or type(target).__name__,
        },
        "drafter": {
            **(drafter_info or {"block_size": drafter.config.block_size}),
            "linear_dtype": str(drafter_linear_dtype(drafter)),
            "costs": _planned_costs(target, drafter),
        },
        "workloads": report_workloads,
        "rows": rows,
    }


def _json_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    return {name: str(value) if isinstance(value, torch.dtype) else value for name, value in settings.items()}


def _planned_costs(target: PreTrainedModel, drafter: LongSparkDrafterModel) -> dict[str, Any]:
    """The cost model the drafter's own settings planned with in this run: its calibration, or its fields."""
    calibration = calibration_for_generate(target, drafter)
    if calibration is None:
        costs = DraftingKnobs.from_generation_config(drafter.generation_config).costs
        return {"source": "generation_config", **asdict(costs)}
    costs = pinned_costs(calibration.costs, drafter.generation_config)
    return {"source": "calibration", **calibration.fast_path_rows, **asdict(costs)}
