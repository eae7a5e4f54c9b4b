#!/usr/bin/env python
"""Replays the source choice on the target's greedy answers, offline: tokens per target step of each planner setting,
side by side, at this machine's calibrated costs and at all-zero costs (a GPU), with hindsight bounds.

Greedy decoding of a record reproduces the record, so what any round would keep is known in advance: a lookup
continuation's leading matches with the answer, and a drafter block's leading argmax hits (teacher-forced, as in
`teacher_forced_tau.py`, Markov-corrected by the true predecessor), cut where the drafter's confidence cuts end it.
One target pass and one drafter forward per record give every anchor's; the replay then runs the package's own
`RoundPlanner` round by round, pricing each round with the cost model (`RoundCosts`). Every round of every record
counts, so settings that differ by a few percent are told apart where a timed run of a few prompts is not. The
hindsight bounds take, each round, the source and length that the answer shows to be worth most: with lookup alone,
and with both sources (what a perfect choice could get from the drafter as it is). `--lookup-num-tokens` replays each
cap on a lookup continuation's length in turn (default: the drafter's `lookup_num_tokens`).

    python scripts/planner_replay.py --num-threads 2 --records code=data/smollm2-code-greedy/held_out \
        --records chats=data/smollm2-greedy/held_out --limit 60 --long-files 8 --long-new-tokens 128 \
        --lookup-num-tokens 10 16 --json results/planner_replay.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from transformers_longspark.benchmarks.common import machine_info
from transformers_longspark.benchmarks.prompts import long_context_prompts
from transformers_longspark.inference.calibration import calibrated
from transformers_longspark.inference.drafting import LOOKUP_MAX_NGRAM, block_continues
from transformers_longspark.inference.knobs import DraftingKnobs
from transformers_longspark.inference.lookup import SuffixIndex
from transformers_longspark.inference.planning import RoundPlanner, Source
from transformers_longspark.inference.round_costs import RoundCosts
from transformers_longspark.loading import load_drafter, load_target
from transformers_longspark.training.data import Sequence, load_sequences

SETTINGS = {
    "lookup_alone": "lookup alone (drafter priced out)",
    "drafter_alone": "drafter alone, lengths planned",
    "competing": "both, valued against each other",
    "lookup_first": "both, a paying continuation first (shipped)",
    "hindsight_lookup": "hindsight: lookup alone",
    "hindsight_both": "hindsight: both sources",
}


@dataclass
class Record:
    """One greedy answer: `ids` (prompt + answer), the first anchor `start`, and per anchor `t` the drafter's block:
    `hits` `(T, B)` whether slot `i` is the greedy token, `confidence` `(T, B)` its law's largest probability."""

    ids: list[int]
    start: int
    hits: torch.Tensor
    confidence: torch.Tensor


def collect(target, drafter, sequence: Sequence) -> Record:
    from teacher_forced_tau import block_hits  # scripts/ (imported here: `render_results.py` loads this file too)

    return Record(sequence.ids.tolist(), sequence.anchor_start, *block_hits(target, drafter, sequence))


def long_code_sequences(target, tokenizer, num_files: int, new_tokens: int) -> list[Sequence]:
    """The speed benchmark's long prompts (held-out stdlib files cut at 4,096 tokens), each with its greedy answer."""
    sequences = []
    for prompt in long_context_prompts(tokenizer, [4096], num_prompts=num_files):
        ids = torch.tensor([prompt["input_ids"]])
        answer = target.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        sequences.append(Sequence(answer[0], ids.shape[1], source=prompt["name"]))
    return sequences


def block_length(confidence: torch.Tensor, cap: int, knobs: DraftingKnobs) -> int:
    """Drafts proposed of a block capped at `cap`, ended by the confidence cuts (greedy: a drawn token's probability
    is its law's confidence)."""
    proposed, block = 0, 1.0
    thresholds = knobs.assistant_confidence_threshold, knobs.block_confidence_threshold
    for i in range(cap):
        value = float(confidence[i])
        if i > 0 and not block_continues(value, block, *thresholds):
            break
        block, proposed = block * value, proposed + 1
    return proposed


