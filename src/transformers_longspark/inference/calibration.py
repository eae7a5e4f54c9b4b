"""The cost model measured where the drafter runs: `calibrate`, and `calibrated_costs` with its cache.

The planner (`planning.py`) counts costs in plain decoding steps of the target, and what a round costs in those steps
depends on the machine (a CPU's kernels and memory, a GPU), the target, the dtypes and the thread count, not on the
drafter's weights. So a drafter whose `generation_config` sets `calibrate_costs` does not carry one machine's
constants: at its first `generate` on a new machine and target the costs are measured (~50 s for a small
target: random tokens, the fast verification path, one `DraftSession`) and cached as JSON under
`$LONGSPARK_CACHE/calibration/`, keyed by the CPU (or GPU), torch's CPU capability and thread count, the target's
config and dtype, and the drafter's architecture, dtype and linear dtype (not its weights or where it was saved: the
checkpoints of one training run share one calibration, so that comparing them prices their rounds alike).
`longspark calibrate` measures (or re-measures) ahead of time. A cached file with a nonsensical cost (negative,
non-finite) is measured again, with a warning.

What is measured, interleaved so that a busy machine skews all parts alike, each as the median over `repeats` of
its ratio to the one-token step of the same repeat (`_paired_ratio`):
- first, which kernel runs the target's linear layers at a few rows (`blas_max_rows`,
  `packed_linear.measure_blas_max_rows`), and whether the packed kernel beats `F.linear` at a prefill's rows too
  (`max_packed_rows`, `packed_linear.measure_max_packed_rows`): the fast path then takes both, in the forwards below
  and in `generate`;
- `step`: a one-token forward of the target at a short prefix (`SHORT_PREFIX`);
- a drafter round (boundary states, context read with the summary update, planning, the drafter forward and its
  token loop) -> `draft_round_cost = round / step`;
- forwards of `1 + k` tokens for `k` in `VERIFY_TOKENS` and of `BATCH_ROWS` tokens -> `forward_costs`, `forward /
  step` at every measured row count (each at least the one before it: `_nondecreasing`), which prices a
  verification (`RoundCosts.verify_cost`, and a batch's: `RoundCosts.batch_verify_cost`), and the least squares line
  through `forward / step - 1` of `VERIFY_TOKENS` -> `verify_round_cost + verify_token_cost * k`, the drafter
  config's own fields, as a record;
- a drafter round over `DRAFT_BATCH` requests of a batched cache -> `draft_batch_costs`, so that a batch prices its
  drafter round as measured (its context reads and drafter forward grow with the rows, not as the target step does);
- a one-token forward at `LONG_PREFIX` right after each short step (a second cache) -> `step_doubling_length`, the
  prefix over which the step's cost grows by one step (0 where it does not grow measurably), and forwards of
  `LONG_FORWARD_ROWS` tokens there -> `long_forward_costs`, in steps at that prefix: each verified row attends over
  the whole prefix, so that a few rows cost more steps at a long prefix than at a short one
  (`RoundCosts.forward_cost` reads between and beyond the two).

Paired medians, not the minima of separate loops: the minima put the growth of the step anywhere in a 4x range between
calibrations on one busy VM, and a calibration taken beside another process priced a 2-token forward at 0.95 steps
where `generate` on the idle machine ran it at 1.08, so that drafts kept 1 time in 10 looked worth verifying.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from ..files import cache_root
from ..modeling_longspark import LongSparkDrafterModel
from ..packed_linear import (
    MAX_PACKED_ROWS,
    drafter_linear_dtype,
    measure_blas_max_rows,
    measure_max_packed_rows,
    packed_drafter_weights,
)
from .drafting import DraftRequests, DraftSettings
from .knobs import DraftingKnobs, check_costs
from .planning import Source
from .round_costs import RoundCosts
from .session import DraftSession
from .verification import fast_verification, reserve_cache_rows

logger = logging.getLogger("transformers_longspark")

CALIBRATION_VERSION = 10  # 10: forwards with fused projections (cheaper at 2+ rows); 9: paired medians, forwards at 4K
SHORT_PREFIX = 128
LONG_PREFIX = 4096
VERIFY_TOKENS = (1, 2, 3, 4, 5, 7, 10)
BATCH_ROWS = (16, 32, 64)
LONG_FORWARD_ROWS = (2, 4, 8, 16)
DRAFT_BATCH = 8
REPEATS = 9
# Growth of the step below this fraction between the two prefixes is noise: the step is taken as flat.
MIN_STEP_GROWTH = 0.05

_calibrated: dict[str, Calibration] = {}  # this process's calibrations, by key digest


@dataclass(frozen=True)
class Calibration:
    """The measured costs (`costs`, in target steps), the most rows at which the target's linear layers run faster on
    `F.linear` than packed (`blas_max_rows`), the times the costs come from (milliseconds) and what they are for
    (`key`: machine, target, dtypes)."""

    costs: RoundCosts
    blas_max_rows: int
    max_packed_rows: int
    step_ms: float
    long_step_ms: float
    draft_round_ms: float
    forward_ms: dict[int, float]
    long_forward_ms: dict[int, float]
    batch_draft_round_ms: dict[int, float]
    key: dict[str, Any]

    @property
    def fast_path_rows(self) -> dict[str, int]:
        """The measured kernel choice, as `fast_verification`'s keyword arguments."""
        return {"blas_max_rows": self.blas_max_rows, "max_packed_rows": self.max_packed_rows}

    def to_json(self) -> dict[str, Any]:
        return {"version": CALIBRATION_VERSION, **asdict(self), "costs": asdict(self.costs)}


