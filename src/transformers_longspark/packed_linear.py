"""The linear layers of few-row forwards on CPU, from weights packed once for oneDNN.

On CPU, `F.linear` with more than one input row runs MKL's sgemm, which repacks the weight matrix on every call: for
the handful of rows of a verification forward, that packing reads and writes every weight once more, so on a
memory-bound machine a 2-token forward's linear layers cost about twice a one-token step's. oneDNN's kernels over
weights reordered once (`torch.ops.mkldnn._reorder_linear_weight`) read each weight once per call. Which kernel wins
is the CPU's (SmolLM2-135M's layers, 2 vCPUs, `scripts/linear_kernels.py`): on an AVX2-only AMD EPYC `F.linear` wins
at one row (a matrix-vector product repacks nothing) and oneDNN at 2-64 (37-52 ms against 70-90 at 2-8 rows); on an
Intel Xeon with AVX-512 sgemm wins up to 3 rows; on a Zen 5 EPYC oneDNN wins from one row (17 ms against 34) to a
prefill's 1024 (2.2x). So a block names the most rows that keep `F.linear` (`blas_max_rows`: 1 unless measured, 0
where even one row runs packed; `measure_blas_max_rows`) and the most that run packed (`max_rows`: `MAX_PACKED_ROWS`,
past which sgemm's packing is amortised, unless `measure_max_packed_rows` finds oneDNN faster at a prefill's rows).

`packed_linear_weights(*models)` routes the `nn.Linear` layers of `models` through packed weights for this thread,
for the duration of the block (`fast_verification` opens it for the target); `linear` is the same for a bare weight
(the drafter's output head, which runs inside that block). Forwards from other threads, forwards
that need gradients, non-CPU weights and dtypes oneDNN cannot pack here take `F.linear` unchanged. A packed weight
is kept for its layer between blocks (packing SmolLM2-135M takes ~1.5 s), so the weights are held twice, once in
oneDNN's layout; `release_packed_weights(model)` frees the copies. A weight replaced or modified in place (a training
step) is packed again. The results agree with `F.linear` up to float rounding (the summation order differs), as any
two BLAS kernels do.

A block may also run its layers in a lower precision (`dtype`): the packed copy is then made in that dtype, inputs are
cast to it and outputs back. With `torch.bfloat16` on CPUs with native bf16 instructions; with `torch.int8` the copy
is int8 with a scale per output row (weight-only quantization; bf16 inputs); with `torch.qint8`, the same int8 rows
run by fbgemm's dynamic quantization (each input quantized on the fly, int8 products; both formats: `int8_weights.py`).
The drafter's few-row forwards are bound by reading its weights, so a quarter of fp32's bytes is most of the gain
(`qint8` is the fastest on every CPU measured, AMX included: docs/results.md, the drafter round by part); `fast_dtype`
picks it wherever torch has the kernel. The target's layers never run in a lower precision (its logits decide the
output); the drafter's may, since the verifier divides by the law the drafter actually produced, so its precision
moves its acceptance, never the output.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .int8_weights import DYNAMIC_INT8, LINEAR_DYNAMIC, dynamic_int8_rows, int8_rows

# Input rows (batch x tokens) up to which a layer uses its packed weight, unless a block names more (`max_rows`).
MAX_PACKED_ROWS = 64
# Where the packed kernel is faster at a prefill's rows too (`measure_max_packed_rows`, timed at PREFILL_PROBE_ROWS),
# a block's forwards of any row count run packed.
UNLIMITED_ROWS = 1 << 30
PREFILL_PROBE_ROWS = 256
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# What a block may compute in: a packable dtype, int8 weights (one scale per output row) with bf16 inputs, or the same
# weights with inputs quantized on the fly (fbgemm's dynamic quantization).
_COMPUTE_DTYPES = (*_PACKABLE_DTYPES, torch.int8, torch.qint8)
# Sibling layers that read the same input, which the fast path runs as one product (`fused_linears`): a decoder's
# query/key/value projections and its MLP's gate/up projections (transformers' names, which the drafter shares).
FUSED_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _ThreadState(threading.local):
    depth = 0  # `packed_linear_weights` blocks open in this thread


_thread = _ThreadState()
# id(layer) -> (open blocks routing it, compute dtype, the most rows kept on `F.linear`, the most rows run packed)
_routed: dict[int, tuple[int, torch.dtype | None, int, int]] = {}
_lock = threading.Lock()
_ONEDNN = torch.backends.mkldnn.is_available()
# Looked up once (`torch.ops` resolves names on every access), and only where oneDNN is built in (elsewhere the op
# may not exist).
_LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise if _ONEDNN else None
# (ids of the weights, dtype) -> (weak references to them, (their storages and versions when packed), packed copy of
# them stacked, in `dtype`, or None); outside the modules, so that copying, pickling or saving a model never meets a
# oneDNN tensor. An entry goes with any of its weights. (Keyed by id: tensors compare elementwise, so they cannot be
# the keys of a WeakKeyDictionary.) One weight is the common case; several are layers that read the same input and
# run as one product (`fused_linears`).
_Weights = tuple[torch.Tensor, ...]
_packed: dict[tuple[tuple[int, ...], torch.dtype], tuple[tuple[weakref.ref, ...], tuple, object]] = {}


def _entry(weights: _Weights, dtype: torch.dtype) -> tuple[tuple[weakref.ref, ...], tuple, object] | None:
    """The entry of `weights` in `_packed` for `dtype`, if it has one (an id reused by a new tensor does not count)."""
    entry = _packed.get((tuple(map(id, weights)), dtype))
    return entry if entry is not None and all(ref() is w for ref, w in zip(entry[0], weights)) else None


def _forget(key: tuple[tuple[int, ...], torch.dtype]) -> None:
    entry = _packed.get(key)
    if entry is not None and any(ref() is None for ref in entry[0]):
        del _packed[key]


def _packed_weight(weights: _Weights, dtype: torch.dtype) -> object:
    """`weights` stacked (one: as it is) in `dtype` and oneDNN's layout (packed on first use, again after any changes in
    place), or `None` where it cannot be packed (a weight `_packable` rules out, or the build or CPU lacks the kernel
    for that dtype). For `torch.int8`: `(int8 weight, bf16 scale per output row)`, symmetric, for
    `torch._weight_int8pack_mm` (input widths that are multiples of 16 only); for `torch.qint8`: fbgemm's prepacked
    int8 rows.

    Runs for every packed product (~150 per verification forward of SmolLM2), so finding a current copy takes a dict
    access and a comparison of each weight's storage and version, no more."""
    state = tuple([(w.data_ptr(), w._version) for w in weights])
    entry = _entry(weights, dtype)
    if entry is not None and entry[1] == state:
        return entry[2]
    if not all(_packable(w) for w in weights):
        return None
    weight = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
    try:
        if dtype == torch.int8:  # the kernel reads inputs 16 wide: other widths give wrong results (torch 2.13)
            packed = int8_rows(weight.float()) if weight.shape[1] % 16 == 0 else None
        elif dtype == torch.qint8:
            packed = dynamic_int8_rows(weight.float())
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), None)
    except RuntimeError:  # e.g. bf16 without AVX-512 / AVX-NE-CONVERT
        packed = None
    key = (tuple(map(id, weights)), dtype)
    refs = tuple(weakref.ref(w, lambda _, key=key: _forget(key)) for w in weights)
    _packed[key] = (refs, state, packed)
    return packed