def drafts_kept(record: Record, t: int, proposed: int) -> int:
    """The leading hits among the first `proposed` drafts of the block at anchor `t`."""
    return int(record.hits[t, :proposed].long().cumprod(0).sum())


def kept(proposal: list[int], answer: list[int]) -> int:
    count = 0
    while count < len(proposal) and count < len(answer) and proposal[count] == answer[count]:
        count += 1
    return count


def hindsight(record: Record, t: int, continuation: list[int], room: int, both: bool, costs: RoundCosts,
              knobs: DraftingKnobs) -> tuple[Source, int, int]:  # fmt: skip
    """The source and length worth most tokens per step this round, given the answer."""
    length, answer, best = t + 1, record.ids[t + 1 :], (1.0, Source.NONE, 0, 0)
    for k in range(1, len(continuation) + 1):
        accepted = kept(continuation[:k], answer)
        value = (1 + accepted) / (1 + costs.verify_cost(k, length))
        best = max(best, (value, Source.LOOKUP, k, accepted), key=lambda entry: entry[0])
    for cap in range(1, min(room, record.hits.shape[1]) + 1) if both else ():
        k = block_length(record.confidence[t], cap, knobs)
        accepted = drafts_kept(record, t, k)
        value = (1 + accepted) / (1 + costs.verify_cost(k, length) + costs.drafter_cost(length))
        best = max(best, (value, Source.DRAFTER, k, accepted), key=lambda entry: entry[0])
    return best[1:]


def replay(record: Record, setting: str, costs: RoundCosts, knobs: DraftingKnobs) -> tuple[float, float, Counter]:
    """Greedy decoding of `record` under `setting`: tokens, cost in target steps, rounds per source."""
    use_lookup, use_drafter = setting != "drafter_alone", setting not in ("lookup_alone", "hindsight_lookup")
    lookup = SuffixIndex(knobs.lookup_min_match, max(knobs.lookup_min_match, LOOKUP_MAX_NGRAM)) if use_lookup else None
    block_size = record.hits.shape[1]
    planner = RoundPlanner(costs, lookup, lookup_first=setting != "competing", block_size=block_size)
    tokens = cost = 0.0
    rounds: Counter = Counter()
    t, last = record.start, len(record.ids) - 2
    while t <= last:
        room, length, continuation, matched = last - t, t + 1, [], 0
        if lookup is not None:
            lookup.extend(record.ids[len(lookup) : length])
            continuation, matched = lookup.continuation(min(knobs.lookup_num_tokens or block_size, room))
            continuation = continuation if matched >= knobs.lookup_min_match else []
        if setting.startswith("hindsight"):
            source, k, accepted = hindsight(record, t, continuation, room, use_drafter, costs, knobs)
        else:
            source = planner.choose(continuation, can_draft=use_drafter and room > 0, length=length, matched=matched,
                                    room=room)  # fmt: skip
            if source is Source.LOOKUP:
                k = planner.lookup_length(len(continuation), matched, length)
                accepted = kept(continuation[:k], record.ids[t + 1 :])
            elif source is Source.DRAFTER:
                k = block_length(record.confidence[t], min(planner.draft_length, room), knobs)
                accepted = drafts_kept(record, t, k)
            else:
                k = accepted = 0
            planner.record(source, k, accepted)
        cost += 1 + (costs.verify_cost(k, length) if k else 0.0)
        cost += costs.drafter_cost(length) if source is Source.DRAFTER else 0.0
        tokens += 1 + accepted
        rounds[source.value] += 1
        t += 1 + accepted
    return tokens, cost, rounds


