#!/usr/bin/env python
"""Decoding speed with and without `OMP_WAIT_POLICY=ACTIVE`, in alternating processes (the policy is read once, when
OpenMP starts, so one process cannot switch it).

Each repeat runs `longspark bench speed` on held-out short prompts and on long code at 4K, once with the variable
unset and once with it set, alternating; the speed JSONs go to `--out-dir`, and one summary (decode tokens/s of each
method and its ratios over plain `generate` and the best plain path, per run) to `--json`.

    python scripts/omp_wait_policy_ab.py --out-dir runs/omp_wait_policy --json results/omp_wait_policy_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

WORKLOADS = {
    "short": "--workloads short --num-short-prompts 6 --max-new-tokens 96 "
    "--methods plain plain_fast longspark longspark_no_proposals",
    "long": "--workloads long --num-long-prompts 2 --long-lengths 4096 --max-new-tokens 48 "
    "--methods plain_fast longspark longspark_no_proposals",
}
POLICIES = ("unset", "ACTIVE")


def run_path(out_dir: Path, workload: str, policy: str, repeat: int) -> Path:
    return out_dir / f"wp_{workload}_{policy}_{repeat}.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--summarize-only", action="store_true", help="read the runs already in --out-dir")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if not args.summarize_only:
        for repeat in range(1, args.repeats + 1):
            for policy in POLICIES:
                for workload, options in WORKLOADS.items():
                    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
                    if policy != "unset":
                        env["OMP_WAIT_POLICY"] = policy
                    command = ["longspark", "bench", "speed", "--num-threads", str(args.num_threads), "--quiet",
                               "--modes", "greedy", *shlex.split(options), "--json",
                               str(run_path(args.out_dir, workload, policy, repeat))]  # fmt: skip
                    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
                    print(f"done: {workload}, OMP_WAIT_POLICY {policy}, repeat {repeat}", flush=True)
    rows = []
    for repeat in range(1, args.repeats + 1):
        for policy in POLICIES:
            for workload in WORKLOADS:
                report = json.loads(run_path(args.out_dir, workload, policy, repeat).read_text())
                for row in report["rows"]:
                    rows.append({"workload": workload, "omp_wait_policy": policy, "repeat": repeat,
                                 "method": row["method"], "decode_tokens_per_s": row["decode_tokens_per_s"],
                                 "decode_speedup": row["decode_speedup"],
                                 "decode_speedup_vs_best_plain": row["decode_speedup_vs_best_plain"]})  # fmt: skip
                machine = report["machine"]
    command = shlex.join(["python", "scripts/omp_wait_policy_ab.py", *sys.argv[1:]])
    args.json.write_text(json.dumps({"machine": machine, "command": command, "rows": rows}, indent=1) + "\n")
    for row in rows:
        print(f"{row['workload']:5s} {row['omp_wait_policy']:6s} #{row['repeat']} {row['method']:24s} "
              f"{row['decode_tokens_per_s']:6.1f} tok/s  {row['decode_speedup']:.2f}x plain  "
              f"{row['decode_speedup_vs_best_plain']:.2f}x best plain")  # fmt: skip


if __name__ == "__main__":
    main()
