"""A distillation run (the paper's Section 2.4 and Appendix B.2): its config, the drafter it trains, the optimiser
and its cosine schedule, data order, checkpoints, evaluation and logs. What one training example is and how its loss
is computed is in `distillation.py`.

Runs on one CPU as it is, and on many GPUs under `accelerate launch` (DDP; for FSDP see docs/training.md).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from .. import register
from ..configuration_longspark import LongSparkConfig
from ..files import check_fields, check_types, looks_like_hub_id, read_yaml, require_path
from ..inference.stats import tau
from ..loading import load_target
from ..modeling_longspark import LongSparkDrafterModel
from ..targets import check_target_compatible
from .corpora import DataMixture, data_sources
from .data import Sequence, regenerate_hint
from .distillation import CE_WEIGHT, DIVERGENCES, POSITION_DECAY, sample_anchors, sequence_loss
from .prompt_sources import interleave
from .warm_start import init_from_target, select_target_layers, warm_start_config, widen_mlp

MIXED_PRECISIONS = ("auto", "no", "bf16", "fp16")  # accelerate's, and "auto": bf16 autocast on a GPU, else fp32

logger = logging.getLogger(__name__)


@dataclass
class TrainingConfig:
    """A training run; `longspark train --config FILE` reads these fields from YAML or JSON."""

    output_dir: str
    train_data: str | list[Any]  # a path, or a list of data sources: {path, weight, format, ...} (corpora.DataSource)
    eval_data: str | list[Any] | None = None
    target: str = "smollm2"  # a local model folder, or "smollm2" for the offline demo target
    drafter: dict[str, Any] = field(default_factory=dict)  # LongSparkConfig overrides, ablation switches included
    init_drafter: str | None = None  # start from a saved drafter instead of a fresh one
    init_from_target: bool = False  # a fresh drafter starts as a copy of its target's selected layers (warm_start.py)
    max_seq_len: int = 4096
    anchors_per_sequence: int = 512
    sequences_per_step: int = 1
    gradient_accumulation_steps: int = 64
    learning_rate: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    epochs: int = 10
    max_steps: int | None = None  # overrides epochs when set
    ce_weight: float = CE_WEIGHT  # lam in the loss
    position_decay: float = POSITION_DECAY  # w_i = exp(-(i - 1) / position_decay)
    divergence: str = "l1"  # the loss's distance between p_i and q_i: "l1" (the paper's) or "kl" (forward KL)
    feature_weight: float = 0.0  # weight of EAGLE's feature regression on the target's final features (0: the paper)
    window_dropout: float = 0.0  # fraction of anchors trained without their recent window (summary + boundary only)
    checkpoint_every: int = 100
    eval_every: int = 100
    eval_sequences: int = 16
    tau_prompts: int = 4
    tau_new_tokens: int = 96
    seed: int = 0
    num_threads: int | None = None
    mixed_precision: str = "auto"  # "auto": bf16 autocast on GPU, fp32 on CPU (MIXED_PRECISIONS)

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> TrainingConfig:
        """The config in a YAML/JSON file; `overrides` that are not None replace its fields."""
        path = require_path(path, "Training config", "pass a YAML/JSON file such as configs/smollm2-135m-cpu.yaml.")
        values = read_yaml(path, "Training config") or {}
        if not isinstance(values, dict):
            raise ValueError(f"Training config {path} must map field names to values (`output_dir: runs/x`).")
        values.update({k: v for k, v in overrides.items() if v is not None})
        check_fields(cls, values, f"training config {path}")
        check_types(cls, values, f"training config {path}")
        return cls(**values)

    def __post_init__(self):
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}: \"l1\" is the "
                             "paper's loss, \"kl\" the forward KL divergence.")  # fmt: skip
        if self.feature_weight < 0:
            raise ValueError(f"feature_weight must be >= 0, got {self.feature_weight}: it weighs the feature "
                             "regression added to the loss (0 turns it off).")  # fmt: skip
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(f"mixed_precision must be one of {MIXED_PRECISIONS}, got {self.mixed_precision!r}: "
                             "\"no\" trains in fp32, \"bf16\" under bf16 autocast.")  # fmt: skip
        if not 0.0 <= self.window_dropout < 1.0:
            raise ValueError(f"window_dropout must lie in [0, 1), got {self.window_dropout}: it is the fraction of "
                             "anchors trained without their recent window.")  # fmt: skip

    def check_paths(self) -> None:
        """Raises `FileNotFoundError` with the fix when the training data or a local `init_drafter` is missing, so
        that `longspark train` stops before it loads the target."""
        for data in (self.train_data, self.eval_data):
            for source in data_sources(data) if data is not None else []:
                if source.format != "dataset":
                    require_path(source.path, "Training data", regenerate_hint(source.path))
        if self.init_drafter and not looks_like_hub_id(self.init_drafter):
            require_path(self.init_drafter, "init_drafter", "point it at a drafter folder saved by `longspark train`.")


# --- the run ----------------------------------------------------------------------------------------------------


def most_frequent_tokens(
    sequences: list[Sequence], size: int, vocab_size: int, always: list[int] = ()
) -> torch.LongTensor:
    """The `size` token ids most frequent in `sequences` (ties and unseen slots go to the lowest ids, which BPE
    vocabularies give their most frequent merges), always including the ids in `always` (e.g. EOS)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for sequence in sequences:
        counts += torch.bincount(sequence.ids, minlength=vocab_size)[:vocab_size].double()
    counts[torch.as_tensor(list(always), dtype=torch.long)] = float("inf")
    # A tiny decreasing tie-break makes the order deterministic: higher count first, then lower id.
    order = torch.argsort(counts - torch.arange(vocab_size, dtype=torch.float64) / vocab_size, descending=True)
    return order[:size].sort().values


