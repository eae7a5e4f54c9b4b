"""Per-op profile of one LongSpark drafting round (context update + proposal) at two prefix lengths, side by side.

    python scripts/profile_drafting.py --prefix-lengths 512 8192 --rounds 40 --num-threads 2

Prints, per op, the self CPU milliseconds per round at each length and their ratio, so that anything whose cost grows
with the prefix stands out. Uses the SmolLM2 demo target and the shipped drafter (whole blocks).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from transformers import GenerationConfig

from transformers_longspark.benchmarks import long_context_prompts, prefill
from transformers_longspark.inference.generation import LongSparkCandidateGenerator
from transformers_longspark.loading import load_drafter, load_target


def profile_rounds(target, drafter, input_ids: torch.Tensor, rounds: int) -> tuple[dict[str, float], float]:
    """Self CPU ms per round of each op, and the wall ms per round, for `rounds` steady-state drafting rounds."""
    length = input_ids.shape[1] - 1
    block = drafter.config.block_size
    gen = LongSparkCandidateGenerator(target, drafter, input_ids, GenerationConfig(max_length=length + 2 * block), None)
    gen.token_threshold = gen.block_threshold = 0.0
    cache = prefill(target, input_ids[:, :length])
    gen.capture.remove()

    def one_round():
        gen.state.num_absorbed = length - (block + 1)
        gen.propose(input_ids, gen.update_context(cache, length, 0), block)

    for _ in range(5):
        one_round()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(rounds):
            one_round()
    per_op: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        per_op[event.key] += event.self_cpu_time_total / 1000.0 / rounds
    wall = sum(per_op.values())
    return per_op, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-lengths", type=int, nargs=2, default=[512, 8192])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    target, tokenizer = load_target("smollm2")
    drafter, _ = load_drafter(target)
    short, long = args.prefix_lengths
    code = long_context_prompts(tokenizer, [long + 1], 1)[0]["input_ids"]
    profiles = []
    with torch.no_grad():
        for length in (short, long):
            profiles.append(profile_rounds(target, drafter, torch.tensor([code[: length + 1]]), args.rounds))
    (first, first_total), (second, second_total) = profiles
    ops = sorted(set(first) | set(second), key=lambda op: -max(first.get(op, 0.0), second.get(op, 0.0)))
    print(f"{'op':<52} {short:>9} {long:>9}  ratio   (self CPU ms per round)")
    for op in ops[: args.top]:
        a, b = first.get(op, 0.0), second.get(op, 0.0)
        print(f"{op[:52]:<52} {a:9.3f} {b:9.3f}  {b / a if a else float('inf'):5.2f}")
    print(f"{'total':<52} {first_total:9.3f} {second_total:9.3f}  {second_total / first_total:5.2f}")


if __name__ == "__main__":
    main()
