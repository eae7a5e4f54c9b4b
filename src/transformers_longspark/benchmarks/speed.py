"""Decoding speed side by side: the plain paths, prompt lookup, LongSpark (and what each of its sources adds) and the
full-prefix drafter.

Definitions. A *round* is one target verification forward after the prefill. `tau = (new tokens - 1) / rounds`
(`inference.stats.tau`): the prefill forward yields the first new token and every round adds the accepted draft tokens
plus one. Plain `generate` runs one forward per token, so its tau is 1. For prompt lookup, rounds are counted as
target forward calls minus one (it may already verify candidates with the prefill, which the `tokens_per_forward`
column, new tokens / target forwards, accounts for exactly).

Fair baselines. Speculative methods verify on the fast path (`verification.py`: reserved cache rows, grouped-head
attention), which also speeds up plain decoding. So every speedup is reported twice: over stock `generate` (`plain`)
and over the fastest plain path of the same run (`speedup_vs_best_plain`): `plain`, `plain_fast` (plain `generate`
inside `fast_verification` with a `DynamicCache` reserved for the prompt and the new tokens) and `plain_static`
(transformers' static cache, `cache_implementation="static"`).

Attribution. `longspark` runs as users get it: the fast verification path and the drafter's own generation config
(confidence thresholds, lookup source, cost model). `longspark_drafter_only` is the drafter alone (lookup off, costs 0:
every round drafts), `longspark_lookup_only` the lookup source alone (the drafter priced out), `longspark_no_proposals`
neither (every round a plain step: what the fast path costs by itself), and `prompt_lookup_fast` stock prompt lookup
inside `fast_verification`.

Before and after. A *variant* is LongSpark with some settings changed, run as one more method of the same run
(`variants={"whole_blocks": {"assistant_confidence_threshold": 0, "block_confidence_threshold": 0}}`, or on the
command line `--variant whole_blocks assistant_confidence_threshold=0 block_confidence_threshold=0`): any field of
the drafter's generation config (`inference/knobs.py`), and its switches `fast_verification`, `packed_weights` and
`linear_dtype` (`drafter_settings`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from ..inference.calibration import costs_for_generate
from ..inference.knobs import DraftingKnobs
from ..inference.verification import fast_verification
from ..modeling_longspark import LongSparkDrafterModel
from ..packed_linear import drafter_linear_dtype
from .common import generation_config_fields, machine_info, time_forward_calls, timed_call
from .defaults import DRAFTER_METHODS, METHODS, MODES, PLAIN_METHODS
from .models import make_full_prefix_drafter
from .prompts import chat_prompt_ids
from .speed_summary import METHOD_LABELS, add_round_costs, add_speedups, new_tokens_from_round_log, summarize_runs

# Which methods run in which decoding mode by default (the full-prefix baseline is measured greedily).
DEFAULT_METHODS = {"greedy": METHODS, "sampled": tuple(m for m in METHODS if m != "full_prefix")}
# Methods without a drafter that `generate` runs inside `fast_verification`, with a cache of reserved rows.
FAST_PATH_METHODS = ("plain_fast", "prompt_lookup_fast")
# Devices on which `generate` compiles the decoding step of a static cache (transformers'
# `_valid_auto_compile_criteria`). There `plain_static` gets one cache size for the whole run (the longest prompt's),
# so that the graph compiled in the warm-up serves every call; elsewhere the cache is sized per call.
AUTO_COMPILE_DEVICES = ("cuda", "xpu", "neuron", "tpu")

Prompt = Mapping[str, Any]
"""A benchmark prompt: `{"name": str, "input_ids": list[int], ...metadata}`."""


# The drafter attributes a method may set (`drafter_settings`), with what they are outside one.
DRAFTER_SWITCHES = {"fast_verification": True, "packed_weights": True, "linear_dtype": "auto"}


@contextlib.contextmanager
def drafter_settings(drafter: LongSparkDrafterModel, settings: Mapping[str, Any]) -> Iterator[None]:
    """Applies `settings` to `drafter` inside the block, then restores them: its `fast_verification` and
    `packed_weights` (default True), its `linear_dtype` if given (a torch dtype, its name, or "auto"), and any other
    key as a field of its `generation_config`."""
    switches = {**DRAFTER_SWITCHES, "linear_dtype": drafter.linear_dtype}
    previous = {name: getattr(drafter, name) for name in switches}
    for name, default in switches.items():
        value = settings.get(name, default)
        if name == "linear_dtype" and isinstance(value, str) and value != "auto":
            value = getattr(torch, value, value)  # "qint8" -> torch.qint8; a wrong name is refused by generate
        setattr(drafter, name, value)
    fields = {name: value for name, value in settings.items() if name not in switches}
    try:
        with generation_config_fields(drafter, fields):
            yield
    finally:
        for name, value in previous.items():
            setattr(drafter, name, value)


def check_variant(name: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` of the variant `name`, checked before any forward: a new name, known keys, valid knob values."""
    if name in METHODS:
        raise ValueError(f"Variant name {name!r} is a method already; name the variant for what it changes.")
    knobs = {field.name for field in fields(DraftingKnobs)}
    unknown = sorted(set(settings) - knobs - set(DRAFTER_SWITCHES))
    if unknown:
        raise ValueError(
            f"Variant {name!r}: unknown settings {unknown}; use fields of the drafter's generation config "
            f"({', '.join(sorted(knobs))}) or {', '.join(DRAFTER_SWITCHES)}."
        )
    DraftingKnobs(**{key: value for key, value in settings.items() if key in knobs})  # raises naming a bad value
    return dict(settings)


