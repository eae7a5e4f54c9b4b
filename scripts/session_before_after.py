"""This session's changes, before and after, side by side in one run: plain `generate`, plain decoding on the fast path
with the old kernel choice (one-token steps on `F.linear`, prefills on sgemm) and the calibrated one, and LongSpark
with the old choice and the first-round planner (`PRIOR_ROUNDS = 0`) against the shipped code, interleaved prompt by
prompt. Prints decode tok/s (the tokens after the first over the time after it) per method and mode.

    python scripts/session_before_after.py --num-threads 2 --num-short 6 --num-long 2
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from transformers_longspark.benchmarks.prompts import long_context_prompts, short_prompts
from transformers_longspark.inference import calibration, planning
from transformers_longspark.inference.verification import fast_verification
from transformers_longspark.loading import load_drafter, load_smollm2

BEFORE_ROWS = {"blas_max_rows": 1, "max_packed_rows": 64}
CALIBRATED = calibration.Calibration.fast_path_rows


class FirstToken(BaseStreamer):
    def __init__(self):
        self.puts, self.time = 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.time = time.perf_counter()

    def end(self):
        pass


@contextlib.contextmanager
def before():
    """The session's first code: the old kernel choice and the first round replacing a source's means."""
    calibration.Calibration.fast_path_rows = property(lambda self: BEFORE_ROWS)
    planning.PRIOR_ROUNDS = 0
    try:
        yield
    finally:
        calibration.Calibration.fast_path_rows, planning.PRIOR_ROUNDS = CALIBRATED, 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--num-short", type=int, default=6)
    parser.add_argument("--num-long", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    target, tokenizer = load_smollm2()
    drafter = load_drafter(target)[0]
    rows = calibration.calibration_for_generate(target, drafter).fast_path_rows

    def run(ids, mode, new_tokens, method):
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=mode == "T=1")
        path = contextlib.nullcontext()
        if method.startswith("plain fast path"):
            kwargs["cache"] = DynamicCache(config=target.config)
            kernels = BEFORE_ROWS if "before" in method else rows
            path = fast_verification(target, kwargs["cache"], ids.shape[1] + new_tokens, **kernels)
        elif method.startswith("LongSpark"):
            kwargs["assistant_model"] = drafter
            path = before() if "before" in method else contextlib.nullcontext()
        torch.manual_seed(0)
        streamer = FirstToken()
        with path:
            out = target.generate(ids, streamer=streamer, **kwargs)
        return out, out.shape[1] - ids.shape[1] - 1, time.perf_counter() - streamer.time

    methods = ["plain generate", "plain fast path, before", "plain fast path, after", "LongSpark, before",
               "LongSpark, after"]  # fmt: skip
    workloads = [("short", mode, short_prompts(tokenizer, args.num_short), 96) for mode in ("greedy", "T=1")]
    workloads.append(("long 4K", "greedy", long_context_prompts(tokenizer, [4096], args.num_long), 64))
    for name, mode, prompts, new_tokens in workloads:
        totals = {m: [0, 0.0] for m in methods}
        for prompt in prompts:
            ids = torch.tensor([prompt["input_ids"]])
            reference = None
            for method in methods:
                out, tokens, seconds = run(ids, mode, new_tokens, method)
                if mode == "greedy":
                    reference = out if reference is None else reference
                    if not torch.equal(out, reference):
                        raise SystemExit(f"{method}: greedy output differs on {prompt['name']}")
                totals[method][0] += tokens
                totals[method][1] += seconds
        speed = {m: t / s for m, (t, s) in totals.items()}
        for method in methods:
            best_before = max(speed["plain generate"], speed["plain fast path, before"])
            best_after = max(speed["plain generate"], speed["plain fast path, after"])
            best = best_before if "before" in method else best_after
            over_plain = speed[method] / speed["plain generate"]
            print(f"{name} {mode}: {method}: {speed[method]:.1f} decode tok/s, {over_plain:.2f}x plain generate, "
                  f"{speed[method] / best:.2f}x the best plain path of its code")  # fmt: skip


if __name__ == "__main__":
    main()
