"""Configuration of the LongSpark drafter."""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

# Targets whose decoder layers, KV cache and RoPE the drafter knows how to read (see `targets.py`).
SUPPORTED_TARGET_TYPES = ("llama", "qwen3", "qwen2", "mistral")
# How the summary queries `U` are positioned when they serve as attention keys (see `LongSparkConfig`).
SUMMARY_KEY_POSITIONS = ("none", "block_start")


def select_target_layers(num_target_layers: int, num_selected: int = 5) -> list[int]:
    """Evenly spaced target layers: ``round(j * (N - 1) / (D - 1))`` for ``j = 0..D-1``.

    36 layers -> ``[0, 9, 18, 26, 35]`` (Qwen3-4B/8B); 40 layers -> ``[0, 10, 20, 29, 39]`` (Qwen3-14B).
    """
    if num_selected < 1 or num_selected > num_target_layers:
        raise ValueError(
            f"Cannot select {num_selected} layers from a target with {num_target_layers} layers; "
            f"pass `num_selected_layers` between 1 and {num_target_layers}."
        )
    if num_selected == 1:
        return [num_target_layers - 1]
    # int(x + 0.5) rounds halves up, as the paper's layer lists do (Python's round() rounds halves to even).
    return [int(j * (num_target_layers - 1) / (num_selected - 1) + 0.5) for j in range(num_selected)]


