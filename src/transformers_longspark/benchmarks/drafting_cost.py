"""Per-round drafting cost and drafter context-state bytes vs prefix length: LongSpark vs the full-prefix baseline.

Real-target prefixes are prefilled by the target. Longer ones (`synthetic_prefix_lengths`, e.g. 32K-128K, beyond
SmolLM2's 8K positions) use a *synthetic* cache: random K/V rows of the right shapes in the drafter's selected target
layers only, and a random boundary state. A drafting round reads nothing else, and its cost depends on shapes alone.

With the lookup source on (`lookup_min_match`), each length also gets a seeded synthetic token history of that length
(`lookup_history`), indexed in a `SuffixIndex`, and a third drafter, `longspark_lookup`, whose round is the real one:
`propose_blocks` adds the round's committed tokens to the index, queries it, and drafts the block on a miss.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, GenerationConfig, PreTrainedModel

from ..configuration_longspark import LongSparkConfig
from ..inference.generation import LongSparkCandidateGenerator, requests_after
from ..modeling_longspark import LongSparkDrafterModel
from .common import generation_config_fields, machine_info, measure, prefill, timed_call
from .lookup_cost import LOOKUP_HISTORY, LOOKUP_NOTES, LOOKUP_ROW_FIELDS, LookupRounds, lookup_history
from .models import make_full_prefix_drafter
from .settings import DraftingCostSettings

# Per-length fields: the report keeps one list per field (`prefix_lengths` for `prefix_length`) and a list of rows.
ROW_FIELDS = ("prefix_length", "longspark_ms", "full_prefix_ms", "longspark_state_bytes", "full_prefix_state_bytes",
              "longspark_update_ms", "longspark_proposal_ms", "full_prefix_update_ms", "full_prefix_proposal_ms",
              "longspark_prefill_absorb_ms", "longspark_window_bytes", "full_prefix_state_bytes_formula", "synthetic",
              "longspark_ms_vs_shortest", "full_prefix_ms_vs_shortest")  # fmt: skip


def full_prefix_state_bytes(config: LongSparkConfig, num_rows: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes a full-prefix drafter attends to per round: D layers x t rows x (K, V) x kv heads x head dim, plus the
    boundary states (D x hidden size), in `dtype` (the target cache's)."""
    element = torch.empty((), dtype=dtype).element_size()
    rows = config.num_draft_layers * num_rows * 2 * config.num_key_value_heads * config.head_dim
    return (rows + config.num_draft_layers * config.hidden_size) * element


class SelectedLayersCache(DynamicCache):
    """A `DynamicCache` with rows in the drafter's selected layers only, the other layers left empty.

    `get_seq_length()` reports the first filled layer's length, which layer 0 of a full cache would report.
    """

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
        keys = torch.randn(shape, device=parameter.device, dtype=parameter.dtype)
        values = torch.randn(shape, device=parameter.device, dtype=parameter.dtype)
        layer = cache.layers[layer_id]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values  # not `update`, whose concatenation would copy them once more
    return cache


def _generators(target, drafters, input_ids, lookup: bool = False) -> dict[str, LongSparkCandidateGenerator]:
    """One candidate generator per drafter, built as `generate` builds it, drafting whole blocks every round with the
    lookup source off; with `lookup`, one more (`longspark_lookup`) with the drafter's lookup source on."""
    block = drafters["longspark"].config.block_size
    generation_config = GenerationConfig(do_sample=False, max_length=input_ids.shape[1] + 2 * block + 1)
    gens = {
        name: LongSparkCandidateGenerator(target, drafter, input_ids, generation_config, None)
        for name, drafter in drafters.items()
    }
    for gen in gens.values():
        gen.planner.lookup = None
    if lookup:
        gens["longspark_lookup"] = LongSparkCandidateGenerator(
            target, drafters["longspark"], input_ids, generation_config, None
        )
    for gen in gens.values():
        # A dynamic block length would time fewer tokens than `B`.
        gen.session.settings = replace(gen.session.settings, token_threshold=0.0, block_threshold=0.0)
    return gens


