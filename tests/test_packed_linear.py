"""Linear layers on packed weights: the stock results, only inside the block, only in its thread, restored after."""

import threading

import pytest
import torch
from torch import nn

from helpers import layer, packed_weight_ids, was_packed
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
