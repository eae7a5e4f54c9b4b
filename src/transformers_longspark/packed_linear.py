"""The linear layers of few-row forwards on CPU, from weights packed once for oneDNN.

On CPU, `F.linear` with more than one input row runs MKL's sgemm, which repacks the weight matrix on every call: for
the handful of rows of a verification forward, that packing reads and writes every weight once more, so on a
memory-bound machine a 2-token forward's linear layers cost about twice a one-token step's (SmolLM2-135M, fp32,
2-vCPU AMD EPYC: all linear layers of one forward take 40 ms for 1 row, 70-90 ms for 2-8 rows). oneDNN's kernels
over weights reordered once (`torch.ops.mkldnn._reorder_linear_weight`) read each weight once per call: 36 ms for
1 row, 37-52 ms for 2-8 rows, and still ahead of sgemm at 64 rows. Past `MAX_PACKED_ROWS` rows (a prefill)
sgemm's packing is amortised and the stock path is as fast, so it runs unchanged.

`packed_linear_weights(*models)` routes the `nn.Linear` layers of `models` through packed weights for this thread,
for the duration of the block (`fast_verification` opens it for the target); `linear` is the same for a bare weight
(the drafter's output head, which runs inside that block). Forwards from other threads, forwards
that need gradients, non-CPU weights and dtypes oneDNN cannot pack here take `F.linear` unchanged. A packed weight
is kept for its layer between blocks (packing SmolLM2-135M takes ~1.5 s), so the weights are held twice, once in
oneDNN's layout; `release_packed_weights(model)` frees the copies. A weight replaced or modified in place (a training
step) is packed again. The results agree with `F.linear` up to float rounding (the summation order differs), as any
two BLAS kernels do.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

# Input rows (batch x tokens) up to which a layer uses its packed weight.
MAX_PACKED_ROWS = 64
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


class _ThreadState(threading.local):
    depth = 0  # `packed_linear_weights` blocks open in this thread


_thread = _ThreadState()
_routed: dict[int, int] = {}  # id(layer) -> open blocks (all threads) routing its forward
_lock = threading.Lock()
_ONEDNN = torch.backends.mkldnn.is_available()
# id(weight) -> (a weak reference to it, (its storage and version when packed), packed weight or None); outside the
# modules, so that copying, pickling or saving a model never meets a oneDNN tensor. An entry goes with its weight.
# (Keyed by id: tensors compare elementwise, so they cannot be the keys of a WeakKeyDictionary.)
_packed: dict[int, tuple[weakref.ref, tuple, torch.Tensor | None]] = {}


def _entry(weight: torch.Tensor) -> tuple[weakref.ref, tuple, torch.Tensor | None] | None:
    """`weight`'s entry in `_packed`, if it has one (an id reused by a new tensor does not count)."""
    entry = _packed.get(id(weight))
    return entry if entry is not None and entry[0]() is weight else None


def _forget(ident: int) -> None:
    entry = _packed.get(ident)
    if entry is not None and entry[0]() is None:
        del _packed[ident]


def _packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` in oneDNN's layout (packed on first use, again after it changes in place), or `None` where it cannot
    be packed (the build or CPU lacks the kernel for its dtype)."""
    # Inference-mode tensors keep no version counter, and cannot be modified in place outside inference mode.
    version = -1 if weight.is_inference() else weight._version
    key = (weight.data_ptr(), version)
    entry = _entry(weight)
    if entry is None or entry[1] != key:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        except RuntimeError:  # e.g. bf16 without AVX-512 / AVX-NE-CONVERT
            packed = None
        ident = id(weight)
        entry = _packed[ident] = (weakref.ref(weight, lambda _, ident=ident: _forget(ident)), key, packed)
    return entry[2]


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy kept for `weight`, or `None` (never packed, released, or not packable)."""
    entry = _entry(weight)
    return None if entry is None else entry[2]


def _packable(weight: torch.Tensor) -> bool:
    return _ONEDNN and weight.device.type == "cpu" and weight.dtype in _PACKABLE_DTYPES


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(input, weight, bias)`, from `weight` packed once when this thread is inside a `packed_linear_weights`
    block and the forward is one the packed kernel serves: CPU, a packable dtype, at most `MAX_PACKED_ROWS` rows, no
    gradient. `weight` `(out, in)`, `input` `(..., in)`."""
    if not _thread.depth:  # outside a block (training, other threads): nothing else to check
        return F.linear(input, weight, bias)
    if (
        input.dim() >= 2
        and input.numel() // input.shape[-1] <= MAX_PACKED_ROWS
        and input.dtype == weight.dtype
        and _packable(weight)
        and not (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad))
    ):
        packed = _packed_weight(weight)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(input, packed, bias, "none", [], "")
    return F.linear(input, weight, bias)


def _routed_forward(layer: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """What a routed layer's `forward` runs: `linear` with its weight and bias."""
    return linear(input, layer.weight, layer.bias)


def _packable_layers(models: tuple[nn.Module, ...]) -> list[nn.Linear]:
    layers = {id(m): m for model in models for m in model.modules() if type(m) is nn.Linear}
    return [m for m in layers.values() if _packable(m.weight)]


@contextlib.contextmanager
def packed_linear_weights(*models: nn.Module) -> Iterator[None]:
    """Inside the block, this thread's few-row forwards of `models`' CPU `nn.Linear` layers use packed weights.

    Blocks nest and may be open in several threads at once; a layer's own `forward` is restored when the last block
    routing it exits, exceptions included.
    """
    layers = _packable_layers(models)
    with _lock:
        for layer in layers:
            count = _routed.get(id(layer), 0)
            if count == 0:
                layer.forward = _routed_forward.__get__(layer)
            _routed[id(layer)] = count + 1
    _thread.depth += 1
    try:
        yield
    finally:
        _thread.depth -= 1
        with _lock:
            for layer in layers:
                count = _routed.pop(id(layer)) - 1
                if count:
                    _routed[id(layer)] = count
                else:
                    del layer.forward  # back to `nn.Linear.forward`


def release_packed_weights(model: nn.Module) -> None:
    """Frees the packed copies of `model`'s linear weights (they are packed again on the next use)."""
    for weight in model.parameters():
        if _entry(weight) is not None:
            del _packed[id(weight)]


__all__ = ["MAX_PACKED_ROWS", "linear", "packed_copy", "packed_linear_weights", "release_packed_weights"]
