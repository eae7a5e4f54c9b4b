"""K/V rows of one request, read out of vLLM's paged CPU KV cache.

vLLM's CPU attention backend keeps, per layer, a `(num_blocks, num_kv_heads, block_size, 2 * head_dim)` tensor. For
each (block, KV head) the first `block_size * head_dim` elements hold the block's keys and the next as many its
values, in a layout that depends on the kernel the backend chose for the layer (`attention_layer.isa`):

- `"vec"` (float32, float16, and bfloat16 without AMX) and `"vec16"` (what vLLM picks instead for block sizes that
  are not a multiple of 32, or head sizes that are a multiple of 16 but not of 32): keys dimension-major
  `[head_dim, block_size]`, values row-major `[block_size, head_dim]`.
- `"amx"` (bfloat16 with AMX tiles): both packed in pairs for the tile kernels: key `[t, d]` of a block at
  `[t // 16, d // 2, t % 16, d % 2]` of a `(block_size / 16, head_dim / 2, 16, 2)` view, value `[t, d]` at
  `[d // 16, t // 2, d % 16, t % 2]` of a `(head_dim / 16, block_size / 2, 16, 2)` view.

Other layouts (fp8 caches, ARM/Power/RISC-V kernels) are refused with an error that names them. The rows come back
as the Hugging Face cache holds them: post-RoPE keys and values, `(1, num_kv_heads, n, head_dim)`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

SUPPORTED_LAYOUTS = ("vec", "vec16", "amx")


def unpack_blocks(blocks: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw cache blocks `(n, num_kv_heads, block_size, 2 * head_dim)` -> keys and values, each
    `(num_kv_heads, n * block_size, head_dim)` in token order."""
    if layout not in SUPPORTED_LAYOUTS:
        raise ValueError(
            f"LongSpark cannot read vLLM KV-cache blocks in the {layout!r} layout (it reads {SUPPORTED_LAYOUTS}: "
            "the x86 CPU backend with a float32, float16 or bfloat16 cache). Serve the target with one of those "
            "(e.g. `dtype='float32'` or `'bfloat16'`, no fp8 `kv_cache_dtype`)."
        )
    n, heads, block_size, twice_head_dim = blocks.shape
    head_dim = twice_head_dim // 2
    halves = blocks.reshape(n, heads, 2, block_size * head_dim)
    keys, values = halves[:, :, 0], halves[:, :, 1]
    if layout == "amx":
        keys = keys.view(n, heads, block_size // 16, head_dim // 2, 16, 2).permute(0, 1, 2, 4, 3, 5)
        values = values.view(n, heads, head_dim // 16, block_size // 2, 16, 2).permute(0, 1, 3, 5, 2, 4)
    else:
        keys = keys.view(n, heads, head_dim, block_size).transpose(-1, -2)
        values = values.view(n, heads, block_size, head_dim)
    return tuple(
        t.reshape(n, heads, block_size, head_dim).transpose(0, 1).reshape(heads, n * block_size, head_dim)
        for t in (keys, values)
    )


class PagedRequestRows:
    """The first `num_rows` K/V rows of one request in vLLM's paged cache, for the drafter's selected layers.

    It stands in for a Hugging Face cache in `read_context` (`last_rows` is what `read_cache_rows` calls), so
    the summary and window math is the package's one copy whatever holds the rows.

    Args:
        kv_caches: target layer index -> `(kv_cache tensor, layout)` of that layer.
        block_ids: the request's block table (physical block of each `block_size` positions), in order.
        num_rows: rows the request has in the cache (its valid prefix; rows of rejected drafts lie beyond).
        dtype: dtype of the returned rows (the drafter's).
    """

    def __init__(
        self,
        kv_caches: Mapping[int, tuple[torch.Tensor, str]],
        block_ids: Sequence[int] | torch.Tensor,
        num_rows: int,
        dtype: torch.dtype,
    ):
        self.kv_caches, self.num_rows, self.dtype = kv_caches, num_rows, dtype
        self.block_ids = torch.as_tensor(block_ids, dtype=torch.long)

    def last_rows(self, layer_id: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `[num_rows_total - num_rows, num_rows_total)` of target layer `layer_id`, each
        `(1, num_kv_heads, num_rows, head_dim)`."""
        if num_rows > self.num_rows:
            raise ValueError(f"Asked for the last {num_rows} rows of a request that has {self.num_rows}.")
        kv_cache, layout = self.kv_caches[layer_id]
        _, heads, block_size, twice_head_dim = kv_cache.shape
        if num_rows == 0:
            empty = kv_cache.new_zeros(1, heads, 0, twice_head_dim // 2, dtype=self.dtype)
            return empty, empty
        start = self.num_rows - num_rows
        first, last = start // block_size, (self.num_rows - 1) // block_size
        if last >= len(self.block_ids):
            raise ValueError(
                f"The block table holds {len(self.block_ids)} blocks of {block_size} rows; "
                f"row {self.num_rows - 1} is beyond it."
            )
        keys, values = unpack_blocks(kv_cache[self.block_ids[first : last + 1]], layout)
        offset = start - first * block_size
        rows = slice(offset, offset + num_rows)
        return keys[None, :, rows].to(self.dtype), values[None, :, rows].to(self.dtype)


__all__ = ["SUPPORTED_LAYOUTS", "PagedRequestRows", "unpack_blocks"]