def _context_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Prefix:
    """One prefix length's cache, candidate generators (hooks already removed), prompt ids and lookup rounds."""

    def __init__(self, length: int, cache, gens: dict[str, LongSparkCandidateGenerator], input_ids, synthetic: bool):
        self.length, self.cache, self.gens, self.input_ids, self.synthetic = length, cache, gens, input_ids, synthetic
        self.lookup: LookupRounds | None = None
        for gen in gens.values():
            # Keep the states captured at this prefill: later prefills must not overwrite them.
            gen.session.capture.remove()

    def add_lookup(self, vocab_size: int, seed: int, new_tokens: int, num_rounds: int) -> None:
        """Indexes a synthetic history of `length + 1` tokens (the ids when the first round runs) for the lookup
        generator; its rounds then commit `new_tokens` fresh random ids each (the query misses: the drafter still
        drafts, the round's full cost)."""
        rng = random.Random(seed + 1)
        round_tokens = [rng.randrange(vocab_size) for _ in range(new_tokens * num_rounds)]
        history = lookup_history(self.length + 1, vocab_size, seed)
        self.lookup = LookupRounds(self.gens["longspark_lookup"], history, round_tokens, new_tokens)


def _row(prefix: _Prefix, timings: Mapping[str, Any], device) -> dict[str, Any]:
    """The per-length fields: the round after prefill (LongSpark absorbs the whole prefix, timed once) and the
    medians of the steady-state rounds, each folding `B + 1` new rows into the summary."""
    gens, length = prefix.gens, prefix.length
    config = gens["longspark"].session.config
    row: dict[str, Any] = {"prefix_length": length, "synthetic": prefix.synthetic}
    for name in gens:
        timing = timings[f"{name}@{length}"]
        row[f"{name}_ms"] = timing.median_ms()
        row[f"{name}_update_ms"] = timing.median_ms(0)
        row[f"{name}_proposal_ms"] = timing.median_ms(1)
    gen = gens["longspark"]
    gen.state = type(gen.state)(config.num_draft_layers, config.summary_chunk_size)
    seconds, _ = timed_call(gen.update_context, prefix.cache, length, 0, device=device)
    row["longspark_prefill_absorb_ms"] = 1000.0 * seconds
    full = gens["full_prefix"].update_context(prefix.cache, length, 0)
    ls = gen.update_context(prefix.cache, length, 0)
    row["longspark_state_bytes"] = gen.state.nbytes
    full_rows = _context_bytes(full.window_keys + full.window_values)
    row["full_prefix_state_bytes"] = gens["full_prefix"].state.nbytes + full_rows
    row["longspark_window_bytes"] = _context_bytes(ls.window_keys + ls.window_values)
    kv_dtype = full.window_keys[0].dtype if full.window_keys else torch.float32
    row["full_prefix_state_bytes_formula"] = full_prefix_state_bytes(config, length, kv_dtype)
    if prefix.lookup is not None:
        row["lookup_overhead_ms"] = row["longspark_lookup_ms"] - row["longspark_ms"]
        row["lookup_index_bytes"] = prefix.lookup.index_bytes
        row["lookup_prefill_index_ms"] = prefix.lookup.prefill_index_ms
        row["lookup_hit_rounds"] = gens["longspark_lookup"].stats.lookup_rounds
    return row


def _add_ratios(rows: Sequence[dict[str, Any]]) -> None:
    """`{name}_ms_vs_shortest`: each round's median over the same drafter's at the shortest prefix."""
    shortest = min(rows, key=lambda row: row["prefix_length"], default=None)
    for name in ("longspark", "longspark_lookup", "full_prefix"):
        if shortest is not None and f"{name}_ms" in shortest:
            for row in rows:
                row[f"{name}_ms_vs_shortest"] = row[f"{name}_ms"] / shortest[f"{name}_ms"]


def _round_phases(prefix: _Prefix, name: str, gen: LongSparkCandidateGenerator) -> tuple[Callable, Callable]:
    """The two timed phases of one round: the context update, then the proposal, a whole block after the prefix ids,
    or for `longspark_lookup` the real round's (`max_proposal_tokens` at most) after the next lookup round's ids."""

    def update():
        return gen.update_context(prefix.cache, prefix.length, 0)

    def propose(context):
        if name == "longspark_lookup":
            requests = requests_after(prefix.lookup.next_ids(), gen.session.settings.max_proposal_tokens)
        else:
            requests = requests_after(prefix.input_ids, gen.session.config.block_size)
        return gen.session.draft_round(requests, [gen.planner], lambda: context)

    return update, propose


def _time_all(prefixes: Sequence[_Prefix], rounds: int, warmup: int, device, progress=None) -> list[dict[str, Any]]:
    """Times every (drafter, prefix length) pair in ONE interleaved loop, the order rotated every round, so that
    machine noise and the cache traffic of the long full-prefix rounds hit every length alike."""
    calls, setup = {}, {}
    for prefix in prefixes:
        block = prefix.gens["longspark"].session.config.block_size
        for name, gen in prefix.gens.items():
            key = f"{name}@{prefix.length}"
            gen.update_context(prefix.cache, prefix.length, 0)  # the round after prefill absorbs the prefix
            calls[key] = _round_phases(prefix, name, gen)
            setup[key] = (gen, prefix.length - (block + 1))

    def prepare(key: str) -> None:
        gen, absorbed = setup[key]
        gen.state.num_absorbed = absorbed  # steady state: one full block's rows are new

    timings = measure(calls, rounds, warmup, device=device, prepare=prepare, progress=progress)
    rows = [_row(prefix, timings, device) for prefix in prefixes]
    _add_ratios(rows)
    return rows


