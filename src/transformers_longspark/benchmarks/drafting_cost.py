"""Per-round drafting cost and drafter context-state bytes vs prefix length: LongSpark vs the full-prefix baseline,
and with the lookup source on (what is measured: `run_drafting_cost`).

Prefixes longer than the target's positions (e.g. 32K-128K for SmolLM2's 8K) use a *synthetic* cache
(`synthetic_cache`): a drafting round reads nothing but the selected layers' K/V and the boundary state, and its cost
depends on shapes alone.
"""

from __future__ import annotations

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
from .models import make_full_prefix_drafter
from .settings import DraftingCostSettings

DRAFTERS = ("longspark", "longspark_lookup", "full_prefix")
# Per-length fields: the report keeps one list per field (`prefix_lengths` for `prefix_length`) and a list of rows.
ROW_FIELDS = ("prefix_length", "longspark_ms", "full_prefix_ms", "longspark_state_bytes", "full_prefix_state_bytes",
              "longspark_update_ms", "longspark_proposal_ms", "full_prefix_update_ms", "full_prefix_proposal_ms",
              "longspark_prefill_absorb_ms", "longspark_window_bytes", "full_prefix_state_bytes_formula", "synthetic",
              "longspark_ms_vs_shortest", "full_prefix_ms_vs_shortest")  # fmt: skip
# With the lookup source on: the round with it, its cost over the lookup-off round's, the index per request.
LOOKUP_ROW_FIELDS = ("longspark_lookup_ms", "longspark_lookup_update_ms", "longspark_lookup_proposal_ms",
                     "longspark_lookup_ms_vs_shortest", "lookup_overhead_ms", "lookup_index_bytes",
                     "lookup_prefill_index_ms", "lookup_hit_rounds")  # fmt: skip
LOOKUP_HISTORY = "random ids in stretches of 8-64 tokens, 30% of them copies of earlier stretches (lookup_history)"
NOTES = (
    "*_ms: median per drafting round (context update + proposal of one block); the LongSpark update folds "
    "B + 1 rows into the global summary. longspark_state_bytes: LongSparkContextState.nbytes (summary + "
    "boundary, persistent). full_prefix_state_bytes: the K/V rows of all D paired target layers the baseline "
    "attends to each round, plus the boundary. LongSpark also reads a W-row window of the target cache "
    "(longspark_window_bytes, fixed). Rows with synthetic=true use random K/V rows in the selected target "
    "layers only and random boundary states instead of a target prefill (positions may exceed "
    "max_position_embeddings: drafting cost depends on shapes alone)."
)
LOOKUP_NOTES = (
    " longspark_lookup: the same drafter with its lookup source on; each round adds the round's new tokens (fresh "
    "random ids) to the request's SuffixIndex, queries it and drafts the block on a miss (the round's full cost). "
    "lookup_index_bytes: SuffixIndex.nbytes of a synthetic history of prefix + 1 tokens (grows with the prefix); "
    "lookup_prefill_index_ms: indexing it, once per request; lookup_overhead_ms: longspark_lookup_ms - longspark_ms."
)


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
        keys, values = (torch.randn(shape, device=parameter.device, dtype=parameter.dtype) for _ in range(2))
        layer = cache.layers[layer_id]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values  # not `update`, whose concatenation would copy them once more
    return cache


def lookup_history(length: int, vocab_size: int, seed: int = 0, repeat_share: float = 0.3) -> list[int]:
    """`length` seeded token ids with repeated stretches, as in code: stretches of 8-64 tokens, each either fresh
    random ids or (with probability `repeat_share`) a copy of an earlier stretch of the history."""
    rng = random.Random(seed)
    tokens: list[int] = []
    while len(tokens) < length:
        size = rng.randint(8, 64)
        if len(tokens) >= size and rng.random() < repeat_share:
            start = rng.randrange(len(tokens) - size + 1)
            tokens.extend(tokens[start : start + size])
        else:
            tokens.extend(rng.randrange(vocab_size) for _ in range(size))
    return tokens[:length]


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
    for gen in gens.values():  # a dynamic block length would time fewer tokens than `B`
        gen.session.settings = replace(gen.session.settings, token_threshold=0.0, block_threshold=0.0)
    return gens