def build_drafter(config: TrainingConfig, target, sequences: list[Sequence]) -> LongSparkDrafterModel:
    """A fresh drafter, or `init_drafter`; when the config sets `drafter.draft_vocab_size`, restricted to the tokens
    most frequent in `sequences` (a drafter with a smaller draft vocabulary keeps its tokens and gains the others)."""
    size = config.drafter.get("draft_vocab_size")
    overrides = {k: v for k, v in config.drafter.items() if k != "draft_vocab_size"}
    if config.init_drafter:
        # Overrides that keep the weights' shapes (e.g. `summary_key_positions`) apply to the loaded drafter too;
        # `target_layer_ids` a subset of its layers selects those (a shallower drafter from a trained one), and a
        # wider `intermediate_size` widens its MLPs with the target's neurons (the same function at the start).
        layer_ids = overrides.pop("target_layer_ids", None)
        width = overrides.pop("intermediate_size", None)
        drafter = LongSparkDrafterModel.from_pretrained(config.init_drafter, dtype=torch.float32, **overrides)
        if layer_ids is not None and list(layer_ids) != list(drafter.config.target_layer_ids):
            drafter = select_target_layers(drafter, layer_ids)
        if width is not None and width != drafter.config.intermediate_size:
            drafter = widen_mlp(drafter, width, target)
        drafter.config._check_fields()
    elif config.init_from_target:
        drafter = init_from_target(LongSparkDrafterModel(warm_start_config(target, **overrides)), target)
    else:
        drafter = LongSparkDrafterModel(LongSparkConfig.from_target_config(target.config, **overrides))
    current = drafter.config.draft_vocab_size
    if size is not None and size != current:
        if current is not None and size < current:
            raise ValueError(
                f"init_drafter has a draft vocabulary of {current} tokens, more than the {size} the "
                f"config asks for; it can only grow. Remove `draft_vocab_size` to keep it."
            )
        # A new vocabulary, or a grown one: the drafter's tokens stay, the most frequent others of the data join.
        eos = target.generation_config.eos_token_id if target.generation_config is not None else None
        always = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        always += drafter.draft_vocab.tolist() if current is not None else []
        drafter = drafter.with_draft_vocab(most_frequent_tokens(sequences, size, drafter.config.vocab_size, always))
    check_target_compatible(drafter.config, target)
    drafter.bind_target(target)
    return drafter


