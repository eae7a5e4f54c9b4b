"""Per-round drafting cost and drafter context-state bytes vs prefix length, LongSpark vs the full-prefix baseline
(`run_drafting_cost`), and its table and figure. Prefixes longer than the target's positions (e.g. 32K-128K for
SmolLM2's 8K) use a synthetic cache (`synthetic_cache`): a round reads nothing but the selected layers' K/V and the
boundary state, so its cost depends on shapes alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, GenerationConfig, PreTrainedModel

from ..configuration_longspark import LongSparkConfig
from ..inference.generation import LongSparkCandidateGenerator, requests_after
from ..modeling_longspark import LongSparkDrafterModel
from .common import machine_info, measure, prefill, timed_call
from .models import make_full_prefix_drafter
from .report import finish, format_length, table, two_panels
from .settings import DraftingCostSettings

DRAFTERS = ("longspark", "full_prefix")
# Per-length fields: the report keeps one list per field (`prefix_lengths` for `prefix_length`) and a list of rows.
ROW_FIELDS = ("prefix_length", "longspark_ms", "full_prefix_ms", "longspark_state_bytes", "full_prefix_state_bytes",
              "longspark_update_ms", "longspark_proposal_ms", "full_prefix_update_ms", "full_prefix_proposal_ms",
              "longspark_prefill_absorb_ms", "longspark_window_bytes", "full_prefix_state_bytes_formula", "synthetic",
              "longspark_ms_vs_shortest", "full_prefix_ms_vs_shortest")  # fmt: skip
NOTES = (
    "*_ms: median per drafting round (context update + proposal of one block; the LongSpark update folds B + 1 rows "
    "into the summary). longspark_state_bytes: LongSparkContextState.nbytes (summary + boundary, persistent); "
    "LongSpark also reads a fixed W-row window of the target cache (longspark_window_bytes). full_prefix_state_bytes: "
    "the K/V rows of all D paired target layers the baseline attends to each round, plus the boundary. synthetic=true: "
    "random K/V in the selected target layers and random boundary states, at any position."
)


def full_prefix_state_bytes(config: LongSparkConfig, num_rows: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes a full-prefix drafter attends to per round: D layers x t rows x (K, V) x kv heads x head dim, plus the
    boundary states (D x hidden size), in `dtype` (the target cache's)."""
    element = torch.empty((), dtype=dtype).element_size()
    rows = config.num_draft_layers * num_rows * 2 * config.num_key_value_heads * config.head_dim
    return (rows + config.num_draft_layers * config.hidden_size) * element


class SelectedLayersCache(DynamicCache):
    """A `DynamicCache` with rows in the drafter's selected layers only; `get_seq_length()` reports the first filled
    layer's length, as layer 0 of a full cache would."""

    def __init__(self, config, layer_ids: Sequence[int]):
        super().__init__(config=config)
        self.filled_layer = layer_ids[0]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[self.filled_layer].get_seq_length()