def _round_cost_ratio(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Each drafter's round at the longest prefix over its round at the shortest (e.g. 128K / 512)."""
    if not rows:
        return None
    longest = max(rows, key=lambda row: row["prefix_length"])
    names = [name for name in ("longspark", "longspark_lookup", "full_prefix") if f"{name}_ms_vs_shortest" in longest]
    ratios = {name: longest[f"{name}_ms_vs_shortest"] for name in names}
    return {"lengths": [min(row["prefix_length"] for row in rows), longest["prefix_length"]], **ratios}


def _usable_lengths(lengths, block: int, max_positions: int, allow_extrapolation: bool, rope: Mapping):
    usable, skipped = [], []
    for length in sorted({int(t) for t in lengths}):
        if length < block + 1:
            skipped.append({"prefix_length": length, "reason": f"shorter than one block plus one ({block + 1})"})
        elif length > max_positions and not allow_extrapolation:
            skipped.append(
                {
                    "prefix_length": length,
                    "reason": f"beyond the target's max_position_embeddings={max_positions} "
                    f"(rope_type={rope.get('rope_type', 'default')!r}, no RoPE scaling beyond it); pass "
                    "allow_extrapolation=True to time it anyway",
                }
            )
        else:
            usable.append(length)
    return usable, skipped


def run_drafting_cost(
    target: PreTrainedModel,
    drafter: LongSparkDrafterModel,
    settings: DraftingCostSettings | None = None,
    *,
    prefix_ids: Sequence[int] | torch.Tensor | None = None,
) -> dict[str, Any]:
    """Per-round drafting time and persistent context-state bytes of LongSpark and the full-prefix baseline.

    `settings` (`DraftingCostSettings`, default `DraftingCostSettings()`) names the prefix lengths, the rounds and
    the lookup source's settings. For each prefix length `t`: the target prefills `t` tokens (`prefix_ids`, ids of
    at least the longest prefix + 1 tokens, else seeded random ids) into a DynamicCache once; then one
    `LongSparkCandidateGenerator` per drafter, built exactly as `generate` builds it, runs `warmup + rounds`
    drafting rounds on that cache (context update, then proposal of one block of `B` greedy tokens), all lengths and
    drafters interleaved in one loop, the order rotated every round. Each LongSpark round folds `B + 1` rows into the
    global summary, as a round that accepts a whole block does. Times are medians over the measured rounds.

    Prefixes longer than the target's `max_position_embeddings` are skipped (listed in `skipped`) unless
    `allow_extrapolation` (SmolLM2-135M: 8192 positions, plain RoPE). `synthetic_prefix_lengths` are timed on a
    synthetic cache (`synthetic_cache`), at any length. With `lookup_min_match > 0`, a third generator,
    `longspark_lookup`, runs the real round with the lookup source on, after indexing a seeded synthetic history of
    `t + 1` tokens (`lookup_history`, timed once as `lookup_prefill_index_ms`; `lookup_index_bytes` its `nbytes`);
    each round adds `lookup_new_tokens` fresh tokens to the index, queries it and drafts the block on a miss
    (`lookup_hit_rounds` counts the others).

    Returns:
        One list per field of `ROW_FIELDS` (`prefix_lengths`, `longspark_ms`, `full_prefix_ms` (median ms per
        round, update + proposal), `longspark_state_bytes` (`LongSparkContextState.nbytes`),
        `full_prefix_state_bytes` (the KV rows the baseline attends to plus the boundary, measured from its
        context), the update/proposal split, the prefill absorption time, `synthetic` flags, `*_ms_vs_shortest`
        (each round over the same drafter's at the shortest prefix), ...) and, with lookup, of `LOOKUP_ROW_FIELDS`;
        the same as `rows` (one dict per length); `round_cost_ratio` (longest over shortest prefix, per drafter);
        and metadata.
    """
    settings = settings or DraftingCostSettings()
    rounds, warmup, seed = settings.rounds, settings.warmup, settings.seed
    config = drafter.config
    block = config.block_size
    lookup = settings.lookup_fields()
    new_tokens = block + 1 if settings.lookup_new_tokens is None else settings.lookup_new_tokens
    text_config = target.config.get_text_config()
    max_positions = text_config.max_position_embeddings
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    usable = functools.partial(_usable_lengths, block=block, max_positions=max_positions, rope=rope)
    lengths, skipped = usable(settings.prefix_lengths, allow_extrapolation=settings.allow_extrapolation)
    synthetic_lengths, synthetic_skipped = usable(settings.synthetic_prefix_lengths, allow_extrapolation=True)
    skipped += [{**skip, "synthetic": True} for skip in synthetic_skipped]
    device = next(target.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    if prefix_ids is None:
        tokens = torch.randint(0, text_config.vocab_size, (max(lengths, default=0) + 1,), generator=generator)
        prefix_source = "random"
    else:
        tokens = torch.as_tensor(prefix_ids, dtype=torch.long).flatten()
        prefix_source = "given"
        if lengths and tokens.numel() < max(lengths) + 1:
            raise ValueError(f"prefix_ids has {tokens.numel()} tokens; the longest prefix needs {max(lengths) + 1}.")
    drafters = {"longspark": drafter, "full_prefix": make_full_prefix_drafter(drafter)}
    prefixes = []
    with torch.no_grad(), generation_config_fields(drafter, lookup):
        for length in tqdm(lengths, desc="prefill", unit="prefix", disable=not settings.progress):
            input_ids = tokens[: length + 1].to(device)[None]
            gens = _generators(target, drafters, input_ids, bool(lookup))  # all capture the prefill's boundary states
            cache = prefill(target, input_ids[:, :length], settings.prefill_chunk)
            prefixes.append(_Prefix(length, cache, gens, input_ids, synthetic=False))
        parameter = next(target.parameters())
        for length in synthetic_lengths:
            input_ids = torch.randint(0, text_config.vocab_size, (1, length + 1), generator=generator).to(device)
            gens = _generators(target, drafters, input_ids, bool(lookup))
            cache = synthetic_cache(target, config.target_layer_ids, length, seed)
            for slot in range(len(config.target_layer_ids)):
                state = torch.randn(1, block + 1, text_config.hidden_size, device=device, dtype=parameter.dtype)
                for gen in gens.values():
                    gen.session.capture.states[slot] = state
            prefixes.append(_Prefix(length, cache, gens, input_ids, synthetic=True))
        if lookup:
            for prefix in tqdm(prefixes, desc="lookup index", unit="prefix", disable=not settings.progress):
                prefix.add_lookup(text_config.vocab_size, seed + prefix.length, new_tokens, warmup + rounds)
        rows = _time_all(prefixes, rounds, warmup, device, "drafting rounds" if settings.progress else None)
    del prefixes

    fields = ROW_FIELDS + (LOOKUP_ROW_FIELDS if lookup else ())
    column_names = {field: "prefix_lengths" if field == "prefix_length" else field for field in fields}
    result: dict[str, Any] = {column_names[field]: [row[field] for row in rows] for field in fields}
    result.update(
        round_cost_ratio=_round_cost_ratio(rows),
        lookup={**lookup, "new_tokens_per_round": new_tokens, "history": LOOKUP_HISTORY} if lookup else None,
        benchmark="drafting-cost",
        rows=rows,
        synthetic_prefix_lengths=synthetic_lengths,
        rounds=rounds,
        warmup=warmup,
        prefix_source=prefix_source,
        skipped=skipped,
        max_position_embeddings=max_positions,
        rope_parameters=rope,
        block_size=block,
        window_size=config.window_size,
        num_summary_queries=config.num_summary_queries,
        num_draft_layers=config.num_draft_layers,
        dtype=str(next(drafter.parameters()).dtype),
        notes=(
            "*_ms: median per drafting round (context update + proposal of one block); the LongSpark update folds "
            "B + 1 rows into the global summary. longspark_state_bytes: LongSparkContextState.nbytes (summary + "
            "boundary, persistent). full_prefix_state_bytes: the K/V rows of all D paired target layers the baseline "
            "attends to each round, plus the boundary. LongSpark also reads a W-row window of the target cache "
            "(longspark_window_bytes, fixed). Rows with synthetic=true use random K/V rows in the selected target "
            "layers only and random boundary states instead of a target prefill (positions may exceed "
            "max_position_embeddings: drafting cost depends on shapes alone)." + (LOOKUP_NOTES if lookup else "")
        ),
        machine=machine_info(device),
    )
    return result


__all__ = ["SelectedLayersCache", "full_prefix_state_bytes", "run_drafting_cost", "synthetic_cache"]
