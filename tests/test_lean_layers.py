"""The fast path's lean decoder layers: bit-identical to the stock layers, hooks honoured, other threads untouched."""

import threading

import pytest
import torch
from test_verification import build_target
from transformers import DynamicCache

from transformers_longspark import packed_linear
from transformers_longspark.inference import lean_layers
from transformers_longspark.inference.verification import fast_verification
from transformers_longspark.targets import HiddenStateCapture


def decode_logits(target, ids, mask, prefix: int, blocks: list[int], lean: bool) -> list[torch.Tensor]:
    """On the fast path (reserved rows, packed weights at every row count): the prefill of `ids[:, :prefix]`, then one
    forward per entry of `blocks` over that many of the next tokens; the logits of each forward."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache, logits, start = DynamicCache(config=target.config), [], 0
    with torch.no_grad(), fast_verification(target, cache, ids.shape[1], blas_max_rows=0, lean_layers=lean):
        for end in [prefix] + [prefix + sum(blocks[: i + 1]) for i in range(len(blocks))]:
            logits.append(target(ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
                                 cache=cache).logits)  # fmt: skip
            start = end
    return logits


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen2", "mistral"])
@pytest.mark.parametrize("left_padding", [0, 3], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lean_layers_give_the_stock_layers_logits_bit_for_bit(kind, left_padding, dtype):
    target = build_target(kind, 12, 4, dtype=dtype)
    blocks = [1, 1, 4, 1, 7, 2]
    ids = torch.randint(0, 64, (1, 40 + sum(blocks)), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, :left_padding] = 0
    layers = target.model.layers
    assert all(lean_layers.supports_lean_forward(layer) for layer in layers)
    stock = decode_logits(target, ids, mask, 40, blocks, lean=False)
    lean = decode_logits(target, ids, mask, 40, blocks, lean=True)
    for i, (a, b) in enumerate(zip(stock, lean)):
        assert torch.equal(a, b), f"forward {i}: max difference {(a - b).abs().max().item():.3g}"
    assert not any("forward" in vars(layer) for layer in layers)  # restored after the block


def test_projections_that_read_one_input_run_as_one_packed_product(monkeypatch):
    """Query/key/value, and gate/up, read the same input: on the fast path each set is one product over the stacked
    weights (one kernel call instead of three and two, `packed_linear.fused_linears`); the output and down projections
    run alone. (The test above holds them to the stock layers' separate products, bit for bit.)"""
    target = build_target("qwen3", 12, 4)
    products, original = [], packed_linear._packed_product

    def spy(input, weights, *args, **kwargs):
        products.append(tuple(map(id, weights)))
        return original(input, weights, *args, **kwargs)

    monkeypatch.setattr(packed_linear, "_packed_product", spy)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    decode_logits(target, ids, torch.ones_like(ids), 8, [4], lean=True)
    for layer in target.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        assert products.count(tuple(id(m.weight) for m in (attention.q_proj, attention.k_proj, attention.v_proj))) == 2
        assert products.count((id(mlp.gate_proj.weight), id(mlp.up_proj.weight))) == 2
        assert products.count((id(attention.o_proj.weight),)) == products.count((id(mlp.down_proj.weight),)) == 2
        assert (id(attention.q_proj.weight),) not in products and (id(mlp.up_proj.weight),) not in products


def test_lean_layers_run_and_keep_the_layers_own_hooks():
    """The layer's own forward hooks (the hidden-state capture) see the lean outputs, equal to the stock ones."""
    target = build_target("qwen3", 12, 4)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    captured = {}
    for lean in (False, True):
        capture = HiddenStateCapture(target.model.layers, [0, 1], keep=3)
        decode_logits(target, ids, torch.ones_like(ids), 8, [4], lean=lean)
        captured[lean] = list(capture.states)
        capture.remove()
    assert all(torch.equal(a, b) for a, b in zip(captured[False], captured[True]))


def test_a_hook_on_a_submodule_sends_the_layer_to_its_stock_forward(monkeypatch):
    target = build_target("llama", 12, 4)
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(2))
    calls, lean_calls = [], []
    target.model.layers[1].self_attn.q_proj.register_forward_hook(lambda *_: calls.append(1))
    rotate = lean_layers._rotate
    monkeypatch.setattr(lean_layers, "_rotate", lambda *a: lean_calls.append(1) or rotate(*a))
    decode_logits(target, ids, torch.ones_like(ids), 8, [2], lean=True)
    assert len(calls) == 2  # the prefill and the 2-token forward both ran the hooked projection
    assert len(lean_calls) == 2 * 2 * 1  # query and key, in the one unhooked layer (0), for both forwards


def test_a_forward_from_another_thread_runs_the_stock_layers(monkeypatch):
    target = build_target("qwen3", 12, 4)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    lean_threads = set()
    rotate = lean_layers._rotate
    monkeypatch.setattr(lean_layers, "_rotate", lambda *a: lean_threads.add(threading.get_ident()) or rotate(*a))
    with torch.no_grad(), fast_verification(target):
        worker = threading.Thread(target=lambda: target(ids))
        worker.start()
        worker.join()
        assert not lean_threads  # the worker, outside any block, ran the stock layers
        target(ids)
    assert lean_threads == {threading.get_ident()}


def test_layers_it_does_not_reproduce_keep_their_forward():
    target = build_target("llama", 12, 4)
    layer = target.model.layers[0]
    assert lean_layers.supports_lean_forward(layer)
    layer.mlp.gate_proj = torch.nn.Sequential(layer.mlp.gate_proj)  # no longer a bare nn.Linear
    assert not lean_layers.supports_lean_forward(layer)
    with fast_verification(target):
        assert "forward" not in vars(layer) and "forward" in vars(target.model.layers[1])
    assert not lean_layers.supports_lean_forward(torch.nn.Linear(2, 2))


def test_training_mode_takes_the_stock_forward(monkeypatch):
    target = build_target("llama", 12, 4).train()
    lean_calls = []
    rotate = lean_layers._rotate
    monkeypatch.setattr(lean_layers, "_rotate", lambda *a: lean_calls.append(1) or rotate(*a))
    with fast_verification(target):
        target(torch.arange(6)[None])
    assert not lean_calls
