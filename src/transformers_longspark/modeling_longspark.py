"""The LongSpark drafter network (the paper's Section 2.3 and Appendix A.1).

One forward serves training and inference: `B` block slots (the anchor token and `B - 1` masks) pass through `D`
Qwen3-style layers; draft layer `j` attends, with one softmax and bidirectionally among the slots, to
`[block; recent window of target layer S[j]; global summary of S[j]]`. The target's final norm and LM head give
base logits, and a low-rank Markov correction `W_c(e_c(prev))` adds the dependence on the previous token.

With `config.draft_vocab_size` set, the drafter scores only the tokens of its `draft_vocab` buffer (rows of the
target's LM head gathered once per `bind_target`; the mapping to and from the target's vocabulary is
`draft_vocabulary.py`'s).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, PreTrainedModel
from transformers import initialization as init
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP
from transformers.utils import ModelOutput

from .configuration_longspark import LongSparkConfig
from .context_state import DraftContext
from .draft_vocabulary import DraftVocabularyMixin
from .packed_linear import fused_linears
from .targets import TargetModules, target_modules

# Default `assistant_confidence_threshold` of new drafters (0 always proposes whole blocks). On the shipped SmolLM2
# drafter, 0.3 keeps 99.6% of tau on chat and all of it on long code while proposing 2.6-3.1 tokens per round instead
# of 6.5-6.8 (docs/how-it-works.md, Dynamic block length).
DEFAULT_CONFIDENCE_THRESHOLD = 0.3


@dataclass
class LongSparkDrafterOutput(ModelOutput):
    """
    Args:
        logits: `(N, B, output_vocab_size)`; slot `i - 1` scores draft token `y_i`. Markov-corrected when
            `previous_ids` was given, base logits otherwise. Column `k` scores token `draft_vocab[k]` when the
            drafter has a draft vocabulary, token `k` otherwise.
        base_logits: `(N, B, output_vocab_size)`, before the Markov correction.
        hidden_states: `(N, B, hidden_size)`, the slots' final features after the target's norm: what the LM head
            reads (training's feature loss regresses them on the target's).
    """

    logits: torch.Tensor | None = None
    base_logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


def _contents_key(tensors: tuple[torch.Tensor | None, ...]) -> tuple | None:
    """Identifies the current contents of `tensors`: each one's id, storage and version; `None` (never the same) when
    one is an inference-mode tensor, which keeps no version. The caller holds the tensors, so that their ids are not
    reused."""
    if any(t is not None and t.is_inference() for t in tensors):
        return None
    return tuple(None if t is None else (id(t), t.data_ptr(), t._version) for t in tensors)


class LongSparkRMSNorm(nn.Module):
    """RMS norm over the last dimension, `x / sqrt(mean(x^2) + eps) * weight`, in one `F.rms_norm` call (Qwen3's
    `Qwen3RMSNorm` spells it as eight operations; a drafter round runs 22 norms on a few rows, where each operation's
    dispatch costs more than its arithmetic). Same parameter, same state dict."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight.dtype == hidden_states.dtype else self.weight.to(hidden_states.dtype)
        return F.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)


