"""A controlled long-range task: needle recall, where the tokens a drafter must propose lie beyond its recent window
(the experiment and its results: docs/results.md, "Needle recall beyond the window").

The synthetic language (`RecallLanguage`) is `BOS filler NEEDLE n_1 ... n_L filler (distance rows) QUERY n_1 ... n_L`,
`n_i` drawn from its own group of `group_size` tokens, the fillers from a disjoint group. A tiny target trained on it
(`train_target`) answers the query by attention to the needle, however far back; a drafter drafting the answer can
know the needle only from what it reads of the prefix: its recent window when the needle is inside it, else the global
summary or whatever the target's boundary state carries. Drafters trained at equal budget (`train_drafter`) and
measured by the needle's distance (`recall_acceptance`) give the paper's ablation (Table 4) on a task a CPU affords.
`scripts/long_range_ablation.py` runs the experiment; `tests/test_long_range_recall.py` a small version of it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..benchmarks.report import table
from ..benchmarks.settings import DRAFTER_ALONE, WHOLE_BLOCKS
from ..configuration_longspark import LongSparkConfig
from ..inference.stats import DraftingStats, tau
from ..modeling_longspark import LongSparkDrafterModel
from ..training.data import Sequence
from ..training.distillation import sample_anchors, sequence_loss

# The drafter's context views that the ablations switch off (paper, Table 4), by variant name.
VARIANTS: dict[str, dict[str, bool]] = {
    "full": {},
    "no-summary": {"use_global_summary": False},
    "no-boundary": {"use_boundary_state": False},
    "no-window": {"use_recent_window": False},
    "window-dropout": {},
}
# Variants that differ in training only: "window-dropout" is the full drafter trained with half of its anchors'
# windows masked out (`training.distillation.teacher_forced_batch`), so that the summary must carry the far needle.
TRAINING_OPTIONS: dict[str, dict[str, float]] = {"window-dropout": {"window_dropout": 0.5}}
# The paper's ablation (Table 4): average tau of Qwen3-8B's drafter on its benchmarks.
PAPER_ABLATION = {"full": 4.69, "no-summary": 4.35, "no-boundary": 4.28, "no-window": 3.71}


@dataclass(frozen=True)
class RecallLanguage:
    """Token layout of the needle-recall language: 4 special tokens (BOS, NEEDLE, QUERY and the drafter's MASK,
    which never occurs in the data), `needle_length` groups of `group_size` needle tokens, `num_filler` fillers."""

    needle_length: int = 8
    group_size: int = 16
    num_filler: int = 32
    max_lead: int = 16

    BOS, NEEDLE, QUERY, MASK = 0, 1, 2, 3

    @property
    def vocab_size(self) -> int:
        return 4 + self.needle_length * self.group_size + self.num_filler

    def sample(self, distance: int, generator: torch.Generator) -> tuple[torch.LongTensor, int]:
        """One sequence whose answer's needle lies `distance` filler rows before the query: `(ids, query_index)`;
        the answer `n_1 .. n_L` is `ids[query_index + 1:]`."""
        length, groups = self.needle_length, self.group_size
        needle = 4 + torch.arange(length) * groups + torch.randint(groups, (length,), generator=generator)
        filler_start = 4 + length * groups

        def filler(n: int) -> torch.Tensor:
            return filler_start + torch.randint(self.num_filler, (n,), generator=generator)

        lead = int(torch.randint(self.max_lead + 1, (1,), generator=generator))
        parts = [torch.tensor([self.BOS]), filler(lead), torch.tensor([self.NEEDLE]), needle, filler(distance)]
        prompt = torch.cat([*parts, torch.tensor([self.QUERY])])
        return torch.cat([prompt, needle]), len(prompt) - 1

    def training_sequence(self, distance: int, generator: torch.Generator) -> Sequence:
        """A drafter training sequence whose anchors are the answer's tokens (`training.data.Sequence`)."""
        ids, query = self.sample(distance, generator)
        return Sequence(ids, prompt_length=query + 1, anchor_start=query + 1)


def log_uniform_distances(low: int, high: int, count: int, generator: torch.Generator) -> list[int]:
    """`count` filler distances drawn log-uniformly from `[low, high]`."""
    u = torch.rand(count, generator=generator)
    return [int(math.exp(math.log(low) + float(x) * (math.log(high) - math.log(low)))) for x in u]


def _distance_cap(step: int, steps: int, first: int, last: int) -> int:
    """The longest distance trained at `step`: from `first` growing geometrically to `last` over the first half."""
    return max(2, min(last, int(first * (last / first) ** min(1.0, 2 * step / steps))))