def format_table(report: dict) -> str:
    """One row per data set, costs and lookup cap: tokens per target step of each setting, and the drafter's share."""
    header = ["records", "costs", "lookup tokens", *(SETTINGS[s] for s in SETTINGS), "lookup first / competing",
              "lookup first / lookup alone", "hindsight: both / lookup"]  # fmt: skip
    lines = [f"| {' | '.join(header)} |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    for row in report["rows"]:
        value = {name: entry["tokens_per_step"] for name, entry in row["settings"].items()}
        cells = [f"{value[s]:.3f} (tau {row['settings'][s]['tau']:.2f})" for s in SETTINGS]
        ratios = [value["lookup_first"] / value["competing"], value["lookup_first"] / value["lookup_alone"],
                  value["hindsight_both"] / value["hindsight_lookup"]]  # fmt: skip
        lines.append(f"| {row['records']} ({row['num_records']}, {row['answer_tokens']:,} tokens) | {row['costs']} | "
                     f"{row['lookup_num_tokens']} | "
                     + " | ".join(cells + [f"{r:.3f}x" for r in ratios]) + " |")  # fmt: skip
    machine = report.get("machine", {})
    note = (f"Greedy decoding replayed on the target's greedy answers: tokens per target step (tau in brackets) of "
            f"the shipped drafter `{report['drafter']}`, each round priced by the cost model; `calibrated`: this "
            f"machine's calibration ({report['threads']} threads, a plain step {report['step_ms']:.1f} ms, a drafter "
            f"round {report['draft_round_cost']:.3f} steps), `zero`: all costs 0 (a GPU); "
            f"{machine.get('cpu', 'an unknown CPU')}, torch {machine.get('torch', '?')}.")  # fmt: skip
    return "\n".join([*lines, "", note]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", action="append", default=[], metavar="NAME=DIR", help="greedy records to replay")
    parser.add_argument("--limit", type=int, help="only the first N records of each set")
    parser.add_argument("--long-files", type=int, default=0, help="also the benchmark's long-code prompts (4K)")
    parser.add_argument("--long-new-tokens", type=int, default=128)
    parser.add_argument("--drafter", default="src/transformers_longspark/drafters/longspark-smollm2-135m-instruct")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--lookup-num-tokens", type=int, nargs="+", help="caps on a lookup continuation to replay")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    target, tokenizer = load_target(None)
    drafter, _ = load_drafter(target, args.drafter)
    drafter.bind_target(target)
    calibration = calibrated(target, drafter)
    knobs = DraftingKnobs.from_generation_config(drafter.generation_config)
    caps = args.lookup_num_tokens or [knobs.lookup_num_tokens]
    sets = {name: load_sequences(path, 4096)[: args.limit] for name, path in (s.split("=", 1) for s in args.records)}
    if args.long_files:
        sets["long code 4K"] = long_code_sequences(target, tokenizer, args.long_files, args.long_new_tokens)
    report = {"benchmark": "planner_replay", "drafter": args.drafter, "threads": args.num_threads,
              "step_ms": calibration.step_ms, "draft_round_cost": calibration.costs.draft_round_cost, "rows": [],
              "machine": machine_info()}  # fmt: skip
    for name, sequences in sets.items():
        records = [collect(target, drafter, sequence) for sequence in sequences]
        for (label, costs), cap in itertools.product((("calibrated", calibration.costs), ("zero", RoundCosts())), caps):
            row = {"records": name, "num_records": len(records), "costs": label, "lookup_num_tokens": cap,
                   "settings": {}, "answer_tokens": sum(len(r.ids) - r.start for r in records)}  # fmt: skip
            capped = replace(knobs, lookup_num_tokens=cap)
            for setting in SETTINGS:
                tokens, cost, rounds = 0.0, 0.0, Counter()
                for record in records:
                    t, c, r = replay(record, setting, costs, capped)
                    tokens, cost, rounds = tokens + t, cost + c, rounds + r
                row["settings"][setting] = {"tokens_per_step": tokens / cost, "tau": tokens / sum(rounds.values()),
                                            "rounds": dict(rounds)}  # fmt: skip
            report["rows"].append(row)
            print(name, label, cap, {s: round(v["tokens_per_step"], 3) for s, v in row["settings"].items()}, flush=True)
    print(format_table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