def rotary_factors(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cos, sin)` `(N, B, head_dim)` -> `(cos, signed_sin)` `(N, 1, B, head_dim)` for `rotate`, computed once per
    forward: `rotate_half(x) * sin` equals `x.roll(head_dim // 2, -1) * signed_sin` with the first half of `sin`
    negated."""
    half = sin.shape[-1] // 2
    return cos[:, None], torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE of `x` `(N, heads, B, head_dim)` (transformers' `x * cos + rotate_half(x) * sin`) in four operations."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class LongSparkAttention(nn.Module):
    """Attention of the block slots over `[block; recent window; summary]` with a single softmax."""

    def __init__(self, config: LongSparkConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        if config.use_qk_norm:
            self.q_norm = LongSparkRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LongSparkRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:  # a drafter warm-started from a target without head norms (`warm_start.py`)
            self.q_norm = self.k_norm = nn.Identity()

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        context_keys: list[torch.Tensor],
        context_values: list[torch.Tensor],
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """
        Args:
            hidden_states: `(N, B, hidden_size)`.
            position_embeddings: target RoPE at absolute block positions as `rotary_factors` gives them,
                `(cos, signed_sin)`, each `(N, 1, B, head_dim)`.
            context_keys / context_values: `(N, num_kv_heads, *, head_dim)` tensors appended after the block keys
                (recent window, then summary queries `U` / summary values `S_t`).
            key_mask: `(N, 1, 1, B + context)` bool, False for padded window rows; `None` when nothing is padded.
        """
        n, b, _ = hidden_states.shape
        q, k, v = fused_linears(hidden_states, (self.q_proj, self.k_proj, self.v_proj))
        q = self.q_norm(q.view(n, b, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(n, b, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(n, b, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, *position_embeddings), rotate(k, *position_embeddings)
        keys = torch.cat([k, *(t if t.dtype == k.dtype else t.to(k.dtype) for t in context_keys)], dim=2)
        values = torch.cat([v, *(t if t.dtype == v.dtype else t.to(v.dtype) for t in context_values)], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=key_mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(n, b, -1))


class LongSparkMLP(Qwen3MLP):
    """Qwen3's gated MLP, `down(act(gate(x)) * up(x))`, whose gate and up projections run as one product on the fast
    path (`fused_linears`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fused_linears(x, (self.gate_proj, self.up_proj))
        return self.down_proj(self.act_fn(gate) * up)


class LongSparkDecoderLayer(nn.Module):
    """Pre-norm Qwen3-style block: `h += attn(norm(h))`, `h += mlp(norm(h))`."""

    def __init__(self, config: LongSparkConfig):
        super().__init__()
        self.input_layernorm = LongSparkRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LongSparkAttention(config)
        self.post_attention_layernorm = LongSparkRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LongSparkMLP(config)

    def forward(self, hidden_states, position_embeddings, context_keys, context_values, key_mask) -> torch.Tensor:
        attn = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, context_keys, context_values, key_mask
        )
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LongSparkPreTrainedModel(PreTrainedModel):
    config: LongSparkConfig
    config_class = LongSparkConfig
    base_model_prefix = "longspark"
    main_input_name = "block_ids"
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, LongSparkDrafterModel):
            # The paper's Section 2.4: summary queries U ~ N(0, 1/d); the Markov correction starts neutral.
            init.normal_(module.summary_queries, mean=0.0, std=self.config.head_dim**-0.5)
            init.zeros_(module.markov_proj.weight)