def _train(parameters: list, lr: float, steps: int, step_loss, log_every: int, name: str) -> list[dict[str, float]]:
    """AdamW over `parameters`: 20 warm-up steps, then cosine decay to 0 at `steps`, gradients clipped to norm 1.
    `step_loss(step)` backpropagates one step's loss and returns `(loss, note for the log line)`. Returns the log
    (`step`, `loss`, `seconds`)."""
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    log, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, step / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        optimizer.zero_grad(set_to_none=True)
        loss, note = step_loss(step)
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        log.append({"step": step, "loss": loss, "seconds": time.perf_counter() - start})
        if log_every and step % log_every == 0:
            print(f"{name} step {step}: loss {loss:.4f}{note}", flush=True)
    return log


def tiny_target(language: RecallLanguage, max_positions: int, seed: int = 0, **overrides: Any):
    """A small Qwen3 target for the language (2 layers of width 128, RoPE base 1e6 so that content attention reaches
    far)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = dict(
        vocab_size=language.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=language.BOS,
        eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    fields.update(overrides)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**fields))


def train_target(
    target,
    language: RecallLanguage,
    steps: int,
    max_distance: int,
    batch_size: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
    log_every: int = 0,
) -> list[dict[str, float]]:
    """Trains `target` to answer the query (cross-entropy on the answer tokens only), each step's batch at one
    log-uniform distance in `[1, cap]`, where the cap grows from 256 to `max_distance` over the first half of the
    steps (the recall circuit forms fast on short sequences, then reaches out). Returns the log."""
    generator = torch.Generator().manual_seed(seed)
    target.train()

    def step_loss(step: int) -> tuple[float, str]:
        distance = log_uniform_distances(1, _distance_cap(step, steps, 256, max_distance), 1, generator)[0]
        samples = [language.sample(distance, generator) for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in samples)
        ids = torch.stack([F.pad(ids, (width - len(ids), 0), value=language.BOS) for ids, _ in samples])
        logits = target(input_ids=ids[:, :-1]).logits
        answer = slice(width - 1 - language.needle_length, width - 1)  # left-padded: answers end every row
        loss = F.cross_entropy(logits[:, answer].flatten(0, 1).float(), ids[:, answer.start + 1 :].flatten())
        loss.backward()
        return loss.item(), f" at distance {distance}"

    return _train(list(target.parameters()), lr, steps, step_loss, log_every, "target")


def recall_drafter(target, language: RecallLanguage, variant: str = "full", seed: int = 1, **overrides: Any):
    """A drafter for the task's target with the switches of `variant` (`VARIANTS`), drafting `needle_length` slots
    (the anchor `n_1` and the drafts `n_2 .. n_L`)."""
    if variant not in VARIANTS:
        raise ValueError(f"Unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}.")
    fields = dict(
        block_size=language.needle_length, num_summary_queries=16, markov_rank=16, mask_token_id=language.MASK,
        num_selected_layers=target.config.num_hidden_layers, **VARIANTS[variant],
    )  # fmt: skip
    fields.update(overrides)
    torch.manual_seed(seed)
    drafter = LongSparkDrafterModel(LongSparkConfig.from_target_config(target.config, **fields))
    for name, value in {**DRAFTER_ALONE, **WHOLE_BLOCKS}.items():  # every round drafts a whole block
        setattr(drafter.generation_config, name, value)
    return drafter


def train_drafter(
    target,
    drafter: LongSparkDrafterModel,
    language: RecallLanguage,
    steps: int,
    max_distance: int,
    sequences_per_step: int = 4,
    lr: float = 3e-3,
    seed: int = 0,
    log_every: int = 0,
    window_dropout: float = 0.0,
) -> list[dict[str, float]]:
    """Trains `drafter` with the library's distillation loss (`training.distillation.sequence_loss`, the same
    forward as inference) on answers at log-uniform distances in `[1, max_distance]`. Returns the log."""
    generator = torch.Generator().manual_seed(seed)
    target.eval().requires_grad_(False)
    drafter.bind_target(target)
    drafter.train()

    def step_loss(step: int) -> tuple[float, str]:
        total = 0.0
        for distance in log_uniform_distances(1, max_distance, sequences_per_step, generator):
            sequence = language.training_sequence(distance, generator)
            anchors = sample_anchors(sequence, language.needle_length, generator)
            loss = sequence_loss(target, drafter, sequence, anchors, window_dropout=window_dropout, generator=generator)
            loss = loss / sequences_per_step
            loss.backward()
            total += loss.item()
        return total, ""

    log = _train([p for p in drafter.parameters() if p.requires_grad], lr, steps, step_loss, log_every, "drafter")
    drafter.eval()
    return log


@torch.no_grad()
def recall_acceptance(
    target,
    drafters: dict[str, LongSparkDrafterModel],
    language: RecallLanguage,
    distances: Sequence_[int],
    num_prompts: int,
    seed: int = 1234,
) -> list[dict[str, Any]]:
    """Greedy `target.generate(assistant_model=drafter)` of the answer, drafter alone (every round drafts whole
    blocks), for `num_prompts` held-out sequences per distance (the same ones for every drafter).

    Returns one row per distance and drafter: `tau` over the answers (at most `L - 1`: one round accepting every
    draft), the per-position `acceptance_rates`, `target_accuracy` (answers the target gets right) and whether the
    needle lay inside the drafter's recent window."""
    rows = []
    target.eval()
    for distance in distances:
        generator = torch.Generator().manual_seed(seed + distance)
        prompts = [language.sample(distance, generator) for _ in range(num_prompts)]
        outputs = {}
        for name, drafter in drafters.items():
            drafter.eval()
            total, correct, outputs[name] = DraftingStats(), 0, []
            for ids, query in prompts:
                prompt = ids[None, : query + 1]
                out = target.generate(
                    prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=language.needle_length,
                    do_sample=False, assistant_model=drafter,
                )  # fmt: skip
                answer = out[0, query + 1 :]
                outputs[name].append(answer.tolist())
                correct += int(torch.equal(answer, ids[query + 1 :]))
                stats = drafter.drafting_stats
                total.rounds += stats.rounds
                total.record_accepted([k for k, count in enumerate(stats.accepted_histogram) for _ in range(count)])
            window = drafter.config.window_size if drafter.config.use_recent_window else 0
            rows.append(
                {
                    "distance": distance,
                    "drafter": name,
                    "needle_in_window": distance + language.needle_length + 1 <= window,
                    "prompts": num_prompts,
                    "rounds": total.rounds,
                    "tau": tau(num_prompts * language.needle_length, total.rounds, num_prompts),
                    "acceptance_rates": total.acceptance_rates(),
                    "target_accuracy": correct / num_prompts,
                }
            )
        reference = next(iter(outputs.values()))
        for row in rows[-len(drafters) :]:
            row["greedy_identical"] = outputs[row["drafter"]] == reference
    return rows


