"""Linear layers on packed weights: the stock results, only inside the block, only in its thread, restored after."""

import threading

import pytest
import torch
from torch import nn

from transformers_longspark import packed_linear
from transformers_longspark.packed_linear import (
    MAX_PACKED_ROWS,
    fast_dtype,
    fused_linears,
    packed_copy,
    packed_linear_weights,
    release_packed_weights,
)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


def layer(in_features: int = 24, out_features: int = 40, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).eval()


def was_packed(module: nn.Linear) -> bool:
    return packed_copy(module.weight) is not None


def packed_weight_ids(dtype: torch.dtype | None = None) -> set[int]:
    """Ids of the weights with a packed copy (alone or stacked with others: `fused_linears`), in `dtype` or any."""
    entries = packed_linear._packed.items()
    return {
        i for (ids, key_dtype), (_, _, copy) in entries if copy is not None and dtype in (None, key_dtype) for i in ids
    }


@pytest.mark.parametrize("shape", [(2, 24), (3, 24), (2, 5, 24), (1, MAX_PACKED_ROWS, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_forward_gives_the_stock_result(shape, bias):
    module = layer(bias=bias)
    x = torch.randn(shape)
    stock = module(x)
    with torch.no_grad(), packed_linear_weights(module):
        packed = module(x)
    assert was_packed(module)
    torch.testing.assert_close(packed, stock.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 24), (1, 1, 24)])
def test_one_row_keeps_f_linear_unless_the_block_computes_in_another_dtype(shape):
    """One row: `F.linear`'s matrix-vector product, bit for bit (oneDNN's per-call setup costs more than it saves);
    in dynamic int8 the packed copy still serves it (a quarter of the bytes to read)."""
    module = layer()
    x = torch.randn(shape)
    with torch.no_grad(), packed_linear_weights(module):
        assert torch.equal(module(x), torch.nn.functional.linear(x, module.weight, module.bias))
    assert not was_packed(module)
    with torch.no_grad(), packed_linear_weights(module, dtype=torch.qint8):
        module(x)
    assert id(module.weight) in packed_weight_ids(torch.qint8)


def test_a_non_contiguous_input_gives_the_stock_result():
    module = layer()
    x = torch.randn(4, 48)[:, ::2]
    with torch.no_grad(), packed_linear_weights(module):
        torch.testing.assert_close(module(x), torch.nn.functional.linear(x, module.weight, module.bias))


def test_forward_is_restored_after_the_block_and_after_an_exception():
    module = layer()
    with torch.no_grad(), packed_linear_weights(module):
        assert "forward" in module.__dict__
    assert "forward" not in module.__dict__
    with pytest.raises(KeyError), packed_linear_weights(module):
        raise KeyError("interrupted")
    assert "forward" not in module.__dict__ and not packed_linear._routed


def test_nested_blocks_keep_routing_until_the_last_exits():
    module = layer()
    with packed_linear_weights(module):
        with packed_linear_weights(nn.Sequential(module)):
            pass
        assert "forward" in module.__dict__
    assert "forward" not in module.__dict__


def test_many_rows_and_gradients_take_the_stock_path():
    module = layer().requires_grad_(True)
    with packed_linear_weights(module):
        with torch.no_grad():
            module(torch.randn(MAX_PACKED_ROWS + 1, 24))  # a prefill
        assert not was_packed(module)
        x = torch.randn(3, 24, requires_grad=True)
        module(x).sum().backward()  # training through the block still gets gradients
    assert not was_packed(module)
    assert x.grad is not None and module.weight.grad is not None


def test_other_threads_take_the_stock_path():
    module = layer()
    results = {}
    opened, done = threading.Event(), threading.Event()

    def other_thread():
        opened.wait()
        with torch.no_grad():
            results["other"] = module(torch.randn(2, 24))
        done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with packed_linear_weights(module):
        opened.set()
        done.wait()
    thread.join()
    assert not was_packed(module)  # the other thread's forward ran while the block was open, on F.linear


@pytest.mark.parametrize("bias", [True, False])
def test_int8_weights_give_the_stock_result_up_to_their_rounding(bias):
    module = layer(in_features=64, out_features=48, bias=bias)
    module.weight.data[5] = 0.0  # a zero row (scale 1, not 0/0)
    x = torch.randn(2, 3, 64)
    stock = module(x).detach()
    with torch.no_grad(), packed_linear_weights(module, dtype=torch.int8):
        out = module(x)
    quantized, scale = packed_copy(module.weight, torch.int8)
    assert quantized.dtype == torch.int8 and quantized.abs().max() <= 127 and scale.shape == (48,)
    assert out.dtype == x.dtype and out.shape == stock.shape
    # int8 weights and bf16 inputs: ~1% of the output's scale, not the stock result's 1e-5.
    error = (out - stock).abs().max() / stock.abs().max()
    assert 1e-5 < error < 2e-2
    torch.testing.assert_close(out[..., 5], torch.zeros(2, 3) if not bias else module.bias[5].expand(2, 3))


@pytest.mark.skipif(fast_dtype(torch.float32) != torch.qint8, reason="torch has no fbgemm dynamic int8 kernel here")
@pytest.mark.parametrize("bias", [True, False])
def test_dynamic_int8_gives_the_stock_result_up_to_its_rounding(bias):
    module = layer(in_features=24, out_features=48, bias=bias)  # any width: fbgemm has no 16-wide restriction
    module.weight.data[5] = 0.0
    x = torch.randn(2, 3, 24)
    stock = module(x).detach()
    with torch.no_grad(), packed_linear_weights(module, dtype=torch.qint8):
        out = module(x)
    assert packed_copy(module.weight, torch.qint8) is not None
    assert out.dtype == x.dtype and out.shape == stock.shape
    # int8 weights and inputs quantized on the fly: ~1% of the output's scale, not the stock result's 1e-5.
    error = (out - stock).abs().max() / stock.abs().max()
    assert 1e-5 < error < 3e-2
    torch.testing.assert_close(out[..., 5], torch.zeros(2, 3) if not bias else module.bias[5].expand(2, 3))


def test_int8_falls_back_to_the_stock_result_at_widths_its_kernel_does_not_take():
    module = layer(in_features=24)
    x = torch.randn(3, 24)
    with torch.no_grad(), packed_linear_weights(module, dtype=torch.int8):
        out = module(x)
    assert packed_copy(module.weight, torch.int8) is None
    torch.testing.assert_close(out, torch.nn.functional.linear(x, module.weight, module.bias))


def test_a_changed_weight_is_packed_again():
    module = layer()
    x = torch.randn(2, 24)
    with torch.no_grad(), packed_linear_weights(module):
        before = module(x)
        module.weight.mul_(2.0)  # in place (an optimizer step)
        after_in_place = module(x)
        module.weight = nn.Parameter(torch.randn(40, 24))  # replaced (load_state_dict with assign, .to())
        after_replaced = module(x)
    torch.testing.assert_close(after_in_place, 2 * before - module.bias, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after_replaced, torch.nn.functional.linear(x, module.weight, module.bias))


@pytest.mark.parametrize("dtype", [None, torch.qint8])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_linears_equal_the_layers_run_one_by_one(dtype, bias):
    """Layers that read one input run as one product over their stacked weights inside a block (one packed copy for
    the group, repacked when any weight changes); outside one, each layer runs its own forward."""
    if dtype == torch.qint8 and fast_dtype(torch.float32) != torch.qint8:
        pytest.skip("torch has no fbgemm dynamic int8 kernel here")
    layers = (layer(bias=bias, seed=1), layer(out_features=8, bias=bias, seed=2), layer(out_features=16, bias=bias))
    x = torch.randn(2, 3, 24)
    outside = fused_linears(x, layers)
    for out, single in zip(outside, layers):
        assert torch.equal(out, single(x))
    with torch.no_grad(), packed_linear_weights(*layers, dtype=dtype):
        one_by_one = [single(x) for single in layers]
        fused = fused_linears(x, layers)
        weights = tuple(single.weight for single in layers)
        assert packed_linear._entry(weights, dtype or torch.float32) is not None
        layers[1].weight.mul_(2.0)
        changed = fused_linears(x, layers)
        assert torch.allclose(changed[1], 2 * one_by_one[1] - (layers[1].bias if bias else 0), atol=3e-2)
    for out, single in zip(fused, one_by_one):
        assert out.shape == single.shape
        torch.testing.assert_close(out, single, rtol=1e-5, atol=1e-5 if dtype is None else 1e-6)
    release_packed_weights(layers[0])
    assert packed_linear._entry(weights, dtype or torch.float32) is None


def test_release_frees_the_packed_copies():
    module = layer()
    with torch.no_grad(), packed_linear_weights(module):
        module(torch.randn(2, 24))
    assert was_packed(module)
    release_packed_weights(nn.Sequential(module))
    assert packed_copy(module.weight) is None


def test_a_dtype_this_cpu_cannot_pack_falls_back_to_the_stock_result():
    module = layer().to(torch.bfloat16)
    x = torch.randn(3, 24, dtype=torch.bfloat16)
    stock = torch.nn.functional.linear(x, module.weight, module.bias)
    with torch.no_grad(), packed_linear_weights(module):
        out = module(x)  # packed where oneDNN has bf16 kernels on this CPU, else F.linear
    torch.testing.assert_close(out.float(), stock.float(), rtol=2e-2, atol=2e-2)


def test_only_cpu_linear_layers_are_routed():
    class NotALinear(nn.Linear):  # a subclass may compute something else (LoRA, quantized layers)
        pass

    model = nn.Sequential(layer(), NotALinear(24, 40), nn.Embedding(4, 24))
    with packed_linear_weights(model):
        assert "forward" in model[0].__dict__
        assert "forward" not in model[1].__dict__


def test_weights_created_in_inference_mode_keep_f_linear():
    """They keep no version counter, so a packed copy could go stale unseen (see the in-place test below)."""
    with torch.inference_mode():
        module = layer()
        x = torch.randn(3, 24)
        with packed_linear_weights(module):
            out = module(x)
    assert not was_packed(module)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, module.weight, module.bias))