def _as_prompt(prompt: Any, tokenizer, index: int) -> dict[str, Any]:
    if isinstance(prompt, Mapping):
        if "input_ids" in prompt:
            ids = prompt["input_ids"]
            ids = ids.flatten().tolist() if isinstance(ids, torch.Tensor) else list(ids)
            return {**prompt, "name": prompt.get("name", f"prompt-{index}"), "input_ids": ids}
        if "messages" in prompt:
            return {"name": f"prompt-{index}", **prompt, "input_ids": chat_prompt_ids(tokenizer, prompt["messages"])}
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("Text prompts need a tokenizer; pass token ids instead.")
        return {"name": f"prompt-{index}", "input_ids": tokenizer(prompt)["input_ids"]}
    if isinstance(prompt, torch.Tensor):
        return {"name": f"prompt-{index}", "input_ids": prompt.flatten().tolist()}
    return {"name": f"prompt-{index}", "input_ids": list(prompt)}


@dataclass
class _Runner:
    """What every run of one benchmark shares, and one timed `generate` call (`run`)."""

    target: PreTrainedModel
    device: torch.device
    drafters: dict[str, LongSparkDrafterModel]
    drafter_settings: dict[str, dict[str, Any]]
    pad_token_id: int | None
    temperature: float
    prompt_lookup_num_tokens: int
    ignore_eos: bool
    static_cache_len: int | None  # None: each static cache sized for its own call

    def generate_kwargs(self, method: str, mode: str, max_new_tokens: int) -> dict[str, Any]:
        """`generate`'s keyword arguments for one call of `method` in `mode`."""
        kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=mode == "sampled")
        if self.pad_token_id is not None:
            kwargs["pad_token_id"] = self.pad_token_id
        if mode == "sampled":
            # Plain temperature sampling: no top-k / top-p truncation.
            kwargs.update(temperature=self.temperature, top_k=0, top_p=1.0)
        if self.ignore_eos:
            kwargs["min_new_tokens"] = max_new_tokens
        if method in ("prompt_lookup", "prompt_lookup_fast"):
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
        elif method in self.drafters:
            kwargs["assistant_model"] = self.drafters[method]
        elif method == "plain_static":
            kwargs["cache_implementation"] = "static"
            if self.static_cache_len is not None:
                kwargs["max_cache_len"] = self.static_cache_len
        elif method not in PLAIN_METHODS:
            raise ValueError(f"Unknown method {method!r}; choose from {', '.join([*METHODS, *self.drafters])}.")
        return kwargs

    @contextlib.contextmanager
    def method_path(self, method: str, kwargs: dict[str, Any], prompt_length: int) -> Iterator[None]:
        """Sets up the decoding path of `method` for one `generate` call (mutates `kwargs`)."""
        if method in FAST_PATH_METHODS:
            # From outside `generate` only the attention can be switched, unless the cache is passed in: then its
            # layers get reserved rows too: the prompt's and the new tokens' (for prompt lookup, room for the last
            # round's candidates and bonus token too).
            cache = kwargs["cache"] = DynamicCache(config=self.target.config)
            candidates = kwargs.get("prompt_lookup_num_tokens", 0)
            max_length = prompt_length + kwargs["max_new_tokens"] + (candidates + 1 if candidates else 0)
            with fast_verification(self.target, cache, max_length):
                yield
        elif method == "plain_static":
            # `generate` sizes a static cache for the longest call so far; sized for this call (or `max_cache_len`)
            # instead, a short prompt does not attend over the masked rows of a longer earlier one.
            vars(self.target).pop("_previous_max_cache_length", None)
            yield
        elif method in self.drafter_settings:
            with drafter_settings(kwargs["assistant_model"], self.drafter_settings[method]):
                yield
        else:
            yield

    def run(self, input_ids: torch.LongTensor, method: str, mode: str, max_new_tokens: int, seed: int | None):
        """One timed `generate` call of `method` on `input_ids` `(1, t)`: tokens, seconds, target forwards and
        their times, and for drafters the drafting stats (lookup rounds and per-position acceptance included)."""
        kwargs = self.generate_kwargs(method, mode, max_new_tokens)
        drafter = kwargs.get("assistant_model")
        if seed is not None:
            torch.manual_seed(seed)
        target, device = self.target, self.device
        with self.method_path(method, kwargs, input_ids.shape[1]), time_forward_calls(target, device) as calls:
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


