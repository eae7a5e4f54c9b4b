"""The fixed-size context a LongSpark drafter reads from its target (the paper's Section 2.2, "Fixed-cost
context interface").

Three views per selected target layer:

- the **boundary state**: the selected layers' hidden states at the last cached position;
- the **recent window**: the last `W` K/V rows of the target cache, read as a view (never copied);
- the **global summary**: `S_t = softmax(U K[1..t]^T / sqrt(d)) V[1..t]` for `m` learned queries `U` per KV head,
  kept as one value vector and one log-normaliser per query and updated by folding in only new rows.

Each view has one home here, used by inference and training alike: `boundary_states` picks the boundary rows of the
captured hidden states, `window_views` gathers each request's (or anchor's) last `w` real rows, and the summary is
folded in incrementally (`LongSparkContextState.absorb`, inference) or computed for many prefixes at once
(`prefix_summaries`, training). `read_context` is one inference round: absorb the new cache rows, gather the windows.
`LongSparkContextState` holds the persistent part (summary + boundary) for `N` requests (one in transformers' own
assisted loop, a batch in `inference/batched.py`); its size per request depends on the config alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .configuration_longspark import LongSparkConfig
from .targets import read_cache_rows


@dataclass
class DraftContext:
    """What one drafting round attends to, for `N` requests (inference) or anchors (training).

    Attributes:
        boundary_states: `(N, D * hidden_size)`, the selected layers' hidden states at the boundary, concatenated.
        window_keys / window_values: per draft layer, `(N, num_kv_heads, w, head_dim)` recent rows (`w <= W`).
        window_mask: `(N, w)` bool, True for real rows; `None` when every row is real.
        summary_values: per draft layer, `(N, num_kv_heads, m, head_dim)`, the global summary `S_t`.
        positions: `(N,)` absolute position of the first block slot (= number of cached target rows `t`).
    """

    boundary_states: torch.Tensor
    window_keys: list[torch.Tensor]
    window_values: list[torch.Tensor]
    window_mask: torch.Tensor | None
    summary_values: list[torch.Tensor]
    positions: torch.Tensor

    def select(self, index: torch.LongTensor) -> DraftContext:
        """The context of the requests `index` `(n',)` only."""
        return DraftContext(
            boundary_states=self.boundary_states[index],
            window_keys=[keys[index] for keys in self.window_keys],
            window_values=[values[index] for values in self.window_values],
            window_mask=None if self.window_mask is None else self.window_mask[index],
            summary_values=[values[index] for values in self.summary_values],
            positions=self.positions[index],
        )


def stack_contexts(contexts: list[DraftContext]) -> DraftContext:
    """One `DraftContext` for the requests of several, so that one drafter forward drafts for all of them. Windows
    shorter than the longest are left-padded with zero rows that `window_mask` masks out."""
    if len(contexts) == 1:
        return contexts[0]
    width = max((c.window_keys[0].shape[2] for c in contexts if c.window_keys), default=0)

    def per_layer(name: str, pad: bool) -> list[torch.Tensor]:
        layers = zip(*(getattr(c, name) for c in contexts))  # per layer: one tensor per context
        return [torch.cat([F.pad(t, (0, 0, width - t.shape[2], 0)) if pad else t for t in ts]) for ts in layers]

    masks = []
    for c in contexts:
        n, w = c.positions.shape[0], c.window_keys[0].shape[2] if c.window_keys else 0
        own = c.window_mask if c.window_mask is not None else c.positions.new_ones(n, w, dtype=torch.bool)
        masks.append(F.pad(own, (width - w, 0), value=False))
    return DraftContext(
        boundary_states=torch.cat([c.boundary_states for c in contexts]),
        window_keys=per_layer("window_keys", pad=True),
        window_values=per_layer("window_values", pad=True),
        window_mask=torch.cat(masks) if contexts[0].window_keys else None,
        summary_values=per_layer("summary_values", pad=False),
        positions=torch.cat([c.positions for c in contexts]),
    )


def summarize_rows(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention summary of a set of rows, for one layer or for several at once (leading dims `...`).

    Args:
        queries: `(..., num_kv_heads, m, head_dim)` summary queries `U`.
        keys / values: `(..., N, num_kv_heads, T, head_dim)`, with `T >= 1`.
        mask: `(N, T)` bool, True for the rows to summarize; `None` summarizes them all. A request without any row
            gets `log_norm = -inf` and a zero `out`, the empty summary `merge_summaries` accepts.

    Returns:
        `(log_norm, out)`: `(..., N, num_kv_heads, m)` log-sum-exp of the scores and `(..., N, num_kv_heads, m,
        head_dim)` the softmax-weighted values, both float32.
    """
    scale = queries.shape[-1] ** -0.5
    scores = torch.einsum("...hmd,...nhtd->...nhmt", queries.float(), keys.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    log_norm = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - _finite_or_zero(log_norm).unsqueeze(-1))
    out = torch.einsum("...nhmt,...nhtd->...nhmd", weights, values.float())
    return log_norm, out