def synthetic_cache(
    target: PreTrainedModel, layer_ids: Sequence[int], num_rows: int, seed: int = 0
) -> SelectedLayersCache:
    """Random K/V rows `(1, num_kv_heads, num_rows, head_dim)` in the target's dtype and device, in `layer_ids` only
    (5 layers x 2 x 3 heads x 64 x 4 bytes x 128K rows = 1.3 GB for SmolLM2 in fp32, instead of 7.5 GB for 30)."""
    config = target.config.get_text_config()
    parameter = next(target.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (1, config.num_key_value_heads or config.num_attention_heads, num_rows, head_dim)
    cache = SelectedLayersCache(target.config, layer_ids)
    torch.manual_seed(seed)
    for layer_id in layer_ids:
        keys, values = (torch.randn(shape, device=parameter.device, dtype=parameter.dtype) for _ in range(2))
        layer = cache.layers[layer_id]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values  # not `update`, whose concatenation would copy them once more
    return cache


def _generators(target, drafters, input_ids) -> dict[str, LongSparkCandidateGenerator]:
    """One candidate generator per drafter, built as `generate` builds it, drafting whole blocks every round with the
    lookup source off."""
    block = drafters["longspark"].config.block_size
    generation_config = GenerationConfig(do_sample=False, max_length=input_ids.shape[1] + 2 * block + 1)
    gens = {}
    for name, drafter in drafters.items():
        gen = gens[name] = LongSparkCandidateGenerator(target, drafter, input_ids, generation_config, None)
        gen.planner.lookup = None
        # a dynamic block length would time fewer tokens than `B`
        gen.session.settings = replace(gen.session.settings, token_threshold=0.0, block_threshold=0.0)
    return gens


class _Prefix:
    """One prefix length's cache, candidate generators (hooks already removed) and prompt ids."""

    def __init__(self, length: int, cache, gens: dict[str, LongSparkCandidateGenerator], input_ids, synthetic: bool):
        self.length, self.cache, self.gens, self.input_ids, self.synthetic = length, cache, gens, input_ids, synthetic
        for gen in gens.values():  # keep the states captured at this prefill: later prefills must not overwrite them
            gen.session.capture.remove()

    def phases(self, name: str) -> tuple[Callable, Callable]:
        """The two timed phases of one round: the context update, then the proposal of a whole block."""
        gen = self.gens[name]

        def propose(context):
            requests = requests_after(self.input_ids, gen.session.config.block_size)
            return gen.session.draft_round(requests, [gen.planner], lambda: context)

        return (lambda: gen.update_context(self.cache, self.length, 0)), propose

    def row(self, timings: Mapping[str, Any], device) -> dict[str, Any]:
        """The per-length fields: the round after prefill (LongSpark absorbs the whole prefix, timed once) and the
        medians of the steady-state rounds, each folding `B + 1` new rows into the summary."""
        gens, length = self.gens, self.length
        config = gens["longspark"].session.config
        row: dict[str, Any] = {"prefix_length": length, "synthetic": self.synthetic}
        for name in gens:
            timing = timings[f"{name}@{length}"]
            row[f"{name}_ms"] = timing.median_ms()
            row[f"{name}_update_ms"] = timing.median_ms(0)
            row[f"{name}_proposal_ms"] = timing.median_ms(1)
        gen = gens["longspark"]
        gen.state = type(gen.state)(config.num_draft_layers, config.summary_chunk_size)
        seconds, _ = timed_call(gen.update_context, self.cache, length, 0, device=device)
        row["longspark_prefill_absorb_ms"] = 1000.0 * seconds
        full, ours = (gens[name].update_context(self.cache, length, 0) for name in ("full_prefix", "longspark"))
        row["longspark_state_bytes"] = gen.state.nbytes
        row["full_prefix_state_bytes"] = gens["full_prefix"].state.nbytes + _nbytes(
            full.window_keys + full.window_values
        )
        row["longspark_window_bytes"] = _nbytes(ours.window_keys + ours.window_values)
        kv_dtype = full.window_keys[0].dtype if full.window_keys else torch.float32
        row["full_prefix_state_bytes_formula"] = full_prefix_state_bytes(config, length, kv_dtype)
        return row


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _time_all(prefixes: Sequence[_Prefix], rounds: int, warmup: int, device, progress=None) -> list[dict[str, Any]]:
    """Times every (drafter, prefix length) pair in ONE interleaved loop, the order rotated every round, so that
    machine noise and the cache traffic of the long full-prefix rounds hit every length alike. Adds
    `{name}_ms_vs_shortest`: each round's median over the same drafter's at the shortest prefix."""
    calls, steady = {}, {}
    for prefix in prefixes:
        block = prefix.gens["longspark"].session.config.block_size
        for name, gen in prefix.gens.items():
            gen.update_context(prefix.cache, prefix.length, 0)  # the round after prefill absorbs the prefix
            calls[f"{name}@{prefix.length}"] = prefix.phases(name)
            steady[f"{name}@{prefix.length}"] = (gen, prefix.length - (block + 1))

    def prepare(key: str) -> None:
        gen, absorbed = steady[key]
        gen.state.num_absorbed = absorbed  # steady state: one full block's rows are new

    timings = measure(calls, rounds, warmup, device=device, prepare=prepare, progress=progress)
    rows = [prefix.row(timings, device) for prefix in prefixes]
    shortest = min(rows, key=lambda row: row["prefix_length"], default={})
    for name, row in ((name, row) for name in DRAFTERS for row in rows):
        row[f"{name}_ms_vs_shortest"] = row[f"{name}_ms"] / shortest[f"{name}_ms"]
    return rows


def _usable_lengths(lengths, block: int, max_positions: int, rope: Mapping, allow_extrapolation: bool):
    usable, skipped = [], []
    for length in sorted({int(t) for t in lengths}):
        if length < block + 1:
            reason = f"shorter than one block plus one ({block + 1})"
        elif length > max_positions and not allow_extrapolation:
            rope_type = rope.get("rope_type", "default")
            reason = (
                f"beyond the target's max_position_embeddings={max_positions} (rope_type={rope_type!r}, no RoPE "
                "scaling beyond it); pass allow_extrapolation=True to time it anyway"
            )
        else:
            usable.append(length)
            continue
        skipped.append({"prefix_length": length, "reason": reason})
    return usable, skipped


def run_drafting_cost(
    target: PreTrainedModel,
    drafter: LongSparkDrafterModel,
    settings: DraftingCostSettings | None = None,
    *,
    prefix_ids: Sequence[int] | torch.Tensor | None = None,
) -> dict[str, Any]:
    """Per-round drafting time and persistent context-state bytes of LongSpark and the full-prefix baseline.

    For each prefix length `t` of `settings`, the target prefills `t` tokens (`prefix_ids`, at least the longest
    prefix + 1 ids; else seeded random ids) once; one `LongSparkCandidateGenerator` per drafter, built as `generate`
    builds it, then runs `warmup + rounds` rounds on that cache (context update, proposal of one block of `B` greedy
    tokens), all lengths and drafters interleaved. Each LongSpark round folds `B + 1` rows into the summary, as one
    that accepts a whole block does. Prefixes beyond `max_position_embeddings` are `skipped` unless
    `allow_extrapolation`; `synthetic_prefix_lengths` run on a `synthetic_cache` at any length.

    Returns:
        One list per field of `ROW_FIELDS` (what each holds: `NOTES`), the same as `rows` (one dict per length),
        `round_cost_ratio` (longest over shortest prefix, per drafter) and metadata.
    """
    settings = settings or DraftingCostSettings()
    rounds, warmup, seed = settings.rounds, settings.warmup, settings.seed
    config, block = drafter.config, drafter.config.block_size
    text_config = target.config.get_text_config()
    max_positions, vocab = text_config.max_position_embeddings, text_config.vocab_size
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    extrapolate = settings.allow_extrapolation
    lengths, skipped = _usable_lengths(settings.prefix_lengths, block, max_positions, rope, extrapolate)
    synthetic_lengths, synthetic_skipped = _usable_lengths(settings.synthetic_prefix_lengths, block, 0, rope, True)
    skipped += [{**skip, "synthetic": True} for skip in synthetic_skipped]
    device, dtype = next(target.parameters()).device, next(target.parameters()).dtype
    generator = torch.Generator().manual_seed(seed)
    if prefix_ids is None:
        tokens = torch.randint(0, vocab, (max(lengths, default=0) + 1,), generator=generator)
    else:
        tokens = torch.as_tensor(prefix_ids, dtype=torch.long).flatten()
        if lengths and tokens.numel() < max(lengths) + 1:
            raise ValueError(f"prefix_ids has {tokens.numel()} tokens; the longest prefix needs {max(lengths) + 1}.")
    drafters = {"longspark": drafter, "full_prefix": make_full_prefix_drafter(drafter)}
    prefixes = []
    with torch.no_grad():
        for length in tqdm(lengths, desc="prefill", unit="prefix", disable=not settings.progress):
            input_ids = tokens[: length + 1].to(device)[None]
            gens = _generators(target, drafters, input_ids)  # all capture the prefill's boundary states
            cache = prefill(target, input_ids[:, :length], settings.prefill_chunk)
            prefixes.append(_Prefix(length, cache, gens, input_ids, synthetic=False))
        for length in synthetic_lengths:
            input_ids = torch.randint(0, vocab, (1, length + 1), generator=generator).to(device)
            gens = _generators(target, drafters, input_ids)
            cache = synthetic_cache(target, config.target_layer_ids, length, seed)
            for slot in range(len(config.target_layer_ids)):
                state = torch.randn(1, block + 1, text_config.hidden_size, device=device, dtype=dtype)
                for gen in gens.values():
                    gen.session.capture.states[slot] = state
            prefixes.append(_Prefix(length, cache, gens, input_ids, synthetic=True))
        rows = _time_all(prefixes, rounds, warmup, device, "drafting rounds" if settings.progress else None)
    del prefixes

    result: dict[str, Any] = {"prefix_lengths" if f == "prefix_length" else f: [r[f] for r in rows] for f in ROW_FIELDS}
    longest = max(rows, key=lambda row: row["prefix_length"], default=None)
    ratio = longest and {"lengths": [min(row["prefix_length"] for row in rows), longest["prefix_length"]]}
    for name in DRAFTERS if ratio else ():
        ratio[name] = longest[f"{name}_ms_vs_shortest"]  # e.g. 128K / 512
    result.update(
        round_cost_ratio=ratio, benchmark="drafting-cost", rows=rows, synthetic_prefix_lengths=synthetic_lengths,
        rounds=rounds, warmup=warmup, prefix_source="random" if prefix_ids is None else "given", skipped=skipped,
        max_position_embeddings=max_positions, rope_parameters=rope, block_size=block, window_size=config.window_size,
        num_summary_queries=config.num_summary_queries, num_draft_layers=config.num_draft_layers,
        dtype=str(next(drafter.parameters()).dtype), notes=NOTES, machine=machine_info(device),
    )  # fmt: skip
    return result


def format_drafting_cost(result: Mapping[str, Any]) -> str:
    """The drafting-cost report as a Markdown table, one row per prefix length (synthetic ones marked)."""
    header = ["prefix", "LongSpark ms/round", "full-prefix ms/round", "LongSpark state", "full-prefix state"]
    synthetic = result.get("synthetic") or [False] * len(result["prefix_lengths"])
    rows = [[f"{length}{' (synthetic)' if synthetic[i] else ''}", f"{result['longspark_ms'][i]:.2f}",
             f"{result['full_prefix_ms'][i]:.2f}", f"{result['longspark_state_bytes'][i] / 1024:.1f} KiB",
             f"{result['full_prefix_state_bytes'][i] / 2**20:.2f} MiB"]
            for i, length in enumerate(result["prefix_lengths"])]  # fmt: skip
    lines = table(header, rows, "r" * len(header))
    ratio = result.get("round_cost_ratio")
    if ratio:  # e.g. "Round cost 128K / 512 (...): LongSpark 1.00x, full-prefix 42.0x"
        names = {"longspark": "LongSpark", "full_prefix": "full-prefix"}
        parts = [f"{label} {ratio[name]:.2f}x" for name, label in names.items() if ratio.get(name) is not None]
        shortest, longest = (format_length(length) for length in ratio["lengths"])
        lines.append(
            f"\nRound cost {longest} / {shortest} (median ms per round, longest over shortest): " + ", ".join(parts)
        )
    lines += [f"\nskipped {skip['prefix_length']}: {skip['reason']}" for skip in result.get("skipped", [])]
    if any(synthetic):
        lines.append("\n(synthetic): random K/V in the selected target layers and random boundary states.")
    return "\n".join(lines) + "\n"


# The drafting-cost figure's curves: drafter (its `{name}_ms` field), label, bytes-per-request field, line style.
DRAFTING_COST_CURVES = (
    ("longspark", "LongSpark (window + summary)", "longspark_state_bytes", dict(marker="o", color="tab:blue")),
    ("full_prefix", "full-prefix drafter", "full_prefix_state_bytes",
     dict(marker="s", color="tab:red", linestyle="--")),
)  # fmt: skip


def plot_drafting_cost(result: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Two panels, like the paper's Figure 1 (left): (a) drafting time per round and (b) drafter context-state
    memory (log scale) vs prefix length (log scale), LongSpark vs the full-prefix baseline. Synthetic-cache lengths are
    drawn dotted with hollow markers on a shaded range. Writes `path` (PNG, PDF, ...)."""
    lengths = result["prefix_lengths"]
    synthetic = result.get("synthetic") or [False] * len(lengths)
    plt, fig, (time_ax, mem_ax) = two_panels()
    real = [i for i, s in enumerate(synthetic) if not s]
    fake = [i for i, s in enumerate(synthetic) if s]
    for name, label, bytes_field, style in DRAFTING_COST_CURVES:
        mebibytes = [b / 2**20 for b in result[bytes_field]]
        for ax, values in ((time_ax, result[f"{name}_ms"]), (mem_ax, mebibytes)):
            if real:
                ax.plot([lengths[i] for i in real], [values[i] for i in real], label=label, **style)
            if fake:  # joined to the last real point, so that each method stays one curve
                joined = real[-1:] + fake
                hollow = dict(linestyle=":", color=style["color"], marker=style["marker"], markerfacecolor="none")
                hollow["label"] = None if real else label
                ax.plot([lengths[i] for i in joined], [values[i] for i in joined], **hollow)
    for ax in (time_ax, mem_ax):
        if fake:
            low, high = min(lengths[i] for i in fake) / 2**0.5, max(lengths) * 2**0.5
            ax.axvspan(low, high, color="0.92", zorder=0, label="synthetic cache")
        ax.legend()
    time_ax.set_ylim(bottom=0)
    mem_ax.set_yscale("log")
    labels = [
        ("(a) drafting cost per round", "drafting time per round (ms)"),
        ("(b) drafter context-state memory", "drafter context state (MiB)"),
    ]
    return finish(plt, fig, (time_ax, mem_ax), lengths, labels, path)
