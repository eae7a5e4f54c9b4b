#!/usr/bin/env python
"""Regeneration throughput: transformers' batched `generate` against vLLM's offline engine, same prompts and settings.

Runs `longspark regenerate` on the first `--num-prompts` prompts (gsm8k, mmath-en and stdlib-code,
interleaved; sampled at the defaults T=0.7, top-k 20, top-p 0.8) with the transformers engine at each
`--transformers-batch` and with vLLM (from `.venv-vllm`, `scripts/install_vllm.sh`) at each `--vllm-dtype`, one after
the other on an otherwise idle machine, and reads each run's `regenerate_log.json`. Prints the table and writes it as
JSON (`docs/training.md` renders it).

    python scripts/regeneration_throughput.py --json results/regeneration_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from transformers_longspark.benchmarks.common import machine_info

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("LONGSPARK_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def regenerate(python: Path, output: Path, args: argparse.Namespace, *options: str) -> dict:
    command = [str(python), "-m", "transformers_longspark.cli", "regenerate", "--prompts", "gsm8k", "mmath-en",
               "stdlib-code", "--limit", str(args.num_prompts), "--max-new-tokens",
               str(args.max_new_tokens), "--output", str(output), *options]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((output / "regenerate_log.json").read_text())[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-threads", type=int, default=2, help="torch threads of the transformers engine")
    parser.add_argument("--transformers-batch", type=int, nargs="*", default=[16, 64])
    parser.add_argument("--vllm-dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--vllm-batch", type=int, default=128)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        sys.exit(
            f"{VLLM_PYTHON} does not exist: run `bash scripts/install_vllm.sh` first (or set LONGSPARK_VLLM_PYTHON)."
        )
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for batch in args.transformers_batch:
            options = ("--batch-size", str(batch), "--num-threads", str(args.num_threads))
            log = regenerate(Path(sys.executable), Path(work) / f"t{batch}", args, *options)
            rows.append({"engine": "transformers", "dtype": "float32", **log})
        for dtype in args.vllm_dtype:
            options = ("--engine", "vllm", "--dtype", dtype, "--batch-size", str(args.vllm_batch))
            log = regenerate(VLLM_PYTHON, Path(work) / f"v{dtype}", args, *options)
            rows.append({"engine": "vllm", "dtype": dtype, **log})
    report = {"benchmark": "regeneration_throughput", "machine": machine_info(), "num_prompts": args.num_prompts,
              "max_new_tokens": args.max_new_tokens, "runs": rows}  # fmt: skip
    print("| engine | dtype | batch | tokens | seconds | tokens/s |\n|---|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['engine']} | {row['dtype']} | {row['batch_size']} | {row['response_tokens']} | "
              f"{row['seconds']:.0f} | {row['tokens_per_s']:.0f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