def merge_summaries(
    log_norm_a: torch.Tensor, out_a: torch.Tensor, log_norm_b: torch.Tensor, out_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summary of the union of two disjoint row sets: `l = logaddexp(l_a, l_b)`, `o = e^(l_a-l) o_a + e^(l_b-l) o_b`.

    Either set may be empty (`l = -inf`, `o = 0`); the union of two empty sets is empty."""
    log_norm = torch.logaddexp(log_norm_a, log_norm_b)
    reference = _finite_or_zero(log_norm)
    weight_a = torch.exp(log_norm_a - reference).unsqueeze(-1)
    weight_b = torch.exp(log_norm_b - reference).unsqueeze(-1)
    return log_norm, weight_a * out_a + weight_b * out_b


def _finite_or_zero(log_norm: torch.Tensor) -> torch.Tensor:
    # An empty set's -inf normaliser would turn its zero weights into exp(-inf + inf) = nan.
    return torch.where(torch.isfinite(log_norm), log_norm, 0.0)


def prefix_summaries(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_rows: torch.Tensor
) -> torch.Tensor:
    """Summaries of the prefixes `rows[0:t]` for many anchors at once: one causal prefix attention (training).

    Args:
        queries: `(num_kv_heads, m, head_dim)`.
        keys / values: `(1, num_kv_heads, T, head_dim)`, one sequence's rows.
        num_rows: `(A,)` prefix length `t >= 1` of each anchor.

    Returns:
        `(A, num_kv_heads, m, head_dim)`: `S_t` for each anchor, in the dtype of `values`.
    """
    num_kv_heads, m, head_dim = queries.shape
    num_anchors = num_rows.shape[0]
    rows = torch.arange(keys.shape[2], device=keys.device)
    visible = rows[None, :] < num_rows[:, None]  # (A, T)
    q = queries.to(keys.dtype).unsqueeze(1).expand(num_kv_heads, num_anchors, m, head_dim)
    q = q.reshape(1, num_kv_heads, num_anchors * m, head_dim)
    mask = visible.repeat_interleave(m, dim=0)[None, None]  # (1, 1, A*m, T)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return out.view(num_kv_heads, num_anchors, m, head_dim).transpose(0, 1)


def last_real_columns(column_mask: torch.BoolTensor, width: int) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Where each request's recent window lies in a cache whose columns are not all its real rows.

    Args:
        column_mask: `(N, T)` bool, True where column `c` holds a real row of request `n` (False for padding and
            rejected drafts).
        width: window rows `w`.

    Returns:
        `(index, mask)`, both `(N, w)`: the columns of request `n`'s last `w` real rows, oldest first and
        right-aligned; a request with fewer real rows has its first entries masked out (`mask` False, index 0).
    """
    num_requests, num_columns = column_mask.shape
    rank = column_mask.cumsum(dim=1)  # real rows up to and including each column
    slot = rank - (rank[:, -1:] - width) - 1  # window slot of each real column, < 0 before the window
    in_window = column_mask & (slot >= 0)
    slot = torch.where(in_window, slot, width)  # every other column goes to a spare slot, dropped below
    columns = torch.arange(num_columns, device=column_mask.device).expand(num_requests, -1)
    index = column_mask.new_zeros(num_requests, width + 1, dtype=torch.long).scatter_(1, slot, columns)
    mask = column_mask.new_zeros(num_requests, width + 1).scatter_(1, slot, in_window)
    return index[:, :width], mask[:, :width]


def prefix_columns(num_rows: torch.LongTensor, num_columns: int) -> torch.BoolTensor:
    """`(N, num_columns)` column mask of `N` prefixes of one sequence: True for the first `num_rows[n]` columns."""
    return torch.arange(num_columns, device=num_rows.device)[None, :] < num_rows[:, None]


def boundary_states(
    layer_states: list[torch.Tensor], positions: torch.LongTensor, rows: torch.LongTensor | None = None
) -> torch.Tensor:
    """The boundary view: `(N, D * hidden_size)`, the selected layers' hidden states at `positions` `(N,)`.

    `layer_states`: per selected layer, `(batch, T, hidden_size)` states of one target forward; request `n` reads
    position `positions[n]` of batch row `rows[n]` (default: row 0, e.g. one sequence's anchors in training)."""
    rows = torch.zeros_like(positions) if rows is None else rows
    return torch.cat([states[rows, positions] for states in layer_states], dim=-1)


def window_views(
    layer_rows: list[tuple[torch.Tensor, torch.Tensor]], column_mask: torch.BoolTensor | None, width: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.BoolTensor | None]:
    """The recent-window view: each request's last `width` real rows of every selected layer.

    Args:
        layer_rows: per selected layer, `(keys, values)` `(N or 1, num_kv_heads, T, head_dim)`, the last `T` columns
            of the cache (one sequence's rows, shared by all `N` requests, when the batch dimension is 1).
        column_mask: `(N, T)` bool, True where a column holds a real row of request `n` (`last_real_columns`). `None`:
            one request whose columns are all real; its window is then a view of the last `width` rows (no copy).

    Returns:
        `(keys, values, mask)`: per layer `(N, num_kv_heads, width, head_dim)`, and the `(N, width)` mask of real rows
        (`None` without a column mask).
    """
    if column_mask is None:
        return [k[:, :, -width:] for k, _ in layer_rows], [v[:, :, -width:] for _, v in layer_rows], None
    index, mask = last_real_columns(column_mask, width)
    n = column_mask.shape[0]
    keys = [gather_columns(k.expand(n, -1, -1, -1), index) for k, _ in layer_rows]
    values = [gather_columns(v.expand(n, -1, -1, -1), index) for _, v in layer_rows]
    return keys, values, mask


def gather_columns(rows: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    """`rows[n, :, index[n]]`: `(N, num_kv_heads, T, head_dim)` cache rows and `(N, w)` column indices ->
    `(N, num_kv_heads, w, head_dim)`."""
    num_requests, heads, _, head_dim = rows.shape
    return rows.gather(2, index[:, None, :, None].expand(num_requests, heads, -1, head_dim))


class LongSparkContextState:
    """Persistent drafter state of `N` requests: global summary, rows absorbed, boundary states.

    The summary keeps a `(D, N, num_kv_heads, m)` log-normaliser and a `(D, N, num_kv_heads, m, head_dim)` value in
    float32, all `D` selected layers in one tensor (one set of operations per update, not one per layer). `absorb`
    folds in the rows the target cache gained since the last round (all of the prompt at prefill, in chunks of
    `chunk_size` rows, then at most `B + 1` rows per round). `num_absorbed` counts cache columns (shared by the `N`
    requests), whether or not they were real rows of a request.
    """

    def __init__(self, num_layers: int, chunk_size: int):
        self.num_layers = num_layers
        self.chunk_size = chunk_size
        self.num_absorbed = 0
        self.log_norm: torch.Tensor | None = None
        self.summary: torch.Tensor | None = None
        self.boundary_states: torch.Tensor | None = None

    def absorb(
        self,
        queries: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        mask: torch.Tensor | None = None,
    ) -> None:
        """Folds new rows into every layer's summary, `chunk_size` rows at a time.

        Args:
            queries: `(D, num_kv_heads, m, head_dim)`, the drafter's `U`.
            keys / values: per layer, `(N, num_kv_heads, n, head_dim)` rows (views of the cache; each chunk of the
                `D` layers is stacked once).
            mask: `(N, n)`, each request's real rows (False for padding and rejected drafts); `None`: all real.
        """
        if len(keys) != self.num_layers:
            raise ValueError(f"absorb takes the rows of all {self.num_layers} layers at once, got {len(keys)}.")
        for start in range(0, keys[0].shape[2], self.chunk_size):
            chunk = slice(start, start + self.chunk_size)
            chunk_mask = None if mask is None else mask[:, chunk]
            chunk_keys, chunk_values = (
                torch.stack([rows[:, :, chunk] for rows in layers]) for layers in (keys, values)
            )
            log_norm, out = summarize_rows(queries, chunk_keys, chunk_values, chunk_mask)
            if self.log_norm is not None:
                log_norm, out = merge_summaries(self.log_norm, self.summary, log_norm, out)
            self.log_norm, self.summary = log_norm, out

    @property
    def summaries(self) -> list[torch.Tensor]:
        """Per layer, the `(N, num_kv_heads, m, head_dim)` summary `S_t` (views; empty before any row)."""
        return [] if self.summary is None else list(self.summary.unbind(0))

    def select(self, indices: torch.LongTensor) -> None:
        """Keeps the requests `indices` `(N',)` only, in that order (e.g. the unfinished rows of a batch)."""
        if self.summary is not None:
            self.log_norm, self.summary = self.log_norm[:, indices], self.summary[:, indices]
        if self.boundary_states is not None:
            self.boundary_states = self.boundary_states[indices]

    @property
    def nbytes(self) -> int:
        """Bytes held between rounds (summary + boundary); fixed by the config, whatever the prefix length."""
        tensors = [self.log_norm, self.summary, self.boundary_states]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def read_context(
    config: LongSparkConfig,
    summary_queries: torch.Tensor,
    state: LongSparkContextState,
    cache: Any,
    num_columns: int,
    column_mask: torch.BoolTensor | None = None,
) -> DraftContext:
    """One inference round's context: absorbs the cache columns added since the last round into the summary and
    gathers the recent windows.

    Args:
        summary_queries: `(D, num_kv_heads, m, head_dim)`, the drafter's `U`.
        state: the requests' persistent state; its `boundary_states` must already be set for this round.
        cache: the target cache (`targets.read_cache_rows`), `num_columns` columns long.
        column_mask: `(N, num_columns)` bool, True where a column holds a real row of request `n` (False for left
            padding and rejected drafts); `None`: one request whose columns are all real.
    """
    new_rows = num_columns - state.num_absorbed
    if column_mask is None:
        width = config.window_width(num_columns)
        rows_to_read = max(new_rows if config.reads_summary else 0, width)
        positions, new_mask = torch.tensor([num_columns], device=state.boundary_states.device), None
    else:
        positions = column_mask.sum(dim=1)
        width, rows_to_read = config.window_width(int(positions.max())), num_columns
        new_mask = column_mask[:, num_columns - new_rows :]
    layer_rows = [read_cache_rows(cache, layer_id, rows_to_read) for layer_id in config.target_layer_ids]
    if config.reads_summary and new_rows > 0:
        new_keys = [keys[:, :, -new_rows:] for keys, _ in layer_rows]
        state.absorb(summary_queries, new_keys, [values[:, :, -new_rows:] for _, values in layer_rows], new_mask)
    state.num_absorbed = num_columns
    window_keys, window_values, window_mask = [], [], None
    if config.reads_window:
        window_keys, window_values, window_mask = window_views(layer_rows, column_mask, width)
    return DraftContext(
        boundary_states=state.boundary_states,
        window_keys=window_keys,
        window_values=window_values,
        window_mask=window_mask,
        summary_values=list(state.summaries) if config.reads_summary else [],
        positions=positions,
    )