class LongSparkDrafterModel(DraftVocabularyMixin, LongSparkPreTrainedModel):
    """The LongSpark drafter. Pass it as `assistant_model` to `target.generate`, once LongSpark is registered with
    transformers (`transformers_longspark.register()`, run by the first use of any name of the package).

    It owns only its own weights; the target's embedding, final norm, LM head and RoPE are bound at run time by
    `bind_target` (the generation hook and the trainer do this).
    """

    def __init__(self, config: LongSparkConfig):
        super().__init__(config)
        d, h = config.num_draft_layers, config.hidden_size
        self.block_positions = nn.Embedding(config.block_size, h)
        self.fuse_boundary = nn.Linear(d * h, h, bias=False)
        self.boundary_norm = LongSparkRMSNorm(h, eps=config.rms_norm_eps)
        self.project_inputs = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([LongSparkDecoderLayer(config) for _ in range(d)])
        self.summary_queries = nn.Parameter(
            torch.empty(d, config.num_key_value_heads, config.num_summary_queries, config.head_dim)
        )
        self.markov_embed = nn.Embedding(config.vocab_size, config.markov_rank)
        self.markov_proj = nn.Linear(config.markov_rank, config.output_vocab_size, bias=False)
        if config.draft_vocab_size is not None:
            # Saved with the weights; filled by `with_draft_vocab` or `set_draft_vocab`.
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size))
        self._target: TargetModules | None = None
        # The LM head over the drafter's output vocabulary (`output_head`), and what it was built from (held, so that
        # their ids stay theirs). Kept in `__dict__`: not a submodule, never saved.
        self.__dict__["_output_head"] = None
        self._output_head_key: tuple | None = None
        self._output_head_sources: tuple = ()
        self.drafting_stats = None  # a `DraftingStats`, set by each assisted `generate` call
        # Verify with the grouped-head attention and reserved cache rows of `verification.py`; False keeps the target's
        # own attention and cache (the stock path, for comparison).
        self.fast_verification = True
        # On that path, run the target's CPU linear layers and the output head from packed weights (`packed_linear.py`);
        # False keeps `F.linear` (the path before them, for comparison).
        self.packed_weights = True
        # On that path, run the target's decoder layers without their per-module Python (`inference/lean_layers.py`,
        # bit-identical outputs); False keeps their stock forward (for comparison).
        self.lean_layers = True
        # The dtype of the drafter's linear layers and output head on that path: "auto" runs them in dynamic int8 on x86
        # CPUs, else in bfloat16 where the CPU has native bf16 kernels, else in the drafter's dtype
        # (`packed_linear.fast_dtype`); or torch.float32 / torch.bfloat16 / torch.int8 / torch.qint8. Exactness does
        # not depend on it (the verifier reads the law the drafter produced).
        self.linear_dtype: torch.dtype | str = "auto"
        # The drafting knobs (confidence cuts, lookup source, cost model or its calibration), read by the generate hook
        # as transformers reads an assistant's; typed, documented and validated in `inference/knobs.py`
        # (`DraftingKnobs`). Saved with the weights.
        self.generation_config = GenerationConfig(assistant_confidence_threshold=DEFAULT_CONFIDENCE_THRESHOLD)
        self.post_init()

    def bind_target(self, target: PreTrainedModel | TargetModules) -> None:
        """Uses `target`'s embedding, final norm, LM head and rotary embedding (frozen, not stored). A serving engine
        whose target is not a transformers model passes those modules as `TargetModules` (see `vllm/`)."""
        self._target = target if isinstance(target, TargetModules) else target_modules(target)
        self._bind_output_head()

    @property
    def output_head(self) -> nn.Linear:
        """The target's LM head over the drafter's output vocabulary (`output_vocab_size` rows, frozen): the rows of
        its draft vocabulary, or the target's whole head. Set by `bind_target`."""
        if self._output_head is None:
            self.target  # noqa: B018 (raises the error that says how to bind one)
        return self._output_head

    def _bind_output_head(self) -> None:
        lm_head = self._target.lm_head
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        sources = (weight, bias, self.draft_vocab if self.config.draft_vocab_size is not None else None)
        key = _contents_key(sources)
        # Kept while the LM head and the draft vocabulary are unchanged: gathering the rows (and packing them for the
        # fast path) costs more than a drafter round, so not once per `generate` call.
        if self._output_head is not None and key is not None and self._output_head_key == key:
            return
        if self.config.draft_vocab_size is not None:
            rows = self.draft_vocab.to(weight.device)
            weight, bias = weight.detach()[rows], None if bias is None else bias.detach()[rows]  # frozen copies
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        head.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            head.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
        self.__dict__["_output_head"] = head
        self._output_head_key, self._output_head_sources = key, sources

    @property
    def target(self) -> TargetModules:
        if self._target is None:
            raise ValueError(
                "The drafter is not bound to a target. Pass it as `assistant_model=` to `target.generate(...)` after "
                "`import transformers_longspark`, or call `drafter.bind_target(target)`."
            )
        return self._target

    def markov_correction(self, previous_ids: torch.LongTensor) -> torch.Tensor:
        """`W_c(e_c(prev))`: `(..., output_vocab_size)` logit correction given the previous token ids `(...)`."""
        return self.markov_proj(self.markov_embed(previous_ids))

    def forward(
        self,
        block_ids: torch.LongTensor,
        context: DraftContext,
        previous_ids: torch.LongTensor | None = None,
    ) -> LongSparkDrafterOutput:
        """
        Args:
            block_ids: `(N, B)` slot tokens `[a, MASK, ..., MASK]`.
            context: the boundary states, recent windows and summaries of the `N` requests/anchors.
            previous_ids: `(N, B)` token preceding each draft token (`[a, y_1, ..., y_{B-1}]`). Given in training
                (teacher forcing); at inference the candidate generator applies the correction token by token.
        """
        config, target = self.config, self.target
        n, b = block_ids.shape
        hidden = target.embed_tokens(block_ids).to(self.dtype) + self.block_positions.weight[:b]
        boundary = context.boundary_states.to(self.dtype)
        if not config.use_boundary_state:
            boundary = torch.zeros_like(boundary)
        boundary = self.boundary_norm(self.fuse_boundary(boundary))
        hidden = self.project_inputs(torch.cat([hidden, boundary[:, None].expand(n, b, -1)], dim=-1))

        positions = context.positions[:, None] + torch.arange(b, device=block_ids.device)
        position_embeddings = rotary_factors(*target.rotary_emb(hidden, positions))
        key_mask = self._key_mask(context, n, b)
        summary_keys = self.summary_queries[None].expand(n, -1, -1, -1, -1)  # (N, D, kv_heads, m, head_dim)
        if config.summary_key_positions == "block_start":
            # U rotated at the block's first position t: q_{t+i} . R_t U depends on the offset i alone.
            cos, signed_sin = (e[:, None, :, :1] for e in position_embeddings)  # (N, 1, 1, 1, head_dim)
            summary_keys = rotate(summary_keys, cos, signed_sin)
        for j, layer in enumerate(self.layers):
            keys, values = [], []
            if context.window_keys:
                keys.append(context.window_keys[j])
                values.append(context.window_values[j])
            if context.summary_values:
                keys.append(summary_keys[:, j])
                values.append(context.summary_values[j])
            hidden = layer(hidden, position_embeddings, keys, values, key_mask)

        head = self.output_head
        features = target.norm(hidden)
        base_logits = head(features.to(head.weight.dtype)).float()
        logits = base_logits if previous_ids is None else base_logits + self.markov_correction(previous_ids).float()
        return LongSparkDrafterOutput(logits=logits, base_logits=base_logits, hidden_states=features)

    def _key_mask(self, context: DraftContext, n: int, b: int) -> torch.Tensor | None:
        if context.window_mask is None or not context.window_keys:
            return None
        ones = context.window_mask.new_ones
        summary = ones(n, self.config.num_summary_queries if context.summary_values else 0)
        return torch.cat([ones(n, b), context.window_mask, summary], dim=1)[:, None, None, :]

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        """Saves the weights and config, and the drafting settings in `generation_config.json`."""
        super().save_pretrained(save_directory, *args, **kwargs)
        self.generation_config.save_pretrained(save_directory)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args, **kwargs):
        """Loads a drafter from safetensors only, and raises `ValueError` on missing or unexpected tensors."""
        path = Path(pretrained_model_name_or_path)
        if path.is_dir() and not any(path.glob("*.safetensors")):
            found = sorted(p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".pkl", ".ckpt"})
            raise ValueError(
                f"{path} holds no safetensors weights{f' (found {found})' if found else ''}. LongSpark never "
                "unpickles checkpoints; convert them with `safetensors.torch.save_file` or `save_pretrained`."
            )
        kwargs["use_safetensors"] = True
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        problems = {k: sorted(info.get(k) or []) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        problems = {k: v for k, v in problems.items() if v}
        if problems:
            details = "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in problems.items())
            raise ValueError(
                f"The checkpoint at {pretrained_model_name_or_path} does not match LongSparkDrafterModel ({details}). "
                "Save drafters with `save_pretrained`, which writes exactly the drafter's own tensors."
            )
        with contextlib.suppress(OSError):  # saved before drafters kept a generation config: the defaults apply
            model.generation_config = GenerationConfig.from_pretrained(pretrained_model_name_or_path)
        return model


__all__ = ["LongSparkDrafterModel", "LongSparkPreTrainedModel", "LongSparkDrafterOutput"]
