#!/usr/bin/env python
"""Does a compiled drafter forward beat the shipped eager one? One real drafter forward (the block and context of a
drafter-alone round on a held-out prompt), timed eager (fp32 `F.linear`; the fast path's packed layers, dynamic int8
on x86) and under `torch.compile` (inductor, static shapes; fp32, fp32 with frozen weights, bf16 with frozen
weights; and the shipped dynamic int8 products inside the compiled graph, each a call of an operator registered for
the probe, so that inductor fuses everything between them), each the median of 200 calls after a warm-up.

    python scripts/drafter_compile_probe.py --num-threads 2
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch._inductor.config as inductor_config

import transformers_longspark.modeling_longspark as modeling
from transformers_longspark.benchmarks.common import machine_info, measure
from transformers_longspark.benchmarks.prompts import short_prompts
from transformers_longspark.benchmarks.settings import DRAFTER_ALONE
from transformers_longspark.benchmarks.speed import drafter_settings
from transformers_longspark.int8_weights import dynamic_int8_rows
from transformers_longspark.loading import load_drafter, load_target
from transformers_longspark.modeling_longspark import LongSparkDrafterModel
from transformers_longspark.packed_linear import packed_drafter_weights

# The probe's int8 products: `qlinear(x, key)` runs fbgemm's dynamic int8 product on the packed rows `_PACKED[key]`
# (a registered operator, which dynamo keeps in the graph; a fake returns the output's shape).
_PACKED: dict[int, tuple[object, int]] = {}
_LIBRARY = torch.library.Library("longspark_probe", "DEF")
_LIBRARY.define("qlinear(Tensor x, int key) -> Tensor")
_LIBRARY.impl("qlinear", lambda x, key: torch.ops.quantized.linear_dynamic(x, _PACKED[key][0], True), "CPU")
torch.library.register_fake("longspark_probe::qlinear")(lambda x, key: x.new_empty(*x.shape[:-1], _PACKED[key][1]))


def int8_products_as_operators(drafter: LongSparkDrafterModel) -> None:
    """Every packable linear layer of `drafter` (and its output head; query/key/value and gate/up stacked, as the fast
    path runs them) as one `qlinear` call."""
    def register(layers) -> int:
        weight = torch.cat([layer.weight.detach().float() for layer in layers])
        _PACKED[len(_PACKED)] = (dynamic_int8_rows(weight), weight.shape[0])
        return len(_PACKED) - 1

    stacked = {}
    for module in drafter.modules():
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            if all(hasattr(module, name) for name in names):
                layers = tuple(getattr(module, name) for name in names)
                stacked[tuple(map(id, layers))] = register(layers)
    modeling.fused_linears = lambda x, layers: torch.ops.longspark_probe.qlinear(
        x, stacked[tuple(map(id, layers))]).split([layer.out_features for layer in layers], dim=-1)
    for name, layer in [*drafter.named_modules(), ("head", drafter.output_head)]:
        if type(layer) is torch.nn.Linear and name != "markov_proj":
            key = register((layer,))
            layer.forward = lambda x, key=key: torch.ops.longspark_probe.qlinear(x, key)


def median_ms(fn, calls: int = 200) -> float:
    return measure({"call": fn}, repeats=calls, warmup=10)["call"].median_ms()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    target, tokenizer = load_target()
    drafter, _ = load_drafter(target)
    captured = []
    forward = LongSparkDrafterModel.forward

    def capture(self, block_ids, context, previous_ids=None):
        captured.append((block_ids.clone(), copy.deepcopy(context)))
        return forward(self, block_ids, context, previous_ids)

    prompt = torch.tensor([short_prompts(tokenizer, 2)[1]["input_ids"]])
    LongSparkDrafterModel.forward = capture
    try:
        with drafter_settings(drafter, DRAFTER_ALONE):
            target.generate(prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False,
                            pad_token_id=tokenizer.eos_token_id)  # fmt: skip
    finally:
        LongSparkDrafterModel.forward = forward
    block_ids, context = captured[-1]

    def call(model):
        return lambda: model(block_ids, context)

    drafter.bind_target(target)
    print(f"window rows {context.window_keys[0].shape[2]}, block {block_ids.shape[1]}; {machine_info()['cpu']}")
    with torch.inference_mode():
        print(f"eager, fp32 F.linear: {median_ms(call(drafter)):.2f} ms")
        with packed_drafter_weights(drafter):
            print(f"eager, packed ({drafter.linear_dtype}, as shipped): {median_ms(call(drafter)):.2f} ms")
    reference = drafter(block_ids, context).base_logits.detach()

    def compile_and_time(name: str, model: LongSparkDrafterModel) -> None:
        compiled = torch.compile(model.forward, dynamic=False)
        with torch.no_grad():
            start = time.perf_counter()
            logits = compiled(block_ids, context).base_logits
            seconds = time.perf_counter() - start
            same = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
            print(f"compiled, {name}: {median_ms(call(compiled)):.2f} ms "
                  f"(compile {seconds:.0f} s, same greedy drafts {same:.0%})")  # fmt: skip

    for name, freezing, dtype in (("fp32", False, torch.float32), ("fp32, frozen", True, torch.float32),
                                  ("bf16, frozen", True, torch.bfloat16)):  # fmt: skip
        torch._dynamo.reset()
        inductor_config.freezing = freezing
        compile_and_time(name, drafter.to(dtype))
        drafter.to(torch.float32)
    torch._dynamo.reset()
    inductor_config.freezing = False
    int8_products_as_operators(drafter)
    with torch.no_grad():
        print(f"eager, int8 products as operators: {median_ms(call(drafter)):.2f} ms")
    compile_and_time("int8 products as operators", drafter)

if __name__ == "__main__":
    main()