class _Prefix:
    """One prefix length's cache, candidate generators (hooks already removed), prompt ids and lookup rounds."""

    def __init__(self, length: int, cache, gens: dict[str, LongSparkCandidateGenerator], input_ids, synthetic: bool):
        self.length, self.cache, self.gens, self.input_ids, self.synthetic = length, cache, gens, input_ids, synthetic
        self.lookup_ids: torch.LongTensor | None = None
        for gen in gens.values():  # keep the states captured at this prefill: later prefills must not overwrite them
            gen.session.capture.remove()

    def add_lookup(self, vocab_size: int, seed: int, new_tokens: int, num_rounds: int) -> None:
        """Indexes a synthetic history of `length + 1` tokens (the ids when the first round runs) in the lookup
        generator's index (`prefill_index_ms`, `index_bytes`); each of its rounds then ends `new_tokens` fresh random
        ids further (`next_lookup_ids`), which its `plan_round` adds to the index before querying it, as after a
        verification (the query misses: the drafter still drafts, the round's full cost)."""
        rng = random.Random(seed + 1)
        round_tokens = [rng.randrange(vocab_size) for _ in range(new_tokens * num_rounds)]
        history = lookup_history(self.length + 1, vocab_size, seed)
        gen = self.gens["longspark_lookup"]
        seconds, _ = timed_call(gen.planner.lookup.extend, history)
        self.prefill_index_ms, self.index_bytes = 1000.0 * seconds, gen.planner.lookup.nbytes
        self.lookup_ids = torch.tensor([history + round_tokens], device=gen.session.drafter.device)
        self.lookup_length, self.new_tokens = len(history), new_tokens

    def next_lookup_ids(self) -> torch.LongTensor:
        self.lookup_length += self.new_tokens
        if self.lookup_length > self.lookup_ids.shape[1]:
            raise RuntimeError(f"More lookup rounds than the {self.lookup_ids.shape[1]} tokens planned for.")
        return self.lookup_ids[:, : self.lookup_length]

    def phases(self, name: str) -> tuple[Callable, Callable]:
        """The two timed phases of one round: the context update, then the proposal, a whole block after the prefix
        ids, or for `longspark_lookup` the real round's (`max_proposal_tokens` at most) after the next round's ids."""
        gen = self.gens[name]

        def propose(context):
            if name == "longspark_lookup":
                requests = requests_after(self.next_lookup_ids(), gen.session.settings.max_proposal_tokens)
            else:
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
        if self.lookup_ids is not None:
            row["lookup_overhead_ms"] = row["longspark_lookup_ms"] - row["longspark_ms"]
            row["lookup_index_bytes"] = self.index_bytes
            row["lookup_prefill_index_ms"] = self.prefill_index_ms
            row["lookup_hit_rounds"] = gens["longspark_lookup"].stats.lookup_rounds
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
    for name in (name for name in DRAFTERS if f"{name}_ms" in shortest):
        for row in rows:
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

    For each prefix length `t` of `settings` (`DraftingCostSettings`, default `DraftingCostSettings()`): the target
    prefills `t` tokens (`prefix_ids`, at least the longest prefix + 1 ids, else seeded random ids) into a
    DynamicCache once; then one `LongSparkCandidateGenerator` per drafter, built as `generate` builds it, runs
    `warmup + rounds` drafting rounds on that cache (context update, then proposal of one block of `B` greedy tokens),
    all lengths and drafters interleaved in one loop. Each LongSpark round folds `B + 1` rows into the global summary,
    as a round that accepts a whole block does. Times are medians over the measured rounds.

    Prefixes beyond the target's `max_position_embeddings` are skipped (`skipped`) unless `allow_extrapolation`;
    `synthetic_prefix_lengths` run on a `synthetic_cache` at any length. With `lookup_min_match > 0`, a third
    generator, `longspark_lookup`, runs the real round with the lookup source on (`_Prefix.add_lookup`): each round adds
    `lookup_new_tokens` fresh tokens to its index, queries it and drafts the block on a miss.

    Returns:
        One list per field of `ROW_FIELDS` (and with lookup `LOOKUP_ROW_FIELDS`; what each holds: `NOTES`), the same
        as `rows` (one dict per length), `round_cost_ratio` (longest over shortest prefix, per drafter) and metadata.
    """
    settings = settings or DraftingCostSettings()
    rounds, warmup, seed = settings.rounds, settings.warmup, settings.seed
    config, lookup = drafter.config, settings.lookup_fields()
    block = config.block_size
    new_tokens = block + 1 if settings.lookup_new_tokens is None else settings.lookup_new_tokens
    text_config = target.config.get_text_config()
    max_positions, vocab = text_config.max_position_embeddings, text_config.vocab_size
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    lengths, skipped = _usable_lengths(
        settings.prefix_lengths, block, max_positions, rope, settings.allow_extrapolation
    )
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
    with torch.no_grad(), generation_config_fields(drafter, lookup):
        for length in tqdm(lengths, desc="prefill", unit="prefix", disable=not settings.progress):
            input_ids = tokens[: length + 1].to(device)[None]
            gens = _generators(target, drafters, input_ids, bool(lookup))  # all capture the prefill's boundary states
            cache = prefill(target, input_ids[:, :length], settings.prefill_chunk)
            prefixes.append(_Prefix(length, cache, gens, input_ids, synthetic=False))
        for length in synthetic_lengths:
            input_ids = torch.randint(0, vocab, (1, length + 1), generator=generator).to(device)
            gens = _generators(target, drafters, input_ids, bool(lookup))
            cache = synthetic_cache(target, config.target_layer_ids, length, seed)
            for slot in range(len(config.target_layer_ids)):
                state = torch.randn(1, block + 1, text_config.hidden_size, device=device, dtype=dtype)
                for gen in gens.values():
                    gen.session.capture.states[slot] = state
            prefixes.append(_Prefix(length, cache, gens, input_ids, synthetic=True))
        if lookup:
            for prefix in tqdm(prefixes, desc="lookup index", unit="prefix", disable=not settings.progress):
                prefix.add_lookup(vocab, seed + prefix.length, new_tokens, warmup + rounds)
        rows = _time_all(prefixes, rounds, warmup, device, "drafting rounds" if settings.progress else None)
    del prefixes

    fields = ROW_FIELDS + (LOOKUP_ROW_FIELDS if lookup else ())
    result: dict[str, Any] = {"prefix_lengths" if f == "prefix_length" else f: [row[f] for row in rows] for f in fields}
    longest = max(rows, key=lambda row: row["prefix_length"], default=None)
    ratio = longest and {"lengths": [min(row["prefix_length"] for row in rows), longest["prefix_length"]]}
    for name in (name for name in DRAFTERS if ratio and f"{name}_ms_vs_shortest" in longest):
        ratio[name] = longest[f"{name}_ms_vs_shortest"]  # e.g. 128K / 512
    result.update(
        round_cost_ratio=ratio,
        lookup={**lookup, "new_tokens_per_round": new_tokens, "history": LOOKUP_HISTORY} if lookup else None,
        benchmark="drafting-cost",
        rows=rows,
        synthetic_prefix_lengths=synthetic_lengths,
        rounds=rounds,
        warmup=warmup,
        prefix_source="random" if prefix_ids is None else "given",
        skipped=skipped,
        max_position_embeddings=max_positions,
        rope_parameters=rope,
        block_size=block,
        window_size=config.window_size,
        num_summary_queries=config.num_summary_queries,
        num_draft_layers=config.num_draft_layers,
        dtype=str(next(drafter.parameters()).dtype),
        notes=NOTES + (LOOKUP_NOTES if lookup else ""),
        machine=machine_info(device),
    )
    return result


__all__ = ["LOOKUP_ROW_FIELDS", "SelectedLayersCache", "full_prefix_state_bytes", "lookup_history",
           "run_drafting_cost", "synthetic_cache"]  # fmt: skip
