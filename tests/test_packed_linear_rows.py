"""Which forwards run on packed weights: assisted `generate` (the drafter's layers too, in its CPU's fastest dtype), the
`packed_weights = False` comparison switch, and the row counts a block routes (`blas_max_rows`, `max_rows`) with their
measurement. The kernels' results themselves: `test_packed_linear.py`."""

import pytest
import torch
from test_packed_linear import layer, packed_weight_ids, was_packed
from torch import nn

from helpers import make_drafter, make_target
from transformers_longspark import packed_linear
from transformers_longspark.packed_linear import (
    MAX_PACKED_ROWS,
    fast_dtype,
    packed_linear_weights,
    release_packed_weights,
)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


def test_generate_runs_the_drafters_linear_layers_from_packed_weights_too(monkeypatch):
    """Inside assisted `generate` the drafter's few-row forwards (7 block slots) read packed weights, alone or
    stacked with the layers that read the same input (`fused_linears`), as the target's verification does, all but
    the Markov correction's thin projection, which `F.linear` runs faster; afterwards both models' layers are
    restored. Greedy output is plain generate's."""
    target = make_target("qwen3")
    drafter = make_drafter(target)
    served = []
    original = packed_linear._packed_product

    def spy(input, weights, bias, compute, *max_rows):
        out = original(input, weights, bias, compute, *max_rows)
        if out is not None:
            served.extend(map(id, weights))
        return out

    drafter_weights = {id(m.weight) for m in drafter.modules() if type(m) is nn.Linear}
    drafter_weights.remove(id(drafter.markov_proj.weight))
    prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    monkeypatch.setattr(packed_linear, "_packed_product", spy)
    assisted = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    assert torch.equal(assisted, plain)
    assert drafter_weights <= set(served)  # every drafter linear layer ran packed
    assert id(drafter.markov_proj.weight) not in served
    dtype = packed_linear.drafter_linear_dtype(drafter)  # the CPU's fastest: dynamic int8, bf16 or fp32
    assert drafter_weights | {id(drafter.output_head.weight)} <= packed_weight_ids(dtype)
    assert not any("forward" in m.__dict__ for model in (target, drafter) for m in model.modules())


# --- the comparison switch: `packed_weights = False` -----------------------------------------------------------


@pytest.mark.skipif(fast_dtype(torch.float32) != torch.qint8, reason="torch has no fbgemm dynamic int8 kernel here")
def test_a_bf16_drafter_runs_its_linear_layers_in_dynamic_int8_and_stays_exact():
    """A drafter loaded without `dtype` keeps its saved bf16 weights; on x86 its linear layers still run in dynamic
    int8 (quantized from the bf16 values), beside an fp32 target, and greedy output is plain generate's."""
    target = make_target("qwen3")
    drafter = make_drafter(target).to(torch.bfloat16)
    assert packed_linear.drafter_linear_dtype(drafter) == torch.qint8
    prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assisted = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    assert torch.equal(assisted, plain)
    assert drafter.drafting_stats.rounds > 0
    assert {id(drafter.layers[0].mlp.down_proj.weight)} <= packed_weight_ids(torch.qint8)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_packed_weights_off_keeps_every_linear_of_target_and_drafter_on_f_linear(batch_size):
    """The "before" columns of the packed A/B tables set `drafter.packed_weights = False`: no linear layer of the
    target or the drafter (nor the target's head, which the drafter runs through `linear`) may then be packed, in
    transformers' loop or the batched one; with it on, all of them are but the Markov correction's thin projection."""
    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.bind_target(target)  # as a drafter that served a call before is
    prompts = torch.randint(0, 64, (batch_size, 12), generator=torch.Generator().manual_seed(0))
    linears = [m for model in (target, drafter) for m in model.modules() if type(m) is nn.Linear]
    weights = [m.weight for m in linears if m is not drafter.markov_proj]
    for packed in (False, True):
        for model in (target, drafter):
            release_packed_weights(model)
        drafter.packed_weights = packed
        target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=10, do_sample=False,
                        assistant_model=drafter)  # fmt: skip
        copies = [id(w) in packed_weight_ids() for w in weights]
        assert copies == [packed] * len(weights), packed


def test_forwards_up_to_blas_max_rows_keep_f_linear():
    """A block's `blas_max_rows` (where the CPU's BLAS beats oneDNN at a few rows): those forwards are `F.linear`'s,
    bit for bit, and pack nothing; one row more runs packed."""
    module = layer()
    x = torch.randn(3, 24)
    with torch.no_grad(), packed_linear_weights(module, blas_max_rows=3):
        assert torch.equal(module(x), torch.nn.functional.linear(x, module.weight, module.bias))
        assert not was_packed(module)
        module(torch.randn(4, 24))
    assert was_packed(module)


@pytest.mark.parametrize("max_rows", [MAX_PACKED_ROWS, packed_linear.UNLIMITED_ROWS])
def test_a_prefill_runs_packed_only_where_the_block_allows_its_rows(max_rows):
    """Past `MAX_PACKED_ROWS` rows a forward keeps `F.linear` unless the block's `max_rows` (the calibration's
    `measure_max_packed_rows`, where oneDNN beats sgemm at a prefill's rows too) serves it; either way the result is
    the stock one up to float rounding."""
    module = layer()
    x = torch.randn(MAX_PACKED_ROWS + 36, 24)
    with torch.no_grad(), packed_linear_weights(module, max_rows=max_rows):
        torch.testing.assert_close(module(x), torch.nn.functional.linear(x, module.weight, module.bias))
    assert was_packed(module) == (max_rows > MAX_PACKED_ROWS)


def test_blas_max_rows_0_runs_one_row_packed():
    """Where the calibration measured the packed kernel faster at one row, a one-token step's layers run packed (the
    stock result up to float rounding)."""
    module = layer()
    x = torch.randn(1, 24)
    with torch.no_grad(), packed_linear_weights(module, blas_max_rows=0):
        torch.testing.assert_close(module(x), torch.nn.functional.linear(x, module.weight, module.bias))
    assert was_packed(module)


@pytest.mark.parametrize("crossover", [4, 1])
def test_measure_blas_max_rows_counts_up_until_the_packed_kernel_is_as_fast(crossover, monkeypatch):
    """The rule, with the kernels' speeds set: BLAS faster below `crossover` rows, the packed kernel from there on ->
    `crossover - 1` (0: one row runs packed too, as on CPUs whose BLAS matrix-vector product is the slower one)."""
    import time

    stock_linear, stock_packed = torch.nn.functional.linear, packed_linear._packed_product

    def slow_from_crossover(x, weight, bias=None):
        time.sleep(0.002 if x.shape[0] >= crossover else 0.0)
        return stock_linear(x, weight, bias)

    def slow_below_crossover(x, weights, bias, dtype, **kwargs):
        time.sleep(0.002 if x.shape[0] < crossover else 0.0)
        return stock_packed(x, weights, bias, dtype, **kwargs)

    monkeypatch.setattr(packed_linear.F, "linear", slow_from_crossover)
    monkeypatch.setattr(packed_linear, "_packed_product", slow_below_crossover)
    measured = packed_linear.measure_blas_max_rows(nn.Sequential(layer(), layer(40, 24)), repeats=2)
    assert measured == crossover - 1