# What `save_pretrained` adds to a drafter's config (the saved dtype, the class, the version that wrote it): not what a
# round costs, so that a checkpoint costs what the drafter it was saved from costs.
SAVE_FIELDS = ("dtype", "architectures", "transformers_version")


def calibration_key(target: PreTrainedModel, drafter: LongSparkDrafterModel) -> dict[str, Any]:
    """What a round's cost in target steps depends on: the machine, the thread count, the target and the dtypes."""
    device = target.device
    machine = _cpu_name() if device.type == "cpu" else torch.cuda.get_device_name(device)
    config, drafter_config = (model.config.to_json_string(use_diff=False) for model in (target, drafter))
    return {
        "version": CALIBRATION_VERSION,
        "machine": machine,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "device": device.type,
        "torch": torch.__version__,
        "target": getattr(target.config, "model_type", type(target).__name__),
        "target_config": hashlib.sha256(_without_paths(config).encode()).hexdigest()[:16],
        "target_dtype": str(target.dtype),
        "drafter_config": hashlib.sha256(_without_paths(drafter_config, *SAVE_FIELDS).encode()).hexdigest()[:16],
        "drafter_dtype": str(drafter.dtype),
        "drafter_linear_dtype": str(drafter_linear_dtype(drafter)),
        "lean_layers": bool(drafter.lean_layers),
    }


