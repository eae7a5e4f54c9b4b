"""Model cards written from measured benchmarks, and the Hub upload of a drafter folder."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from safetensors import safe_open

from .configuration_longspark import LongSparkConfig
from .files import read_json, read_jsonl, read_yaml, require_path

CARD_TEMPLATE = """---
{metadata}---

# LongSpark drafter for {base_model}

A LongSpark (`transformers-longspark`) speculative-decoding drafter for `{base_model}`: a
block-diffusion network that proposes {block_size} tokens per round from a fixed-size view of the target (boundary
state, the last {window_size} KV rows and a {num_summary_queries}-entry attention summary of target layers
{target_layer_ids}). Outputs are identical to the target's own; only the speed changes.{vocabulary}

## Usage

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers_longspark import LongSparkDrafterModel  # routes assistant_model=<LongSpark drafter> to LongSpark

target = AutoModelForCausalLM.from_pretrained("{base_model}")
tokenizer = AutoTokenizer.from_pretrained("{base_model}")
drafter = LongSparkDrafterModel.from_pretrained("{repo_id}")
inputs = tokenizer.apply_chat_template([{{"role": "user", "content": "Hello!"}}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)
out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=128)
```

## Measured

{results}

Measured with:

```bash
{command}
```

{machine}

## Training

{training}

{curve}
{acceptance}{notes}
The checkpoint holds only the drafter's own weights ({num_parameters:,} parameters); the target's embedding, final
norm and LM head are borrowed at run time.
"""


# The plain paths, then what each source adds (the attribution methods of `benchmarks/settings.py`), then LongSpark.
CARD_METHODS = (
    "plain", "plain_fast", "plain_static", "prompt_lookup_fast", "full_prefix",
    "longspark_drafter_only", "longspark_drafter_planned", "longspark_lookup_only", "longspark_no_proposals",
    "longspark",
)  # fmt: skip


def _results_table(reports: list[dict[str, Any]]) -> str:
    rows = [r for report in reports for r in report.get("rows", []) if r.get("method") in CARD_METHODS]
    rows.sort(key=lambda r: CARD_METHODS.index(r["method"]))
    rows.sort(key=lambda r: (r["workload"], r["mode"]))  # stable: methods stay in CARD_METHODS order
    lines = [
        "| workload | mode | method | tau | tokens/s | speedup | decode speedup | decode vs best plain "
        "| identical to target |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        identical = {True: "yes", False: "NO"}.get(r.get("greedy_identical"), "-")
        decode = f"{r['decode_speedup']:.2f}x" if r.get("decode_speedup") is not None else "-"
        best = r.get("decode_speedup_vs_best_plain")
        versus_best = f"{best:.2f}x" if best is not None else "-"
        lines.append(
            f"| {r['workload']} | {r['mode']} | {r['label']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} "
            f"| {r['speedup']:.2f}x | {decode} | {versus_best} | {identical} |"
        )
    lines += [
        "",
        "speedup: end to end (prompt processing included); decode speedup: the tokens after the first over "
        "the time after the prefill, which all methods share; decode vs best plain: over the fastest plain path of "
        "the same run (plain generate, plain decoding on the fast verification path, a static cache).",
    ]
    slow = [r for r in rows if r["method"] == "longspark" and r.get("decode_speedup", r["speedup"]) < 1.0]
    if slow:
        cases = ", ".join(f"{r['workload']} {r['mode']} {r.get('decode_speedup', r['speedup']):.2f}x" for r in slow)
        lines += [
            "",
            f"**On this machine the drafter decodes slower than plain generation in: {cases}. There, its "
            "accepted length does not pay for the drafting and the wider verification.**",
        ]
    return "\n".join(lines)


def _machine(report: dict[str, Any]) -> str:
    m = report.get("machine", {})
    return (
        f"Machine: {m.get('cpu', 'unknown')} ({m.get('cpu_cores', '?')} cores, {m.get('torch_threads', '?')} torch "
        f"threads), torch {m.get('torch', '?')}, transformers {m.get('transformers', '?')}."
    )


def _as_list(value: str | Path | list | None) -> list[Path]:
    if value is None:
        return []
    return [Path(v) for v in value] if isinstance(value, (list, tuple)) else [Path(value)]


def _training(training_configs: list[Path]) -> str:
    """The recipe of each training stage; a later stage starts from the drafter the previous one produced."""
    if not training_configs:
        return "See the training configuration shipped with the drafter."
    keys = (
        "init_drafter",
        "train_data",
        "eval_data",
        "max_seq_len",
        "anchors_per_sequence",
        "gradient_accumulation_steps",
        "learning_rate",
        "warmup_ratio",
        "epochs",
        "max_steps",
        "mixed_precision",
        "drafter",
    )
    parts = [
        "Distilled from the frozen target (the paper's Section 2.4: loss `0.1 * CE + 0.9 * ||p - q||_1` with position "
        "weights `exp(-(i-1)/4)`, where `p` is the target's own distribution at every position, so the text need "
        "not come from the target: regenerated responses and packed text corpora both teach it)"
        + (":" if len(training_configs) == 1 else f", in {len(training_configs)} stages:")
    ]
    for number, path in enumerate(training_configs, 1):
        values = read_yaml(path, "Training config")
        recipe = "\n".join(f"- `{k}`: {values[k]}" for k in keys if k in values)
        stage = f"Stage {number}, " if len(training_configs) > 1 else ""
        parts.append(f"{stage}`longspark train --config {path.name}`:\n\n{recipe}")
    return "\n\n".join(parts)


def _training_curve(training_logs: list[Path], tokens_per_sequence: float | None) -> str:
    """Held-out loss and tau against training sequences and tokens, from the trainers' `log.jsonl` files.

    Stages are cumulative. Tokens come from the logs' `tokens` field, or `sequences * tokens_per_sequence` for logs
    written without it."""

    def tokens_of(record: dict) -> float | None:
        if "tokens" in record:
            return record["tokens"]
        sequences = record.get("sequences")
        return sequences * tokens_per_sequence if sequences and tokens_per_sequence else None

    rows, sequence_offset, token_offset = [], 0, 0.0
    for stage, path in enumerate(training_logs, 1):
        records = read_jsonl(path, "Training log")
        for r in (r for r in records if "eval_tau" in r):
            sequences, tokens = r.get("sequences"), tokens_of(r)
            rows.append((stage, r, sequences and sequence_offset + sequences, tokens and token_offset + tokens))
        if records:
            sequence_offset += records[-1].get("sequences") or 0
            token_offset += tokens_of(records[-1]) or 0
    if not rows:
        return ""
    lines = [
        "Held-out evaluation during training (greedy tau on each stage's `eval_data`, so stages with different "
        "held-out sets do not compare; tokens and sequences are cumulative):",
        "",
        "| stage | step | sequences | tokens | held-out loss | tau |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for stage, r, sequences, tokens in rows:
        tokens = "-" if tokens is None else f"{tokens:,.0f}"
        lines.append(
            f"| {stage} | {r['step']} | {sequences or '-'} | {tokens} | {r['eval_loss']:.3f} | {r['eval_tau']:.2f} |"
        )
    return "\n".join(lines)


def _acceptance_curve(path: str | Path) -> str:
    """The card's acceptance-vs-length section: the table of a `bench tau --by-length` report, between the markers
    that `scripts/render_results.py` re-renders it from."""
    from .benchmarks.tau import format_tau_curve

    report = read_json(require_path(path, "Acceptance curve", "run `longspark bench tau --by-length --json FILE`."))
    return (
        "\n## Acceptance vs prefix length\n\nHow much of the drafter's acceptance the fixed-size state keeps as the "
        f"prefix grows (held-out code, the drafter alone):\n\n<!-- table:begin {Path(path).as_posix()} -->\n"
        f"{format_tau_curve(report)}<!-- table:end -->\n"
    )


def _read_notes(path: str | Path) -> str:
    return require_path(path, "Model card notes", "pass a Markdown file.").read_text(encoding="utf-8")


def _speed_report(path: Path) -> dict[str, Any]:
    require_path(path, "Benchmark report", f"write it with `longspark bench --json {path}`.")
    report = read_json(path, "Benchmark report")
    if not isinstance(report, dict):
        raise ValueError(f"{path} is not a `longspark bench` speed report (a JSON object).")
    if report.get("benchmark") != "speed":
        raise ValueError(f"{path} is not a `longspark bench` speed report (its 'benchmark' field).")
    return report


def _require_drafter_dir(drafter_dir: str | Path) -> Path:
    drafter_dir = require_path(drafter_dir, "Drafter folder", "pass the folder a drafter was saved to.")
    missing = [n for n in ("config.json", "model.safetensors") if not (drafter_dir / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{drafter_dir} is not a LongSpark drafter folder (no {' or '.join(missing)}); pass "
            "the folder a drafter was saved to, e.g. runs/NAME/final."
        )
    return drafter_dir


def write_model_card(
    drafter_dir: str | Path,
    benchmark_json: str | Path | list[str | Path],
    training_config: str | Path | list[str | Path] | None = None,
    base_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct",
    repo_id: str | None = None,
    training_log: str | Path | list[str | Path] | None = None,
    tokens_per_sequence: float | None = None,
    notes: str | Path | None = None,
    acceptance_curve: str | Path | None = None,
) -> Path:
    """Writes `drafter_dir/README.md` (YAML metadata, usage, measured tau and speedup, recipe) from speed reports.

    `benchmark_json` may list several reports (e.g. short and long prompts); `training_config` / `training_log` may
    list several stages (each continuing the previous one's drafter); `notes` is a Markdown file added as the card's
    "Limits" section; `acceptance_curve` a `longspark bench tau --by-length` report (its path as the docs check
    renders it: relative to the repository), added as the "Acceptance vs prefix length" section."""
    drafter_dir = _require_drafter_dir(drafter_dir)
    reports = [_speed_report(path) for path in _as_list(benchmark_json)]
    for path in _as_list(training_config):
        require_path(path, "Training config", "pass the YAML file the drafter was trained with.")
    for path in _as_list(training_log):
        require_path(path, "Training log", "pass the log.jsonl in the training run's output_dir.")
    config = LongSparkConfig.from_pretrained(drafter_dir)
    with safe_open(str(drafter_dir / "model.safetensors"), "pt") as weights:
        names = [k for k in weights.keys() if k != "draft_vocab"]  # noqa: SIM118 (safe_open is not a dict)
        num_parameters = sum(math.prod(weights.get_slice(k).get_shape()) for k in names)
    metadata = {
        "base_model": base_model,
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "license": "apache-2.0",
        "tags": ["speculative-decoding", "longspark", "drafter", "block-diffusion"],
    }
    card = CARD_TEMPLATE.format(
        metadata=yaml.safe_dump(metadata, sort_keys=False),
        base_model=base_model,
        repo_id=repo_id or f"<your-org>/{drafter_dir.name}",
        block_size=config.block_size,
        window_size=config.window_size,
        num_summary_queries=config.num_summary_queries,
        target_layer_ids=config.target_layer_ids,
        results=_results_table(reports),
        command="\n".join(report.get("command", "longspark bench") for report in reports),
        machine=_machine(reports[0]),
        training=_training(_as_list(training_config)),
        curve=_training_curve(_as_list(training_log), tokens_per_sequence),
        vocabulary=(
            f" It proposes only the {config.draft_vocab_size:,} tokens most frequent in its training data "
            "(its draft vocabulary); the others get draft probability 0, which keeps outputs exact."
        )
        if config.draft_vocab_size
        else "",
        num_parameters=num_parameters,
        notes=f"\n## Limits\n\n{_read_notes(notes).strip()}\n" if notes else "",
        acceptance=_acceptance_curve(acceptance_curve) if acceptance_curve else "",
    )
    path = drafter_dir / "README.md"
    path.write_text(card)
    return path


def push_drafter(drafter_dir: str | Path, repo_id: str, private: bool = False) -> str:
    """Uploads the drafter folder (config, safetensors weights, model card) to the Hub; returns the commit URL."""
    from huggingface_hub import HfApi

    drafter_dir = _require_drafter_dir(drafter_dir)
    missing = [n for n in ("config.json", "model.safetensors", "README.md") if not (drafter_dir / n).exists()]
    if missing:
        raise ValueError(f"{drafter_dir} lacks {missing}; save the drafter and run `longspark card` first.")
    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True)
    commit = api.upload_folder(folder_path=str(drafter_dir), repo_id=repo_id, commit_message="Upload LongSpark drafter")
    return str(commit)
