"""The two int8 formats of the drafter's linear weights on CPU (`packed_linear.py` keeps one copy per weight).

Both are symmetric with one scale per output row (`row_scales`): `int8_rows` for `torch._weight_int8pack_mm` (int8
weights times bf16 inputs, weight-only quantization), and `dynamic_int8_rows` for fbgemm's dynamic quantization
(`LINEAR_DYNAMIC`: each input quantized on the fly, int8 products; x86 builds of torch only, `DYNAMIC_INT8`).
Only the drafter's layers ever run in them: its precision moves its acceptance, never the output, since the verifier
divides by the law the drafter actually produced.
"""

from __future__ import annotations

import warnings

import torch

# fbgemm's dynamic int8 kernel exists in this build (x86).
DYNAMIC_INT8 = hasattr(torch.ops.quantized, "linear_dynamic") and torch.backends.quantized.engine in ("x86", "fbgemm")
# Looked up once: `torch.ops` resolves names on every access. Called as `LINEAR_DYNAMIC(input, packed, True)`.
LINEAR_DYNAMIC = torch.ops.quantized.linear_dynamic.default if DYNAMIC_INT8 else None


def row_scales(weight: torch.Tensor) -> torch.Tensor:
    """`(out,)` the scale of each output row of `weight` `(out, in)` in symmetric int8: `max |row| / 127` (1 for a
    zero row)."""
    scale = weight.abs().amax(dim=1) / 127
    return torch.where(scale > 0, scale, 1.0)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row symmetric int8 of `weight` `(out, in)`: `(int8 (out, in), bf16 scale (out,))` with
    `weight ~ int8 * scale[:, None]`, for `torch._weight_int8pack_mm`."""
    scale = row_scales(weight)
    quantized = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return quantized, scale.to(torch.bfloat16)


def dynamic_int8_rows(weight: torch.Tensor) -> torch.ScriptObject | None:
    """`weight` `(out, in)` as fbgemm's prepacked int8 rows (symmetric, a scale per output row) for `LINEAR_DYNAMIC`,
    or `None` without the kernel."""
    if not DYNAMIC_INT8:
        return None
    scale = row_scales(weight).double()
    with warnings.catch_warnings():  # torch deprecates quantized tensors in favour of torchao; 2.13 still runs them
        warnings.simplefilter("ignore", UserWarning)
        rows = torch.quantize_per_channel(weight, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(rows, None)


__all__ = ["DYNAMIC_INT8", "LINEAR_DYNAMIC", "dynamic_int8_rows", "int8_rows", "row_scales"]