def calibration_path(key: dict[str, Any]) -> Path:
    """Where the calibration of `key` is cached."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "calibration" / f"{digest}.json"


def calibration_for_generate(target: PreTrainedModel, drafter: LongSparkDrafterModel) -> Calibration | None:
    """The calibration where the drafter's `generation_config` sets `calibrate_costs` (`calibrated`), else `None`
    (its own cost fields apply, and the fast path packs every few-row forward)."""
    if not DraftingKnobs.from_generation_config(drafter.generation_config).calibrate_costs:
        return None
    return calibrated(target, drafter)


def calibrated(target: PreTrainedModel, drafter: LongSparkDrafterModel) -> Calibration:
    """The calibration of `drafter`'s rounds with `target` on this machine: from this process, from the cache, or
    measured now and cached (`calibrate_and_cache` measures again)."""
    path = calibration_path(calibration_key(target, drafter))
    if path.name in _calibrated:
        return _calibrated[path.name]
    calibration = _read_cached(path)
    if calibration is None:
        logger.warning(
            "LongSpark: measuring the round costs of this drafter with this target on this machine (once, ~50 s "
            "on a 2-core CPU; cached in %s; `longspark calibrate` re-measures).",
            path,
        )
        calibration = calibrate_and_cache(target, drafter)[0]
    _calibrated[path.name] = calibration
    return calibration


def calibrate_and_cache(target: PreTrainedModel, drafter: LongSparkDrafterModel) -> tuple[Calibration, Path]:
    """Measures the costs now (`calibrate`) and caches them for later calls and processes; returns them and where."""
    calibration = calibrate(target, drafter)
    path = calibration_path(calibration.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(calibration.to_json(), indent=2) + "\n", encoding="utf-8")
    temporary.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    _calibrated[path.name] = calibration
    return calibration, path


def _read_cached(path: Path) -> Calibration | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        data.pop("version")
        costs = check_costs(RoundCosts(**data.pop("costs")), f"The calibration in {path}")
        if type(data["blas_max_rows"]) is not int or data["blas_max_rows"] < 0:
            raise ValueError(f"blas_max_rows must be a whole number of rows >= 0, got {data['blas_max_rows']!r}")
        if type(data["max_packed_rows"]) is not int or data["max_packed_rows"] < MAX_PACKED_ROWS:
            raise ValueError(f"max_packed_rows must be a whole number of rows >= {MAX_PACKED_ROWS}, got "
                             f"{data['max_packed_rows']!r}")  # fmt: skip
        # JSON keys are strings: the row and batch counts back to ints.
        for name in ("forward_ms", "long_forward_ms", "batch_draft_round_ms"):
            data[name] = {int(rows): ms for rows, ms in data[name].items()}
        return Calibration(costs=costs, **data)
    except (ValueError, KeyError, TypeError) as error:
        logger.warning("LongSpark: ignoring the calibration in %s (%s); measuring again.", path, error)
        return None


@torch.no_grad()
def calibrate(target: PreTrainedModel, drafter: LongSparkDrafterModel, repeats: int = REPEATS) -> Calibration:
    """Measures the cost model of `drafter` with `target` on this machine (see the module docstring). Uses its own
    cache, random tokens from its own generator and argmax drafts, so the global RNG and any running call are
    untouched."""
    device = target.device
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    max_positions = getattr(target.config.get_text_config(), "max_position_embeddings", LONG_PREFIX + 64)
    long_prefix = max(SHORT_PREFIX + 64, min(LONG_PREFIX, max_positions - 64))
    # Every round drafts, whatever this call's own settings (a call may have the drafter or lookup off).
    settings = replace(DraftSettings.from_drafter(drafter), lookup_min_match=0, use_drafter=True, costs=RoundCosts())
    prompt = torch.randint(vocab, (1, SHORT_PREFIX), generator=generator).to(device)
    forward_rows = sorted({1 + k for k in VERIFY_TOKENS} | set(BATCH_ROWS))
    steps, long_steps, rounds, forwards = [], [], [], {n: [] for n in forward_rows}
    long_forwards = {n: [] for n in LONG_FORWARD_ROWS}
    session = DraftSession(drafter, target, settings)
    cache = DynamicCache(config=target.config)
    rows = SHORT_PREFIX + repeats + 2 + max(forward_rows)
    on_cpu = device.type == "cpu"
    blas_max_rows = measure_blas_max_rows(target) if on_cpu else 1
    max_packed_rows = measure_max_packed_rows(target) if on_cpu else MAX_PACKED_ROWS
    fast_path = partial(
        fast_verification,
        target,
        blas_max_rows=blas_max_rows,
        max_packed_rows=max_packed_rows,
        lean_layers=drafter.lean_layers,
    )
    try:
        with fast_path(cache, rows), packed_drafter_weights(drafter):
            target(prompt, cache=cache, use_cache=True, logits_to_keep=1)
            long_cache = _prefilled_cache(target, vocab, long_prefix, max(LONG_FORWARD_ROWS), generator)
            state, planner, ids = session.new_state(), session.new_planner(), prompt
            for _ in range(repeats + 1):  # the first of each is a warm-up
                token = torch.randint(vocab, (1, 1), generator=generator).to(device)
                ids = torch.cat([ids, token], dim=1)
                steps.append(_timed(device, target, token, cache=cache, use_cache=True, logits_to_keep=1))
                long_steps.append(_timed(device, target, token, cache=long_cache, use_cache=True, logits_to_keep=1))
                long_cache.crop(-1)
                for n in LONG_FORWARD_ROWS:
                    block = torch.randint(vocab, (1, n), generator=generator).to(device)
                    long_forwards[n].append(_timed(device, target, block, cache=long_cache, use_cache=True))
                    long_cache.crop(-n)
                rounds.append(_timed(device, _drafter_round, session, state, [planner], cache, ids))
                for n in forward_rows:
                    block = torch.randint(vocab, (1, n), generator=generator).to(device)
                    forwards[n].append(_timed(device, target, block, cache=cache, use_cache=True))
                    cache.crop(-n)
        batch_rounds = _batch_drafter_rounds(session, fast_path, target, vocab, DRAFT_BATCH, repeats, generator)
    finally:
        session.close()
    steps = steps[1:]  # the first of each is a warm-up
    step = statistics.median(steps)
    growth = _paired_ratio(long_steps, steps) - 1.0
    forward_costs = dict(zip(forward_rows, _nondecreasing([_paired_ratio(forwards[n], steps) for n in forward_rows])))
    long_costs = _nondecreasing([_paired_ratio(long_forwards[n], long_steps[1:]) for n in LONG_FORWARD_ROWS])
    long_forward_costs = dict(zip(LONG_FORWARD_ROWS, long_costs))
    long_step_ms = (1.0 + growth) * step * 1e3
    batch_draft_round_ms = {DRAFT_BATCH: statistics.median(batch_rounds[1:]) * 1e3}
    round_cost, token_cost = _line([(k, forward_costs[1 + k] - 1.0) for k in VERIFY_TOKENS])
    doubling = round((long_prefix - SHORT_PREFIX) / growth) if growth > MIN_STEP_GROWTH else 0
    costs = RoundCosts(
        draft_round_cost=_paired_ratio(rounds, steps),
        verify_round_cost=max(0.0, round_cost),
        verify_token_cost=max(0.0, token_cost),
        step_doubling_length=int(doubling),
        forward_costs=tuple(forward_costs.items()),
        draft_batch_costs=tuple((n, ms / (step * 1e3)) for n, ms in batch_draft_round_ms.items()),
        long_forward_costs=tuple(long_forward_costs.items()),
        long_prefix_length=long_prefix,
    )
    check_costs(costs, "The measured calibration")
    return Calibration(
        costs=costs,
        blas_max_rows=blas_max_rows,
        max_packed_rows=max_packed_rows,
        step_ms=step * 1e3,
        long_step_ms=long_step_ms,
        draft_round_ms=costs.draft_round_cost * step * 1e3,
        forward_ms={n: cost * step * 1e3 for n, cost in forward_costs.items()},
        long_forward_ms={n: cost * long_step_ms for n, cost in long_forward_costs.items()},
        batch_draft_round_ms=batch_draft_round_ms,
        key=calibration_key(target, drafter),
    )


def _drafter_round(session: DraftSession, state, planners: list, cache, ids: torch.LongTensor) -> None:
    """What a drafter round of `generate` runs for the `n` rows of `ids` `(n, t)` (the cache holds `t` columns, the
    last one the round's anchor's predecessor): the boundary, the context read, the plan and the proposal."""
    n, length = ids.shape
    device = ids.device
    state.boundary_states = session.captured_boundary(torch.full((n,), -1, device=device))
    room = session.settings.max_proposal_tokens
    full = torch.full((n,), length, dtype=torch.long, device=device)
    requests = DraftRequests(torch.cat([ids, ids.new_zeros(n, room)], dim=1), torch.arange(n, device=device), full,
                             full.new_full((n,), room))  # fmt: skip
    mask = None if n == 1 else torch.ones(n, length - 1, dtype=torch.bool, device=device)
    proposal = session.draft_round(requests, planners, lambda: session.read_context(state, cache, length - 1, mask))
    if Source.DRAFTER not in proposal.sources:
        raise RuntimeError(f"The calibration's drafter round did not draft (sources {proposal.sources}).")


def _batch_drafter_rounds(
    session: DraftSession, fast_path, target, vocab: int, batch: int, repeats: int, generator: torch.Generator
) -> list[float]:
    """Drafter rounds over `batch` requests of one batched cache (`SHORT_PREFIX` columns each), a one-token batched
    step before each, as the batched loop runs them (`fast_path(cache, rows)`: the fast verification block)."""
    device = target.device
    cache, state = DynamicCache(config=target.config), session.new_state()
    planners = [session.new_planner() for _ in range(batch)]
    ids = torch.randint(vocab, (batch, SHORT_PREFIX), generator=generator).to(device)
    times = []
    with fast_path(cache, SHORT_PREFIX + repeats + 2):
        target(ids, cache=cache, use_cache=True, logits_to_keep=1)
        for _ in range(repeats + 1):
            token = torch.randint(vocab, (batch, 1), generator=generator).to(device)
            ids = torch.cat([ids, token], dim=1)
            target(token, cache=cache, use_cache=True, logits_to_keep=1)
            times.append(_timed(device, _drafter_round, session, state, planners, cache, ids))
    return times


def _prefilled_cache(target, vocab: int, length: int, rows: int, generator: torch.Generator) -> DynamicCache:
    """A cache of `length` random tokens (prefilled in chunks) with rows reserved for `rows` more, for forwards at
    that prefix inside the caller's fast verification block (each cropped after it)."""
    cache = DynamicCache(config=target.config)
    reserve_cache_rows(cache, length + rows)
    for start in range(0, length, 1024):
        chunk = torch.randint(vocab, (1, min(1024, length - start)), generator=generator).to(target.device)
        target(chunk, cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def _timed(device: torch.device, function, *args, **kwargs) -> float:
    """Seconds that `function(*args, **kwargs)` takes (the GPU synchronised on both sides)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    function(*args, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _paired_ratio(times: list[float], steps: list[float]) -> float:
    """The median over repeats of `times[i] / steps[i]` (the first of `times`, a warm-up, left out): a part timed in
    the same repeat as its step, so that drift and other processes move both alike (the minima of two loops put a
    small difference anywhere on a busy VM)."""
    return statistics.median(t / step for t, step in zip(times[1:], steps, strict=True))


def _nondecreasing(costs: list[float]) -> list[float]:
    """The least-squares nondecreasing fit of `costs`, of forwards of more and more rows (pooling adjacent violators),
    at least one step: a forward of more tokens never costs less, so a dip is noise, which would price a longer
    proposal below a shorter one; one slow repeat of a middle row count is averaged with its neighbours, not carried
    up to every count after it."""
    blocks: list[list[float]] = []  # [sum, count] of runs of equal fitted costs
    for cost in costs:
        blocks.append([cost, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [max(1.0, total / count) for total, count in blocks for _ in range(int(count))]


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares `(intercept, slope)` through `points`."""
    n = len(points)
    mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
    return mean_y - slope * mean_x, slope


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _without_paths(config_json: str, *fields: str) -> str:
    """A config without its `name_or_path`-like fields (the same model at another path costs the same) and `fields`
    (e.g. `SAVE_FIELDS`)."""
    config = json.loads(config_json)
    for name in ("_name_or_path", "name_or_path", *fields):
        config.pop(name, None)
    return json.dumps(config, sort_keys=True)


__all__ = [
    "Calibration",
    "calibrate",
    "calibrate_and_cache",
    "calibrated",
    "calibration_key",
    "calibration_path",
    "calibration_for_generate",
]