def _methods_per_mode(
    modes: Sequence[str], methods: Mapping[str, Sequence[str]] | Sequence[str] | None, variants: Sequence[str]
) -> dict[str, list[str]]:
    """The methods of each mode: the defaults (and every variant), or the given ones, with `plain` first."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"Unknown mode {mode!r}; choose from {', '.join(MODES)}.")
    if methods is None:
        per_mode = {mode: [*DEFAULT_METHODS[mode], *variants] for mode in modes}
    elif isinstance(methods, Mapping):
        per_mode = {mode: list(methods.get(mode, ())) for mode in modes}
    else:
        per_mode = {mode: list(methods) for mode in modes}
    for mode in modes:
        unknown = [m for m in per_mode[mode] if m not in METHODS and m not in variants]
        if unknown:
            raise ValueError(f"Unknown methods {unknown}; choose from {', '.join([*METHODS, *variants])}.")
        if "plain" not in per_mode[mode]:
            per_mode[mode].insert(0, "plain")  # the reference of speedups and of greedy losslessness
    return per_mode


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
    tokenizer,
    drafter: LongSparkDrafterModel,
    prompts: Mapping[str, Sequence[Any]] | Sequence[Any],
    max_new_tokens: int = 128,
    *,
    modes: Sequence[str] = MODES,
    methods: Mapping[str, Sequence[str]] | Sequence[str] | None = None,
    temperature: float = 1.0,
    prompt_lookup_num_tokens: int = 7,
    variants: Mapping[str, Mapping[str, Any]] | None = None,
    ignore_eos: bool = False,
    warmup: bool = True,
    seed: int = 0,
    full_prefix_drafter: LongSparkDrafterModel | None = None,
    drafter_info: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """The plain paths, prompt lookup, LongSpark and the full-prefix drafter, side by side on the same prompts.

    Args:
        prompts: `{workload: [prompt, ...]}` or one list (workload `"prompts"`). A prompt is a dict with
            `input_ids` (and optional `name`/metadata) or `messages` (chat-templated with `tokenizer`), a
            string, a 1-D tensor or a list of token ids.
        modes: `"greedy"` and/or `"sampled"` (temperature `temperature`, no top-k/top-p).
        methods: per mode (`{"greedy": [...], "sampled": [...]}`) or for every mode, from `METHODS` and the
            variants; default `DEFAULT_METHODS` (every method, the full-prefix baseline greedy only) and every
            variant. `"plain"` is always added.
        variants: `{name: settings}`: LongSpark with these settings changed (`drafter_settings`), each one more
            method of the run.
        ignore_eos: force exactly `max_new_tokens` tokens (`min_new_tokens`) for equal-length runs.
        warmup: run every (mode, method) once, untimed, on the first prompt before measuring.
        seed: sampled runs of prompt `i` start from the RNG seed `seed + i` for every method.
        progress: show a progress bar of the runs on stderr.

    Per prompt, the methods run back to back in an order rotated from prompt to prompt (A/B/A/B interleaving).
    Speedups are over plain `generate` and over the fastest plain path measured (`speed_summary.add_speedups`).

    Returns:
        `{"machine", "settings", "drafter", "workloads": {name: {"prompts": [...], mode: {"methods": {method:
        summary}, "runs": [...]}}}, "rows": [flat summaries with workload and mode]}`.
    """
    if isinstance(prompts, Mapping):
        workloads = {name: list(items) for name, items in prompts.items()}
    else:
        workloads = {"prompts": list(prompts)}
    workloads = {
        name: [_as_prompt(p, tokenizer, i) for i, p in enumerate(items)] for name, items in workloads.items() if items
    }
    if not workloads:
        raise ValueError("No prompts to benchmark.")
    variants = {name: check_variant(name, settings) for name, settings in (variants or {}).items()}
    per_mode = _methods_per_mode(modes, methods, list(variants))
    device = next(target.parameters()).device
    drafters = {name: drafter for name in [*DRAFTER_METHODS, *variants] if name != "full_prefix"}
    if any("full_prefix" in names for names in per_mode.values()):
        drafters["full_prefix"] = full_prefix_drafter or make_full_prefix_drafter(drafter)
    pad_token_id = target.generation_config.pad_token_id
    if pad_token_id is None:
        eos = target.generation_config.eos_token_id
        pad_token_id = eos[0] if isinstance(eos, list) else eos
    longest = max(len(p["input_ids"]) for items in workloads.values() for p in items)
    runner = _Runner(
        target=target,
        device=device,
        drafters=drafters,
        drafter_settings={**DRAFTER_METHODS, **variants},
        pad_token_id=pad_token_id,
        temperature=temperature,
        prompt_lookup_num_tokens=prompt_lookup_num_tokens,
        ignore_eos=ignore_eos,
        static_cache_len=longest + max_new_tokens if device.type in AUTO_COMPILE_DEVICES else None,
    )

    num_runs = sum(len(items) * len(per_mode[mode]) for items in workloads.values() for mode in modes)
    num_warmups = sum(len(per_mode[mode]) for mode in modes) if warmup else 0
    bar = tqdm(total=num_warmups + num_runs, desc="speed", unit="run", disable=not progress)
    if warmup:
        first = next(iter(workloads.values()))[0]
        input_ids = torch.tensor([first["input_ids"]], device=device)
        for mode in modes:
            for method in per_mode[mode]:
                bar.set_postfix_str(f"warm-up {mode} {method}")
                runner.run(input_ids, method, mode, min(max_new_tokens, 8), seed)
                bar.update(1)

    report_workloads: dict[str, Any] = {}
    rows = []
    for workload, items in workloads.items():
        prompts_info = [
            {**{k: v for k, v in p.items() if k != "input_ids"}, "prompt_tokens": len(p["input_ids"])} for p in items
        ]
        entry: dict[str, Any] = {"prompts": prompts_info}
        for mode in modes:
            runs = _run_prompts(runner, items, per_mode[mode], mode, max_new_tokens, seed, bar, workload)
            summaries = {method: summarize_runs(method_runs, method) for method, method_runs in runs.items()}
            add_speedups(summaries)
            add_round_costs(summaries)
            rows += [{"workload": workload, "mode": mode, **summary} for summary in summaries.values()]
            for method_runs in runs.values():
                for run in method_runs:
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
            "temperature": temperature,
            "prompt_lookup_num_tokens": prompt_lookup_num_tokens,
            "variants": {name: _json_settings(settings) for name, settings in variants.items()},
            "static_cache_len": runner.static_cache_len or "per call",
            "ignore_eos": ignore_eos,
            "warmup": warmup,
            "seed": seed,
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
    calibrated = costs_for_generate(target, drafter)
    costs = calibrated or DraftingKnobs.from_generation_config(drafter.generation_config).costs
    return {"source": "calibration" if calibrated else "generation_config", **asdict(costs)}


__all__ = [
    "DEFAULT_METHODS",
    "DRAFTER_METHODS",
    "METHODS",
    "METHOD_LABELS",
    "MODES",
    "PLAIN_METHODS",
    "add_speedups",
    "drafter_settings",
    "new_tokens_from_round_log",
    "run_speed_benchmark",
    "summarize_runs",
]
