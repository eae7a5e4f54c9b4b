"""The drafter's extra peak memory over plain `generate` (CPU peak RSS, a fresh process per configuration)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch
from tqdm.auto import tqdm

from ..loading import load_drafter, load_target
from .common import machine_info
from .report import table
from .settings import MemorySettings

MODES = ("plain", "assisted")


def _memory_worker(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Runs in a fresh process: loads the target (and drafter), then one `generate`; reports peak RSS."""
    import resource

    if spec.get("num_threads"):
        torch.set_num_threads(spec["num_threads"])
    import transformers_longspark

    transformers_longspark.register()  # the generate() hook

    dtype = getattr(torch, spec.get("dtype", "float32"))
    target, _ = load_target(spec.get("target"), dtype)
    drafter = load_drafter(target, spec.get("drafter"))[0] if spec["mode"] == "assisted" else None
    with torch.no_grad():  # safetensors weights are memory-mapped lazily: make them resident before measuring
        for parameter in [*target.parameters(), *(drafter.parameters() if drafter is not None else ())]:
            parameter.sum()
    rss_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    length, new_tokens = spec["prompt_length"], spec["max_new_tokens"]
    vocab = target.config.get_text_config().vocab_size
    input_ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(spec.get("seed", 0)))
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if drafter is not None:
        kwargs["assistant_model"] = drafter
    start = time.perf_counter()
    with torch.no_grad():
        output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    seconds = time.perf_counter() - start
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "mode": spec["mode"],
        "prompt_length": length,
        "new_tokens": output.shape[1] - length,
        "seconds": seconds,
        "rss_after_load_kib": rss_after_load,  # Linux reports ru_maxrss in KiB
        "rss_peak_kib": rss_peak,
        "context_state_bytes": getattr(getattr(drafter, "drafting_stats", None), "context_state_bytes", None),
    }


def _growth_kib(run: Mapping[str, Any]) -> int:
    return run["rss_peak_kib"] - run["rss_after_load_kib"]


def _memory_worker_main() -> None:
    spec = json.loads(sys.argv[1])
    print("MEMORY-RESULT " + json.dumps(_memory_worker(spec)), flush=True)


def run_memory_benchmark(
    target: str | None = None, drafter: str | None = None, settings: MemorySettings | None = None
) -> dict[str, Any]:
    """The drafter's extra peak memory over plain `generate`, at each prompt length (CPU, peak RSS).

    Each configuration (plain / assisted x prompt length) runs in a fresh process: it loads the target (a local
    checkpoint, or the SmolLM2 demo target when None) and, if assisted, the drafter (else `load_drafter`'s default),
    then generates `max_new_tokens` greedy tokens from a seeded random prompt, recording `ru_maxrss` before and after.
    Per length: both peaks, `extra_peak_mib` (assisted - plain peak, drafter weights included) and
    `extra_runtime_mib` (the same of the growth over the after-load RSS); `extra_peak_growth_mib` is the extra's
    change from the shortest to the longest prompt.
    """
    settings = settings or MemorySettings()
    prompt_lengths, max_new_tokens, num_threads = settings.prompt_lengths, settings.max_new_tokens, settings.num_threads
    command = "from transformers_longspark.benchmarks.memory import _memory_worker_main; _memory_worker_main()"
    worker = dict(max_new_tokens=max_new_tokens, target=target, drafter=None if drafter is None else str(drafter),
                  dtype=settings.dtype, num_threads=num_threads, seed=settings.seed)  # fmt: skip
    # A fixed mmap threshold stops glibc from serving large tensors out of its heap, whose fragmentation would
    # otherwise keep freed memory in the RSS: peak RSS then tracks the live tensors of each method.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    runs = []
    with tqdm(total=2 * len(prompt_lengths), desc="memory", unit="process", disable=not settings.progress) as bar:
        for length, mode in ((length, mode) for length in prompt_lengths for mode in MODES):
            argv = [sys.executable, "-c", command, json.dumps(dict(mode=mode, prompt_length=int(length), **worker))]
            completed = subprocess.run(argv, capture_output=True, text=True, timeout=settings.timeout, env=env)
            lines = [line for line in completed.stdout.splitlines() if line.startswith("MEMORY-RESULT ")]
            if completed.returncode != 0 or not lines:
                raise RuntimeError(
                    f"The memory worker ({mode}, {length} tokens) failed with exit code {completed.returncode}:\n"
                    f"{completed.stderr[-4000:]}"
                )
            runs.append(json.loads(lines[-1][len("MEMORY-RESULT ") :]))
            bar.update(1)
    lengths = []
    for length in prompt_lengths:
        plain, assisted = (next(r for r in runs if (r["prompt_length"], r["mode"]) == (length, m)) for m in MODES)
        row = {"prompt_length": int(length)}
        for mode, run in zip(MODES, (plain, assisted)):
            for part in ("after_load", "peak"):
                row[f"{mode}_{part}_mib"] = run[f"rss_{part}_kib"] / 1024
        row["extra_peak_mib"] = (assisted["rss_peak_kib"] - plain["rss_peak_kib"]) / 1024
        row["extra_runtime_mib"] = (_growth_kib(assisted) - _growth_kib(plain)) / 1024
        row["drafter_context_state_bytes"] = assisted["context_state_bytes"]
        lengths.append(row)
    return {
        "benchmark": "memory",
        "prompt_lengths": [int(t) for t in prompt_lengths],
        "max_new_tokens": max_new_tokens,
        "lengths": lengths,
        "extra_peak_growth_mib": lengths[-1]["extra_peak_mib"] - lengths[0]["extra_peak_mib"],
        "runs": runs,
        "notes": "Peak RSS (ru_maxrss) of a fresh process per configuration, a high-water mark: allocator noise of a "
        "few MiB is expected.",
        "machine": machine_info("cpu") | {"torch_threads": num_threads or torch.get_num_threads()},
    }


def format_memory(result: Mapping[str, Any]) -> str:
    """The memory report as a Markdown table, one row per prompt length."""
    header = ["prompt tokens", "plain peak MiB", "assisted peak MiB", "extra peak MiB", "extra at run time MiB"]
    rows = [[str(row["prompt_length"]), f"{row['plain_peak_mib']:.1f}", f"{row['assisted_peak_mib']:.1f}",
             f"{row['extra_peak_mib']:+.1f}", f"{row['extra_runtime_mib']:+.1f}"]
            for row in result["lengths"]]  # fmt: skip
    note = f"\nextra peak growth from shortest to longest prompt: {result['extra_peak_growth_mib']:+.1f} MiB"
    return "\n".join([*table(header, rows, "rrrrr"), note]) + "\n"