@strict
class LongSparkConfig(PreTrainedConfig):
    r"""
    Configuration of a [`LongSparkDrafterModel`]: a block-diffusion drafter that reads a fixed-size context from its
    target (boundary state, recent KV window and global attention summary of a few selected target layers).

    Build it for a target with [`LongSparkConfig.from_target_config`]; the target-shaped fields (hidden size, heads,
    head dim, vocabulary, RoPE) must equal the target's, which the generation hook checks before generating.

    Args:
        hidden_size, num_attention_heads, num_key_value_heads, head_dim, vocab_size, rope_parameters,
        max_position_embeddings: copied from the target.
        intermediate_size (`int`): SwiGLU width of the draft layers (the target's by default).
        target_model_type (`str`): `model_type` of the target this drafter was built for.
        num_target_layers (`int`): depth of that target.
        target_layer_ids (`list[int]`): selected target layers `S`; draft layer `j` reads layer `S[j]`.
        block_size (`int`): `B`, slots per drafting round (the anchor token plus `B - 1` masks), defaults to 7.
        window_size (`int`): `W`, recent KV rows read from each selected layer, defaults to 256.
        num_summary_queries (`int`): `m`, learned summary queries per selected layer and KV head, defaults to 16.
        markov_rank (`int`): rank `r` of the Markov correction `W_c(e_c(prev))`.
        draft_vocab_size (`int`, *optional*): when set, the drafter proposes only this many target tokens (the
            ids in its `draft_vocab` buffer, the most frequent in its training data) and scores them with the
            matching rows of the target's LM head. This is a cost cut for small targets, where the full-vocabulary
            head is a large share of a round (EAGLE-3 / FR-Spec do the same). Outputs stay lossless: the other
            tokens get draft probability 0, and the verifier still gives them their exact target probability.
            `None` (the paper) uses the whole vocabulary.
        mask_token_id (`int`): token whose target embedding fills the masked slots.
        use_global_summary, use_boundary_state, use_recent_window (`bool`): ablation switches (paper, Table 4).
        full_prefix_context (`bool`): baseline mode that attends to ALL KV rows of the paired target layers instead
            of window + summary (the DFlash/DSpark-style context whose cost grows with the prefix).
        summary_chunk_size (`int`): rows folded into the summary per step at prefill (bounds the `m x T` scores).
        summary_key_positions (`str`): position the summary queries `U` carry as the drafter's attention KEYS.
            `"none"` (default, paper Sec. 2.3): `U` unrotated, so a block query's score `q . U` depends on the block's
            absolute position (its RoPE), unexplored beyond the training lengths. `"block_start"`: `U` rotated by the
            target's RoPE at the block's first position `t`, so `q . U` depends only on the offset within the block.
            Either way the summary VALUES `S_t` are computed with unrotated `U` against the cached keys.
        use_qk_norm (`bool`): RMS-normalise each head's queries and keys (Qwen3-style, the default). A drafter
            warm-started from a target without them (Llama, SmolLM2) turns them off, so that its copied layers
            compute what they computed in the target (`warm_start.init_from_target`).
    """

    model_type = "longspark"

    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    rope_parameters: dict | None = None
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02

    target_model_type: str = "qwen3"
    num_target_layers: int = 36
    target_layer_ids: list[int] | None = None
    block_size: int = 7
    window_size: int = 256
    num_summary_queries: int = 16
    markov_rank: int = 256
    draft_vocab_size: int | None = None
    mask_token_id: int = 0
    use_global_summary: bool = True
    use_boundary_state: bool = True
    use_recent_window: bool = True
    full_prefix_context: bool = False
    summary_chunk_size: int = 2048
    summary_key_positions: str = "none"
    use_qk_norm: bool = True
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.target_layer_ids is None:
            self.target_layer_ids = select_target_layers(self.num_target_layers)
        self._check_fields()
        super().__post_init__(**kwargs)

    def _check_fields(self) -> None:
        for name in ("block_size", "window_size", "num_summary_queries", "markov_rank", "summary_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        if self.summary_key_positions not in SUMMARY_KEY_POSITIONS:
            raise ValueError(
                f"`summary_key_positions` must be one of {SUMMARY_KEY_POSITIONS}, got {self.summary_key_positions!r}."
            )
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"`draft_vocab_size` must be between 1 and vocab_size ({self.vocab_size}), got "
                f"{self.draft_vocab_size}; use None for the full vocabulary."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of "
                f"`num_key_value_heads` ({self.num_key_value_heads})."
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} are beyond the target's depth ({self.num_target_layers} layers); "
                f"use ids in [0, {self.num_target_layers - 1}], e.g. select_target_layers({self.num_target_layers})."
            )

    @property
    def reads_window(self) -> bool:
        """Whether the drafter attends to the recent window (all rows of the prefix with `full_prefix_context`)."""
        return self.use_recent_window or self.full_prefix_context

    @property
    def reads_summary(self) -> bool:
        """Whether the drafter attends to the global summary (never with `full_prefix_context`: it sees every row)."""
        return self.use_global_summary and not self.full_prefix_context

    def window_width(self, num_rows: int) -> int:
        """Window rows `w` before position `num_rows`: `min(W, num_rows)`, or all of them (`full_prefix_context`)."""
        return num_rows if self.full_prefix_context else min(self.window_size, num_rows)

    @property
    def num_draft_layers(self) -> int:
        """`D`: one draft layer per selected target layer."""
        return len(self.target_layer_ids)

    @property
    def output_vocab_size(self) -> int:
        """Number of tokens the drafter scores: `draft_vocab_size` when set, else `vocab_size`."""
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_target_config(cls, target_config: PreTrainedConfig, **overrides: Any) -> LongSparkConfig:
        """Builds the drafter config for `target_config` (a Qwen3, Llama, Qwen2 or Mistral config).

        Copies hidden size, attention and KV heads, head dim, vocabulary size and RoPE parameters (scaling
        included), and selects `num_selected_layers` (default 5) evenly spaced layers. Any field can be
        overridden, e.g. ``window_size=8, num_summary_queries=4`` for tests.
        """
        text_config = target_config.get_text_config()
        model_type = getattr(text_config, "model_type", None)
        if model_type not in SUPPORTED_TARGET_TYPES:
            raise ValueError(
                f"LongSpark does not support targets of type {model_type!r}; supported: {SUPPORTED_TARGET_TYPES}."
            )
        num_layers = text_config.num_hidden_layers
        num_selected = overrides.pop("num_selected_layers", 5)
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        eos = text_config.eos_token_id if text_config.eos_token_id is not None else 0
        fields = dict(
            hidden_size=text_config.hidden_size,
            intermediate_size=text_config.intermediate_size,
            num_attention_heads=text_config.num_attention_heads,
            num_key_value_heads=text_config.num_key_value_heads or text_config.num_attention_heads,
            head_dim=head_dim,
            vocab_size=text_config.vocab_size,
            rms_norm_eps=getattr(text_config, "rms_norm_eps", 1e-6),
            rope_parameters=dict(text_config.rope_parameters),
            max_position_embeddings=text_config.max_position_embeddings,
            target_model_type=model_type,
            num_target_layers=num_layers,
            target_layer_ids=select_target_layers(num_layers, min(num_selected, num_layers)),
            mask_token_id=getattr(text_config, "pad_token_id", None) or (eos[0] if isinstance(eos, list) else eos),
            bos_token_id=text_config.bos_token_id,
            eos_token_id=text_config.eos_token_id,
        )
        fields.update(overrides)
        return cls(**fields)


__all__ = ["SUMMARY_KEY_POSITIONS", "SUPPORTED_TARGET_TYPES", "LongSparkConfig", "select_target_layers"]
