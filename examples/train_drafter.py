"""Train a LongSpark drafter for your own target, end to end: regenerate -> train -> held-out tau -> speed -> model card
-> `target.generate(assistant_model=drafter)`.

    python examples/train_drafter.py [--target DIR] [--work runs/example-drafter] [--num-prompts 96] [--steps 240]
                                     [--num-threads 2]

Each step is the `longspark` command a user runs (called in-process here, printed before it runs), on the offline
SmolLM2-135M-Instruct target by default or on `--target DIR` (a local chat model folder with its tokenizer):

1. `longspark regenerate`: the target's own answers to `--num-prompts` GSM8K and stdlib-code prompts (3 per source
   held out for evaluation), at most 128 tokens each;
2. `longspark train`: a drafter warm-started from the target's layers (`init_from_target`), `--steps` steps of 32
   anchors on 512-token sequences;
3. `longspark bench tau`: its greedy tau on the held-out prompts (drafter alone: every round drafts);
4. `longspark bench speed`: plain `generate` against LongSpark on two held-out prompts;
5. `longspark card`: the model card (`README.md`) in the drafter's folder, from 3-4;
6. the trained drafter in `generate`, with its output compared to plain greedy decoding.

About 7-8 minutes on a 2-core CPU with the defaults (7.5 on a 2-vCPU AMD EPYC: held-out tau 1.18, output identical).
A drafter this briefly trained accepts little;
the shipped SmolLM2 drafter is the same recipe at a larger budget (docs/training.md). Everything lands in `--work`;
rerunning resumes the regeneration and starts the training over.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path

import yaml

from transformers_longspark.cli import main as longspark


def run(*argv: str) -> None:
    print(f"\n$ longspark {shlex.join(argv)}", flush=True)
    longspark(list(argv))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2", help="a local chat model folder (default: the SmolLM2 demo)")
    parser.add_argument("--work", type=Path, default=Path("runs/example-drafter"))
    parser.add_argument("--num-prompts", type=int, default=96, help="training prompts to regenerate")
    parser.add_argument("--steps", type=int, default=240, help="training steps")
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    work, threads, started = args.work, str(args.num_threads), time.monotonic()
    target = [] if args.target == "smollm2" else ["--target", args.target]

    run("regenerate", "--prompts", "gsm8k", "stdlib-code", "--held-out", "3", "--limit", str(args.num_prompts),
        "--max-new-tokens", "128", "--batch-size", "16", "--num-threads", threads, "--output", str(work / "data"),
        *target)  # fmt: skip

    config = {
        "target": args.target,
        "train_data": str(work / "data" / "train"),
        "eval_data": str(work / "data" / "held_out"),
        "output_dir": str(work / "run"),
        "init_from_target": True,
        "drafter": {"intermediate_size": 1024, "markov_rank": 32},
        "max_seq_len": 512,
        "anchors_per_sequence": 32,
        "gradient_accumulation_steps": 1,
        "learning_rate": 1.0e-3,
        "max_steps": args.steps,
        "checkpoint_every": args.steps,
        "eval_every": args.steps,
        "eval_sequences": 2,
        "tau_prompts": 0,
        "num_threads": args.num_threads,
    }
    config_file = work / "train.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    run("train", "--config", str(config_file))
    drafter_dir = work / "run" / "final"

    held_out = str(work / "data" / "held_out")
    common = ("--num-threads", threads, "--held-out", held_out, "--workloads", "short", "--quiet", *target)
    run("bench", *common, "--num-short-prompts", "6", "--max-new-tokens", "64", "--json", str(work / "tau.json"),
        "tau", "--drafter", f"trained={drafter_dir}", "--drafter-alone")  # fmt: skip
    run("bench", *common, "--drafter", str(drafter_dir), "--num-short-prompts", "2", "--max-new-tokens", "64",
        "--modes", "greedy", "--methods", "plain", "longspark", "--json", str(work / "speed.json"),
        "speed")  # fmt: skip
    base_model = [] if args.target == "smollm2" else ["--base-model", Path(args.target).name]
    run("card", str(drafter_dir), "--benchmark", str(work / "speed.json"), "--training-config", str(config_file),
        "--training-log", str(work / "run" / "log.jsonl"), "--repo-id", f"<your-org>/longspark-{work.name}",
        *base_model)  # fmt: skip

    import torch

    from transformers_longspark import LongSparkDrafterModel
    from transformers_longspark.loading import load_target

    model, tokenizer = load_target(None if args.target == "smollm2" else args.target)
    drafter = LongSparkDrafterModel.from_pretrained(drafter_dir)
    messages = [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many in all?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    plain = model.generate(**inputs, max_new_tokens=64, do_sample=False)
    assisted = model.generate(**inputs, max_new_tokens=64, do_sample=False, assistant_model=drafter)
    tau = json.loads((work / "tau.json").read_text())["rows"][0]["tau"]
    print(f"\n{tokenizer.decode(assisted[0, inputs['input_ids'].shape[1] :], skip_special_tokens=True)}\n")
    minutes = (time.monotonic() - started) / 60
    print(f"identical to plain greedy generate: {torch.equal(plain, assisted)}; held-out tau (drafter alone) "
          f"{tau:.2f}; drafter and its card in {drafter_dir}; {minutes:.1f} min in all.")  # fmt: skip


if __name__ == "__main__":
    main()