def cosine_schedule(optimizer, total_steps: int, warmup_ratio: float, num_processes: int = 1):
    """Linear warm-up then cosine decay over `total_steps` optimizer steps. Under accelerate, a prepared scheduler
    advances once per process per optimizer step, so the schedule reads `num_processes` advances as one step: the
    learning rates are those of one process, whatever the number of processes."""
    warmup = max(1, int(total_steps * warmup_ratio))

    def factor(advances: int) -> float:
        step = advances // num_processes
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Trainer:
    """Owns one run: data order, optimisation, checkpoints (`output_dir/checkpoint-STEP`), evaluation and logs."""

    def __init__(self, config: TrainingConfig, target=None, tokenizer=None):
        register()  # tau is measured with generate(assistant_model=drafter)
        self.config = config
        precision = config.mixed_precision
        if precision == "auto":
            precision = "bf16" if torch.cuda.is_available() else "no"
        self.accelerator = Accelerator(
            gradient_accumulation_steps=config.gradient_accumulation_steps, mixed_precision=precision
        )
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        set_seed(config.seed)
        device = self.accelerator.device
        if target is None:
            target_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            target, tokenizer = load_target(config.target, target_dtype, device)
        self.target, self.tokenizer = target, tokenizer
        self.train_data = DataMixture(data_sources(config.train_data), tokenizer, config.max_seq_len)
        self.eval_sequences = []
        if config.eval_data:
            # Round-robin over the eval sources, so that every source is evaluated.
            per_source = DataMixture(data_sources(config.eval_data), tokenizer, config.max_seq_len).sequences
            self.eval_sequences = interleave(*per_source)[: config.eval_sequences]
        drafter = build_drafter(config, target, self.train_sequences)
        optimizer = torch.optim.AdamW(
            drafter.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay, betas=(0.9, 0.95)
        )
        self.total_steps = self._total_steps()
        scheduler = cosine_schedule(optimizer, self.total_steps, config.warmup_ratio, self.accelerator.num_processes)
        self.drafter, self.optimizer, self.scheduler = self.accelerator.prepare(drafter, optimizer, scheduler)
        self.step = 0
        self.tokens_seen = 0  # target tokens of the sequences trained on, all processes
        self.output_dir = Path(config.output_dir)
        self.log_path = self.output_dir / "log.jsonl"
        self.tensorboard = self._tensorboard()

    @property
    def train_sequences(self) -> list[Sequence]:
        return self.train_data.all_sequences

    @property
    def model(self) -> LongSparkDrafterModel:
        return self.accelerator.unwrap_model(self.drafter)

    def _total_steps(self) -> int:
        c = self.config
        if c.max_steps:  # as in transformers' Trainer, max_steps overrides epochs
            return c.max_steps
        per_epoch = len(self.train_data) // (c.sequences_per_step * self.accelerator.num_processes)
        return max(1, per_epoch * c.epochs // c.gradient_accumulation_steps)

    def _tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
        return SummaryWriter(str(self.output_dir / "tensorboard")) if self.accelerator.is_main_process else None

    def _micro_batches(self):
        """This process's micro-batches, endless and deterministic; resumption is exact when the data is unchanged."""
        c, accelerator = self.config, self.accelerator
        return self.train_data.micro_batches(
            c.sequences_per_step, c.seed, accelerator.process_index, accelerator.num_processes
        )

    def train(self, resume: bool = False) -> Path:
        c = self.config
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            self._load_latest_checkpoint()
        micro_batches = self._micro_batches()
        for _ in range(self.step * c.gradient_accumulation_steps):  # skip what the resumed run already consumed
            next(micro_batches)
        progress = tqdm(
            total=self.total_steps,
            initial=self.step,
            disable=not self.accelerator.is_main_process,
            desc="train",
            dynamic_ncols=True,
        )
        self.drafter.train()
        while self.step < self.total_steps:
            started, losses, tokens = time.perf_counter(), [], 0
            for micro_step in range(c.gradient_accumulation_steps):
                with self.accelerator.accumulate(self.drafter), self.accelerator.autocast():
                    sequences = next(micro_batches)
                    tokens += sum(len(s.ids) for s in sequences)
                    loss = sum(
                        self.loss(self.drafter, s, self._anchor_generator(micro_step, j))
                        for j, s in enumerate(sequences)
                    ) / len(sequences)
                    self.accelerator.backward(loss)
                    if self.accelerator.sync_gradients:
                        self.accelerator.clip_grad_norm_(self.drafter.parameters(), c.max_grad_norm)
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad()
                losses.append(loss.detach())
            self.step += 1
            # The mean over the global batch: what one process with all of its sequences would log.
            mean_loss = self.accelerator.reduce(torch.stack(losses).mean(), "mean").item()
            self.tokens_seen += int(
                self.accelerator.reduce(torch.tensor(tokens, device=self.accelerator.device), "sum")
            )
            progress.update(1)
            sequences_seen = (
                self.step * c.gradient_accumulation_steps * c.sequences_per_step * self.accelerator.num_processes
            )
            record = {
                "step": self.step,
                "sequences": sequences_seen,
                "tokens": self.tokens_seen,
                "loss": mean_loss,
                "lr": self.scheduler.get_last_lr()[0],
                "seconds": time.perf_counter() - started,
            }
            record["target_tokens_per_s"] = tokens * self.accelerator.num_processes / record["seconds"]
            progress.set_postfix(loss=f"{record['loss']:.4f}")
            if self.step % c.eval_every == 0 or self.step == self.total_steps:
                record.update(self.evaluate())
            self._log(record)
            if self.step % c.checkpoint_every == 0 or self.step == self.total_steps:
                self.save_checkpoint()
        progress.close()
        final = self.output_dir / "final"
        if self.accelerator.is_main_process:
            self.model.save_pretrained(final)
        return final

    def _anchor_generator(self, micro_step: int, position: int) -> torch.Generator:
        """The anchors' random generator of the sequence at `position` in this process's micro-batch. It depends on
        (seed, step, micro-step, the sequence's place in the global batch) alone, so that a resumed run draws the same
        anchors as an uninterrupted one, and N processes the same as one process with all of their sequences
        (process `p`'s `j`-th sequence is the global batch's `p + N * j`-th, as `DataMixture.micro_batches` shards)."""
        slot = self.accelerator.process_index + self.accelerator.num_processes * position
        return torch.Generator().manual_seed(hash((self.config.seed, self.step, micro_step, slot)) % 2**62)

    def loss(self, drafter, sequence: Sequence, generator: torch.Generator) -> torch.Tensor:
        """The distillation loss of `anchors_per_sequence` anchors of `sequence`, drawn with `generator`."""
        c = self.config
        anchors = sample_anchors(sequence, c.anchors_per_sequence, generator)
        return sequence_loss(
            self.target, drafter, sequence, anchors, ce_weight=c.ce_weight, position_decay=c.position_decay,
            window_dropout=c.window_dropout, generator=generator, divergence=c.divergence,
            feature_weight=c.feature_weight,
        )  # fmt: skip

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss (all response anchors of the first `eval_sequences` sequences) and greedy tau."""
        c, model = self.config, self.model
        model.eval()
        results = {}
        if self.eval_sequences:
            generator = torch.Generator().manual_seed(0)
            losses = [self.loss(model, s, generator) for s in self.eval_sequences]
            results["eval_loss"] = float(sum(losses) / len(losses))
            if c.tau_prompts:
                results["eval_tau"] = self.measure_tau(self.eval_sequences[: c.tau_prompts])
        model.train()
        return results

    def measure_tau(self, sequences: list[Sequence]) -> float:
        """Greedy `generate(assistant_model=drafter)` on the sequences' prompts: `stats.tau` over all of them."""
        new_tokens = rounds = 0
        for s in sequences:
            prompt = s.ids[None, : s.prompt_length].to(self.target.device)
            out = self.target.generate(
                prompt, max_new_tokens=self.config.tau_new_tokens, do_sample=False, assistant_model=self.model
            )
            new_tokens += out.shape[1] - prompt.shape[1]
            rounds += self.model.drafting_stats.rounds
        return tau(new_tokens, rounds, len(sequences)) if rounds else 0.0

    def _log(self, record: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        with self.log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step":
                    self.tensorboard.add_scalar(key, value, self.step)
        logger.info(json.dumps(record))

    def save_checkpoint(self) -> Path:
        path = self.output_dir / f"checkpoint-{self.step:06d}"
        self.accelerator.save_state(str(path))
        if self.accelerator.is_main_process:
            self.model.save_pretrained(path / "drafter")
            state = {"step": self.step, "tokens_seen": self.tokens_seen, "config": asdict(self.config)}
            (path / "trainer_state.json").write_text(json.dumps(state))
        return path

    def _load_latest_checkpoint(self) -> None:
        checkpoints = sorted(self.output_dir.glob("checkpoint-*"))
        if not checkpoints:
            logger.info("No checkpoint in %s: starting from scratch.", self.output_dir)
            return
        latest = checkpoints[-1]
        self.accelerator.load_state(str(latest))
        self.model.bind_target(self.target)  # re-gathers the LM-head rows of the restored draft vocabulary
        state = json.loads((latest / "trainer_state.json").read_text())
        self.step, self.tokens_seen = state["step"], state.get("tokens_seen", 0)
        if self.accelerator.is_main_process and self.log_path.exists():  # the steps after it run (and log) again
            records = self.log_path.read_text().splitlines(keepends=True)
            self.log_path.write_text("".join(r for r in records if json.loads(r).get("step", 0) <= self.step))
        logger.info("Resumed from %s (step %d).", latest, self.step)


def train(config: TrainingConfig, resume: bool = False, target=None, tokenizer=None) -> Path:
    """Trains a drafter; returns the folder of the final `save_pretrained` drafter."""
    return Trainer(config, target, tokenizer).train(resume=resume)


__all__ = ["TrainingConfig", "Trainer", "train"]
