"""Held-out accepted length tau of LongSpark drafters on long code prefixes (SmolLM2 target, greedy).

For each held-out file (`load_files`: the first `--num-files` that hold at least the longest prefix plus the new
tokens, round-robin over the languages of `scripts/prepare_corpora.py`'s code corpus) and each prefix length, the
target is prefilled ONCE over the prefix, and every drafter then runs `target.generate(prefix, cache=<copy of that
cache>, assistant_model=drafter, max_new_tokens=N)` greedily. Every drafter sees the same files at every length.

`tau = sum(new tokens - 1) / sum(verification rounds)` over the files, per drafter and prefix length; the JSON also
holds per-file counts and whether all drafters produced the same tokens (greedy decoding is lossless, so they must).

    python scripts/eval_long_tau.py --drafter shipped=model_cards/longspark-smollm2-135m-instruct \
        --drafter block_start=runs/summary-positions-block-start-1k/final --json runs/long_tau.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch


def load_files(path: str, min_tokens: int, num_files: int, ids: list[str] | None = None, tokenizer=None) -> list[dict]:
    """`num_files` held-out files with at least `min_tokens` tokens (only those in `ids` when given): `{"id", "ids"}`.

    Reads the text corpora of `scripts/prepare_corpora.py` (`{"id", "text"}`, ids `<language>/...`: the files are
    taken round-robin over the languages, each language's in id order) or the token records of
    `scripts/prepare_long_code.py` (in id order)."""
    records = []
    for file in sorted(Path(path).glob("*.jsonl")):
        records += [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    records.sort(key=lambda r: r["id"])
    by_language: dict[str, list[dict]] = {}
    for r in records:
        if (ids is not None and r["id"] not in ids) or ("text" in r and len(r["text"]) < 2 * min_tokens):
            continue  # ~3-4 characters per code token: too short to tokenize
        tokens = tokenizer(r["text"], add_special_tokens=False)["input_ids"] if "text" in r else (
            r["prompt_ids"] + r["response_ids"])  # fmt: skip
        language = r["id"].split("/")[0] if "text" in r else ""
        if len(tokens) >= min_tokens:
            by_language.setdefault(language, []).append({"id": r["id"], "ids": tokens})
    longest = max((len(f) for f in by_language.values()), default=0)
    files = [f[i] for i in range(longest) for f in by_language.values() if i < len(f)][:num_files]
    if len(files) < num_files:
        raise ValueError(f"Only {len(files)} files in {path} hold {min_tokens} tokens; {num_files} were asked for.")
    return files


def resume_from_prefilled_cache(target) -> None:
    """Lets assisted `generate` start from a prefilled `cache`: transformers 5.24's assisted loop feeds the WHOLE
    prompt on its first forward even when the cache already holds all but its last token (plain `generate` slices
    it), so on that first forward only the uncached tail is fed. Eval-only shim, checked by `--check` (same tokens
    and rounds as a cold start)."""
    original = target.prepare_inputs_for_generation

    def prepare_inputs_for_generation(input_ids, next_sequence_length=None, cache=None, is_first_iteration=False, **kw):
        if is_first_iteration and next_sequence_length is None and cache is not None and cache.get_seq_length() > 0:
            next_sequence_length = input_ids.shape[1] - cache.get_seq_length()
        return original(input_ids, next_sequence_length=next_sequence_length, cache=cache,
                        is_first_iteration=is_first_iteration, **kw)  # fmt: skip

    target.prepare_inputs_for_generation = prepare_inputs_for_generation


@torch.no_grad()
def check_prefilled_start(target, drafter, ids: list[int], new_tokens: int) -> None:
    """Raises unless a prefilled start gives the same tokens and rounds as a cold start and as plain `generate`."""
    from transformers import DynamicCache

    prompt = torch.tensor([ids])
    cold = target.generate(prompt, assistant_model=drafter, max_new_tokens=new_tokens, do_sample=False)
    cold_rounds = drafter.drafting_stats.rounds
    cache = DynamicCache(config=target.config)
    target(prompt[:, :-1], cache=cache, use_cache=True)
    warm = target.generate(prompt, cache=cache, assistant_model=drafter, max_new_tokens=new_tokens, do_sample=False)
    plain = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    if not (torch.equal(cold, warm) and torch.equal(cold, plain) and cold_rounds == drafter.drafting_stats.rounds):
        raise RuntimeError(f"Prefilled start differs: rounds {cold_rounds} vs {drafter.drafting_stats.rounds}, tokens "
                           f"{torch.equal(cold, warm)}, plain {torch.equal(cold, plain)}.")  # fmt: skip
    print(f"check: prefilled start == cold start == plain generate ({cold_rounds} rounds)", flush=True)


@torch.no_grad()
def evaluate(target, drafters: dict, files: list[dict], lengths: list[int], new_tokens: int, dump=None) -> dict:
    """Per drafter and prefix length: summed new tokens and rounds, per-file counts and tau. `dump(partial result)`
    is called after each file, so a run stopped early still leaves its finished files."""
    from transformers import DynamicCache

    rows = {name: {length: {"new_tokens": 0, "rounds": 0, "files": []} for length in lengths} for name in drafters}
    identical = True
    for file in files:
        for length in lengths:
            prompt = torch.tensor([file["ids"][:length]])
            started = time.perf_counter()
            prefix_cache = DynamicCache(config=target.config)
            target(prompt[:, :-1], cache=prefix_cache, use_cache=True)
            prefill_s = time.perf_counter() - started
            outputs = []
            for name, drafter in drafters.items():
                started = time.perf_counter()
                out = target.generate(prompt, cache=copy.deepcopy(prefix_cache), assistant_model=drafter,
                                      max_new_tokens=new_tokens, do_sample=False)  # fmt: skip
                new, rounds = out.shape[1] - length, drafter.drafting_stats.rounds
                row = rows[name][length]
                row["new_tokens"] += new
                row["rounds"] += rounds
                row["files"].append({"id": file["id"], "new_tokens": new, "rounds": rounds,
                                     "seconds": round(time.perf_counter() - started, 2)})  # fmt: skip
                outputs.append(out[0, length:].tolist())
            same = all(o == outputs[0] for o in outputs)
            identical &= same
            print(f"{file['id']} [:{length}] prefill {prefill_s:.1f}s "
                  + " ".join(f"{name}={rows[name][length]['files'][-1]['rounds']}r" for name in drafters)
                  + ("" if same else " OUTPUTS DIFFER"), flush=True)  # fmt: skip
        for per_length in rows.values():
            for row in per_length.values():
                row["tau"] = (row["new_tokens"] - len(row["files"])) / max(1, row["rounds"])
        if dump is not None:
            dump({"tau": rows, "greedy_outputs_identical": identical})
    return {"tau": rows, "greedy_outputs_identical": identical}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", action="append", required=True, help="NAME=FOLDER, repeatable")
    parser.add_argument("--data", default="data/corpora/code/held_out", help="held-out code corpus")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000])
    parser.add_argument("--num-files", type=int, default=4)
    parser.add_argument("--file-ids", nargs="+", help="evaluate only these held-out files (record ids)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--json", required=True)
    parser.add_argument("--check", type=int, default=512, help="prefix length of the prefilled-start check, 0: none")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)

    from transformers_longspark import LongSparkDrafterModel  # registers LongSpark with transformers
    from transformers_longspark.loading import load_target

    target, tokenizer = load_target("smollm2")
    if max(args.lengths) + args.new_tokens + 8 > target.config.max_position_embeddings:
        raise ValueError(f"Prefix + new tokens exceed the target's {target.config.max_position_embeddings} positions.")
    drafters = {}
    for spec in args.drafter:
        name, folder = spec.split("=", 1)
        drafter = LongSparkDrafterModel.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
        # Only the drafter differs between rows: every drafter proposes full blocks through the stock verification
        # path (tau is the same with any lossless verification kernel; the prefilled-start shim is checked on it).
        if hasattr(drafter, "fast_verification"):
            drafter.fast_verification = False
        if getattr(drafter, "generation_config", None) is not None:
            drafter.generation_config.assistant_confidence_threshold = 0.0
        drafters[name] = drafter
    files = load_files(args.data, max(args.lengths) + args.new_tokens, args.num_files, args.file_ids, tokenizer)
    resume_from_prefilled_cache(target)
    if args.check:
        check_prefilled_start(target, next(iter(drafters.values())), files[0]["ids"][: args.check], args.new_tokens)
    started = time.perf_counter()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)

    def dump(result: dict) -> None:
        result.update(
            drafters={name: {"path": spec.split("=", 1)[1], "summary_key_positions": d.config.summary_key_positions}
                      for (name, d), spec in zip(drafters.items(), args.drafter)},
            files=[f["id"] for f in files], lengths=args.lengths, new_tokens=args.new_tokens,
            num_threads=args.num_threads, seconds=round(time.perf_counter() - started, 1),
        )  # fmt: skip
        Path(args.json).write_text(json.dumps(result, indent=1))

    result = evaluate(target, drafters, files, args.lengths, args.new_tokens, dump)
    dump(result)
    print("| drafter | " + " | ".join(f"tau@{n}" for n in args.lengths) + " |")
    for name, per_length in result["tau"].items():
        cells = [f"{row['tau']:.3f} ({row['rounds']} rounds)" for row in per_length.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