def format_ablation(result: dict[str, Any]) -> str:
    """Markdown table of `scripts/long_range_ablation.py`'s result: each variant's tau by the needle's distance,
    beside the paper's ablation (Table 4, tau on its benchmarks)."""
    setup, rows = result["setup"], result["rows"]
    drafters = list(dict.fromkeys(row["drafter"] for row in rows))
    distances = list(dict.fromkeys(row["distance"] for row in rows))
    cells = {(row["drafter"], row["distance"]): row for row in rows}
    inside = {d: d + setup["needle_length"] + 1 <= setup["window"] for d in distances}
    header = ["variant", *(f"{d:,}{' (in window)' if inside[d] else ''}" for d in distances), "paper (Table 4)"]
    taus = [[name, *(f"{cells[name, d]['tau']:.2f}" for d in distances), str(PAPER_ABLATION.get(name, "-"))]
            for name in drafters]  # fmt: skip
    lines = table(header, taus, "l" + "r" * (len(distances) + 1))
    accuracy = min(row["target_accuracy"] for row in rows)
    identical = all(row["greedy_identical"] for row in rows)
    lines += [
        "",
        f"Greedy tau on the {setup['needle_length']}-token answer (at most {setup['needle_length'] - 1}: one round "
        f"accepting every draft) by the needle's distance in filler rows before the query; {rows[0]['prompts']} "
        f"held-out prompts per distance; recent window {setup['window']} rows; each drafter trained "
        f"{setup['drafter_steps']} steps on the same sequences. The target answers every prompt correctly: "
        f"{'yes' if accuracy == 1.0 else f'no (>= {accuracy:.0%})'}; greedy outputs identical across drafters: "
        f"{'yes' if identical else 'NO'}.",
    ]
    return "\n".join(lines) + "\n"


__all__ = ["PAPER_ABLATION", "TRAINING_OPTIONS", "VARIANTS", "RecallLanguage", "format_ablation",
           "log_uniform_distances", "recall_acceptance", "recall_drafter", "tiny_target", "train_drafter",
           "train_target"]  # fmt: skip
