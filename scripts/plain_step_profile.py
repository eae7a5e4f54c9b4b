#!/usr/bin/env python
"""Self CPU time per decoding step (10 steps after the prefill, torch profiler) of plain `generate` on the fast
verification path against transformers' static cache, at a 6,144-token held-out stdlib prefix, 2 threads; prints each
way's total and its top operations. `python scripts/plain_step_profile.py` on an idle machine."""

import torch
from torch.profiler import ProfilerActivity, profile, schedule
from transformers import DynamicCache

from transformers_longspark.benchmarks.prompts import stdlib_token_ids
from transformers_longspark.inference.verification import fast_verification
from transformers_longspark.loading import load_smollm2

torch.set_num_threads(2)
target, tok = load_smollm2()
ids = torch.tensor([stdlib_token_ids(tok, 6144)])
N = 13


def run(way):
    kw = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False, attention_mask=torch.ones_like(ids))
    if way == "fast":
        cache = DynamicCache(config=target.config)
        with fast_verification(target, cache, ids.shape[1] + N):
            target.generate(ids, cache=cache, **kw)
    else:
        target.generate(ids, cache_implementation="static", **kw)


for w in ("fast", "static", "fast", "static"):
    p = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=2, warmup=1, active=10, repeat=1))
    p.start()
    h = target.register_forward_hook(lambda m, a, o, p=p: p.step())
    run(w)
    h.remove()
    p.stop()
    ka = p.key_averages()
    tot = sum(e.self_cpu_time_total for e in ka) / 1000 / 10
    print(w, f"per step self CPU ms {tot:.1f}")
    rows = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:10]
    print("  " + "; ".join(f"{e.key} {e.self_cpu_time_total / 1000 / 10:.2f}ms/{e.count // 10}" for e in rows))