def test_a_bare_weight_is_packed_inside_a_block_only():
    weight, x = torch.randn(40, 24), torch.randn(7, 24)
    torch.testing.assert_close(packed_linear.linear(x, weight), x @ weight.T)
    assert packed_copy(weight) is None  # outside any block: F.linear
    with packed_linear_weights():
        torch.testing.assert_close(packed_linear.linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-5)
    assert packed_copy(weight) is not None
    del weight
    assert all(ref() is not None for refs, _, _ in packed_linear._packed.values() for ref in refs)  # freed with it


def test_generate_runs_the_drafters_linear_layers_from_packed_weights_too(monkeypatch):
    """Inside assisted `generate` the drafter's few-row forwards (7 block slots) read packed weights, alone or
    stacked with the layers that read the same input (`fused_linears`), as the target's verification does, all but
    the Markov correction's thin projection, which `F.linear` runs faster; afterwards both models' layers are
    restored. Greedy output is plain generate's."""
    from helpers import make_drafter, make_target

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


# --- stale copies: storage swapped under the same Parameter, inference-mode weights --------------------------------


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_storage_swapped_under_the_same_parameter_is_packed_again(inference):
    """`w.data = t` keeps the Parameter (and its version counter) but not its storage: the next forward must use `t`.
    The same for a weight created and swapped in inference mode (whose version is always -1)."""
    with torch.inference_mode(inference):
        module = layer()
        x = torch.randn(3, 24)
        with torch.no_grad(), packed_linear_weights(module):
            module(x)
            weight = module.weight
            module.weight.data = torch.randn(40, 24)
            assert module.weight is weight
            out = module(x)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, module.weight, module.bias), rtol=1e-5, atol=1e-5)


def test_an_inference_mode_weight_changed_in_place_is_never_stale():
    """Inference-mode tensors keep no version counter: such weights take `F.linear`, never a stale packed copy."""
    with torch.inference_mode():
        module = layer()
        x = torch.randn(3, 24)
        with packed_linear_weights(module):
            module(x)
            module.weight.mul_(2.0)  # e.g. merging an adapter, or load_state_dict, under inference_mode
            out = module(x)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, module.weight, module.bias), rtol=1e-5, atol=1e-5)


# --- the comparison switch: `packed_weights = False` -----------------------------------------------------------


@pytest.mark.skipif(fast_dtype(torch.float32) != torch.qint8, reason="torch has no fbgemm dynamic int8 kernel here")
def test_a_bf16_drafter_runs_its_linear_layers_in_dynamic_int8_and_stays_exact():
    """A drafter loaded without `dtype` keeps its saved bf16 weights; on x86 its linear layers still run in dynamic
    int8 (quantized from the bf16 values), beside an fp32 target, and greedy output is plain generate's."""
    from helpers import make_drafter, make_target

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
    from helpers import make_drafter, make_target

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