def packed_copy(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """The packed copy kept for `weight` in `dtype` (default: its own), or `None` (never packed, released, or not
    packable)."""
    entry = _entry((weight,), dtype or weight.dtype)
    return None if entry is None else entry[2]


def fast_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which a drafter whose weights are in `dtype` runs its linear layers fastest on this CPU:
    `torch.qint8` (dynamic int8) where torch has fbgemm's kernel (x86), else bfloat16 where oneDNN has native bf16
    kernels (AVX-512 BF16 or AMX), else `dtype` (on AVX2-only CPUs bf16 is emulated and slower than fp32).

    Weights in bfloat16 (a drafter loaded without `dtype` keeps the dtype it was saved in) are quantized from their
    bf16 values too: on an AVX2-only CPU their emulated bf16 products made the shipped drafter's forward ~4x slower
    (37-39 ms against 9-13 ms in dynamic int8, 7 block rows, 1 thread)."""
    if dtype in _PACKABLE_DTYPES and DYNAMIC_INT8:
        return torch.qint8
    if dtype == torch.float32 and _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return dtype


def _packable(weight: torch.Tensor) -> bool:
    # Inference-mode tensors keep no version counter, so a packed copy could not tell that one was modified in place
    # (under `torch.inference_mode()`): they keep `F.linear`.
    return _ONEDNN and weight.device.type == "cpu" and weight.dtype in _PACKABLE_DTYPES and not weight.is_inference()


def linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`F.linear(input, weight, bias)`, from `weight` packed once when this thread is inside a `packed_linear_weights`
    block and the forward is one the packed kernel serves: CPU, a packable dtype, at most `MAX_PACKED_ROWS` rows, no
    gradient. `weight` `(out, in)`, `input` `(..., in)`. With `dtype` (a packable dtype other than the input's), the
    product runs in `dtype` from a packed copy in that dtype, and the result is cast back to the input's dtype; with
    `torch.int8`, from int8 weights with a scale per output row, on bf16 inputs; with `torch.qint8`, from the same
    rows with fp32 inputs quantized on the fly (fbgemm)."""
    compute = dtype or weight.dtype
    if _thread.depth and not _one_row_in_its_dtype(input, compute):  # outside a block (training, other threads)
        out = _packed_product(input, (weight,), bias, compute)
        if out is not None:
            return out
    return F.linear(input, weight, bias)


def fused_linears(input: torch.Tensor, layers: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """`tuple(layer(input) for layer in layers)`, as one product over the layers' stacked weights where this thread's
    block routes them all in one dtype and the forward is one the packed kernel serves: one kernel call (and in
    dynamic int8 one quantization of the input) instead of one per layer, e.g. a decoder's query, key and value
    projections (`FUSED_NAMES`). oneDNN computes each output column of the stacked product as it computes it alone,
    so the results are the separate products' (bit for bit where tested: `tests/test_lean_layers.py`). Forwards that
    keep `F.linear` (one row in the layers' dtype: `_one_row_in_its_dtype`) run it per layer; elsewhere (training,
    other threads) each layer runs its own forward."""
    route = _shared_route(layers) if _thread.depth else None
    if route is not None:
        compute, blas_max_rows, max_rows = route
        if _one_row_in_its_dtype(input, compute, blas_max_rows):
            return tuple(F.linear(input, layer.weight, layer.bias) for layer in layers)
        biases = [layer.bias for layer in layers if layer.bias is not None]
        if len(biases) in (0, len(layers)):
            bias = torch.cat(biases) if biases else None
            out = _packed_product(input, tuple(layer.weight for layer in layers), bias, compute, max_rows)
            if out is not None:
                return out.split([layer.out_features for layer in layers], dim=-1)
    return tuple(layer(input) for layer in layers)


def _shared_route(layers: tuple[nn.Linear, ...]) -> tuple[torch.dtype, int, int] | None:
    """`(compute dtype, blas_max_rows, max_rows)` of `layers` when this thread's blocks route them all in one compute
    dtype (the row limits that serve every one of them), else `None`."""
    routes = [_routed.get(id(layer)) for layer in layers]
    if None in routes:
        return None
    computes = {route[1] or layer.weight.dtype for route, layer in zip(routes, layers, strict=True)}
    if len(computes) != 1:
        return None
    return computes.pop(), max(route[2] for route in routes), min(route[3] for route in routes)


def _packed_product(
    input: torch.Tensor,
    weights: _Weights,
    bias: torch.Tensor | None,
    compute: torch.dtype,
    max_rows: int = MAX_PACKED_ROWS,
) -> torch.Tensor | None:
    """`input` times `weights` stacked, from their packed copy in `compute`, or `None` where none serves (more than
    `max_rows` rows among them). Which row counts keep `F.linear` in their own dtype (`_one_row_in_its_dtype`) is the
    callers' rule."""
    if input.dim() < 2 or not 0 < input.numel() // input.shape[-1] <= max_rows or compute not in _COMPUTE_DTYPES:
        return None
    if torch.is_grad_enabled() and (input.requires_grad or any(w.requires_grad for w in weights)):
        return None
    if not all(w.dtype == input.dtype for w in weights):
        return None
    packed = _packed_weight(weights, compute)
    if packed is None:
        return None
    if compute == torch.qint8:  # fp32 in and out, any leading dimensions
        if input.dtype != torch.float32:
            out = LINEAR_DYNAMIC(input.float(), packed, True).to(input.dtype)
        else:
            out = LINEAR_DYNAMIC(input, packed, True)
        return out if bias is None else out + bias
    if compute == torch.int8:
        quantized, scale = packed
        rows = input.reshape(-1, input.shape[-1]).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(rows, quantized, scale).view(*input.shape[:-1], -1).to(input.dtype)
        return out if bias is None else out + bias
    if compute == input.dtype:
        return _LINEAR_POINTWISE(input, packed, bias, "none", [], "")
    bias = None if bias is None else bias.to(compute)
    return _LINEAR_POINTWISE(input.to(compute), packed, bias, "none", [], "").to(input.dtype)


def _one_row_in_its_dtype(input: torch.Tensor, compute: torch.dtype | None, blas_max_rows: int = 1) -> bool:
    """Whether a product keeps `F.linear`: at most `blas_max_rows` rows computed in their own dtype. By default one
    row: BLAS's matrix-vector product reads each weight once without repacking, and where it is fast oneDNN's per-call
    setup (~30 us a product) only adds to it (SmolLM2-135M, fp32, a one-token step on a 2-vCPU AMD EPYC with AVX2:
    65 ms with `F.linear`, 78 ms packed at one thread, equal at two); where it is slow the calibration measures 0. A
    lower-precision `compute` always packs: it reads a fraction of the bytes."""
    return compute in (None, input.dtype) and input.numel() <= blas_max_rows * input.shape[-1]


def _routed_forward(layer: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """What a routed layer's `forward` runs: `linear` with its weight, bias and its block's compute dtype; one row in
    its own dtype (or up to the block's `blas_max_rows`) goes to `F.linear` at once (a one-token step calls
    ~200 layers, and each call on the way costs ~1.5 us)."""
    _, compute, blas_max_rows, max_rows = _routed[id(layer)]
    if _thread.depth and not _one_row_in_its_dtype(input, compute, blas_max_rows):
        out = _packed_product(input, (layer.weight,), layer.bias, compute or layer.weight.dtype, max_rows)
        if out is not None:
            return out
    return F.linear(input, layer.weight, layer.bias)


def _packable_layers(models: tuple[nn.Module, ...]) -> list[nn.Linear]:
    layers = {id(m): m for model in models for m in model.modules() if type(m) is nn.Linear}
    return [m for m in layers.values() if _packable(m.weight)]


def _product_groups(models: tuple[nn.Module, ...]) -> list[tuple[nn.Linear, ...]]:
    """`models`' packable linear layers as the fast path runs them: siblings named in `FUSED_NAMES` as one product
    (`fused_linears`), every other layer alone."""
    layers = _packable_layers(models)
    packable, grouped, groups = {id(m) for m in layers}, set(), []
    for model in models:
        for module in model.modules():
            for names in FUSED_NAMES:
                group = tuple(getattr(module, name, None) for name in names)
                if all(id(m) in packable for m in group) and len({m.in_features for m in group}) == 1:
                    groups.append(group)
                    grouped.update(map(id, group))
    return groups + [(m,) for m in layers if id(m) not in grouped]


@contextlib.contextmanager
def packed_linear_weights(
    *models: nn.Module, dtype: torch.dtype | None = None, blas_max_rows: int = 1, max_rows: int = MAX_PACKED_ROWS
) -> Iterator[None]:
    """Inside the block, this thread's few-row forwards of `models`' CPU `nn.Linear` layers use packed weights (in
    `dtype`, when given: see the module docstring), except forwards of at most `blas_max_rows` rows in the layers' own
    dtype, which keep `F.linear` (`measure_blas_max_rows`), and forwards of more than `max_rows` rows (a prefill;
    `measure_max_packed_rows`).

    Blocks nest and may be open in several threads at once; a layer's own `forward` is restored when the last block
    routing it exits, exceptions included. A layer routed by several open blocks keeps the first one's dtype and
    `blas_max_rows`.
    """
    layers = _packable_layers(models)
    with _lock:
        for layer in layers:
            count, *routing = _routed.get(id(layer), (0, dtype, blas_max_rows, max_rows))
            if count == 0:
                layer.forward = _routed_forward.__get__(layer)
            _routed[id(layer)] = (count + 1, *routing)
    _thread.depth += 1
    try:
        yield
    finally:
        _thread.depth -= 1
        with _lock:
            for layer in layers:
                count, *routing = _routed.pop(id(layer))
                if count > 1:
                    _routed[id(layer)] = (count - 1, *routing)
                else:
                    del layer.forward  # back to `nn.Linear.forward`


def _packed_is_faster(
    groups: list[tuple[nn.Linear, ...]], rows: int, repeats: int, generator: torch.Generator
) -> bool:
    """Whether one pass over `groups` (`_product_groups`) at `rows` random input rows (in their own dtype) runs faster
    on their packed copies, a group as one product, than on `F.linear` per layer: the fastest of `repeats` passes
    each, interleaved (other processes only ever add time); the packed copies made on the way are kept."""
    dtype = groups[0][0].weight.dtype
    widths = {group[0].in_features for group in groups}
    inputs = {w: torch.randn(rows, w, generator=generator).to(dtype) for w in widths}

    def seconds(packed: bool) -> float:
        start = time.perf_counter()
        for group in groups:
            x = inputs[group[0].in_features]
            if packed:
                biases = [layer.bias for layer in group if layer.bias is not None]
                bias = torch.cat(biases) if len(biases) == len(group) else None
                _packed_product(x, tuple(layer.weight for layer in group), bias, dtype, max_rows=rows)
            else:
                for layer in group:
                    F.linear(x, layer.weight, layer.bias)
        return time.perf_counter() - start

    times = [(seconds(False), seconds(True)) for _ in range(repeats)]
    return min(t[1] for t in times) < min(t[0] for t in times)


def _can_pack(groups: list[tuple[nn.Linear, ...]]) -> bool:
    weights = [tuple(layer.weight for layer in group) for group in groups]
    return bool(groups) and all(_packed_weight(w, w[0].dtype) is not None for w in weights)


@torch.no_grad()
def measure_blas_max_rows(model: nn.Module, repeats: int = 3, max_rows: int = 16) -> int:
    """The most rows up to which `F.linear` runs `model`'s packable linear layers (in their own dtype) faster than
    their packed copies on this machine, each group of `_product_groups` timed as the one product the fast path runs
    it as, counting up from one row until the packed kernel is faster
    (`_packed_is_faster`): 0 where it is at one row already (a one-token step then runs packed too), 1 where it cannot
    pack them."""
    groups = _product_groups((model,))
    if not _can_pack(groups):
        return 1
    generator = torch.Generator().manual_seed(0)
    for rows in range(1, max_rows + 1):
        if _packed_is_faster(groups, rows, repeats, generator):
            return rows - 1
    return max_rows


@torch.no_grad()
def measure_max_packed_rows(model: nn.Module, rows: int = PREFILL_PROBE_ROWS, repeats: int = 2) -> int:
    """The most rows `model`'s packed copies serve on this machine: any count (`UNLIMITED_ROWS`) where its packable
    layers run faster packed at `rows` rows (a prefill's chunk; `_packed_is_faster`), else `MAX_PACKED_ROWS`, where
    sgemm's packing is amortised."""
    groups = _product_groups((model,))
    if not _can_pack(groups):
        return MAX_PACKED_ROWS
    faster = _packed_is_faster(groups, rows, repeats, torch.Generator().manual_seed(0))
    return UNLIMITED_ROWS if faster else MAX_PACKED_ROWS


def drafter_linear_dtype(drafter: nn.Module) -> torch.dtype:
    """The dtype of `drafter`'s linear layers on the fast path: its `linear_dtype` ("auto": `fast_dtype` of its own)."""
    choice = getattr(drafter, "linear_dtype", "auto")
    if choice == "auto":
        return fast_dtype(drafter.dtype)
    if choice not in _COMPUTE_DTYPES:
        raise ValueError(
            f"drafter.linear_dtype must be 'auto', torch.float32, torch.bfloat16, torch.int8 (int8 weights, bf16 "
            f"inputs) or torch.qint8 (dynamic int8), got {choice!r}."
        )
    return choice


def packed_drafter_weights(drafter: nn.Module) -> contextlib.AbstractContextManager[None]:
    """`packed_linear_weights` for a bound drafter: its linear layers and output head, in `drafter_linear_dtype`.

    Not the Markov correction's projection: its product is one row by `markov_rank` (32) inputs, which `F.linear`
    runs in about half the time of any packed kernel (their per-call setup outweighs a product this thin)."""
    modules = [module for name, module in drafter.named_children() if name != "markov_proj"]
    return packed_linear_weights(*modules, drafter.output_head, dtype=drafter_linear_dtype(drafter))


def release_packed_weights(*models: nn.Module) -> None:
    """Frees the packed copies of `models`' linear weights, in every dtype (they are packed again on the next use)."""
    weights = {id(p) for model in models for p in model.parameters()}
    for key in [key for key in _packed if weights.intersection(key[0])]:
        del _packed[key]


__all__ = [
    "MAX_PACKED_ROWS",
    "drafter_linear_dtype",
    "fast_dtype",
    "fused_linears",
    "packed_drafter_weights",
    "linear",
    "measure_blas_max_rows",
    "measure_max_packed_rows",
    "packed_copy",
    "packed_linear_weights",
    "release_packed_weights",
]
