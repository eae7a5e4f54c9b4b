"""The drafting knobs of a drafter's `generation_config`: one typed, validated home (`DraftingKnobs`).

`DraftSettings` (what a round follows) and the planner's cost model read the knobs from here, once per call, and a
bad value is refused before any forward with a message that names the field and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from .round_costs import RoundCosts

# The cost model's fields, in plain decoding steps of the target (`round_costs.py`).
COST_FIELDS = ("draft_round_cost", "verify_round_cost", "verify_token_cost", "step_doubling_length")


@dataclass(frozen=True)
class DraftingKnobs:
    """The drafting fields of a drafter's `generation_config` (unset fields take these defaults).

    Attributes:
        assistant_confidence_threshold: in [0, 1]; a block ends before the first drafted token (after the first)
            whose draft probability is below it (0: whole blocks).
        block_confidence_threshold: in [0, 1]; a block ends where the product of its draft probabilities falls below
            it (0: off).
        lookup_min_match: shortest matched suffix that makes the lookup source propose (0: lookup off).
        lookup_num_tokens: the most tokens of a lookup continuation (unset: the block size).
        lookup_choose_length: propose the prefix of a continuation worth most, not all of it.
        lookup_first: a lookup continuation worth more than a plain step is proposed without weighing the drafter
            (False: the two compete on their estimated tokens per step).
        use_drafter: the drafter's blocks are a source (False: lookup and plain steps only).
        calibrate_costs: the cost model comes from a calibration of this machine and target
            (`calibration.py`, measured at the first `generate` and cached), not from the four cost fields; a cost
            field set as well is kept in place of its measurement (`pinned_costs`).
        draft_round_cost / verify_round_cost / verify_token_cost: >= 0, in target steps; step_doubling_length: >= 0
            tokens (0: the step's cost does not grow). All 0 (the default): every round proposes.
    """

    assistant_confidence_threshold: float = 0.0
    block_confidence_threshold: float = 0.0
    lookup_min_match: int = 0
    lookup_num_tokens: int | None = None
    lookup_choose_length: bool = True
    lookup_first: bool = True
    use_drafter: bool = True
    calibrate_costs: bool = False
    draft_round_cost: float = 0.0
    verify_round_cost: float = 0.0
    verify_token_cost: float = 0.0
    step_doubling_length: int = 0

    def __post_init__(self):
        for name in ("assistant_confidence_threshold", "block_confidence_threshold"):
            _check_number(name, getattr(self, name), low=0.0, high=1.0)
        for name in ("draft_round_cost", "verify_round_cost", "verify_token_cost"):
            _check_number(name, getattr(self, name), low=0.0)
        _check_integer("lookup_min_match", self.lookup_min_match, low=0)
        _check_integer("step_doubling_length", self.step_doubling_length, low=0)
        if self.lookup_num_tokens is not None:
            _check_integer("lookup_num_tokens", self.lookup_num_tokens, low=1)
        for name in ("lookup_choose_length", "lookup_first", "use_drafter", "calibrate_costs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{_where(name)} must be true or false, got {getattr(self, name)!r}.")

    @classmethod
    def from_generation_config(cls, config: Any) -> DraftingKnobs:
        """The knobs set on `config` (a `GenerationConfig`); `None` (unset) takes the default."""
        values = {}
        for field in fields(cls):
            value = getattr(config, field.name, None)
            if value is not None:
                values[field.name] = value
        return cls(**values)

    @property
    def costs(self) -> RoundCosts:
        """The cost model of the four cost fields (a calibrated one replaces it where `calibrate_costs` is set)."""
        return RoundCosts(*(getattr(self, name) for name in COST_FIELDS))


def pinned_costs(costs: RoundCosts, generation_config: Any) -> RoundCosts:
    """`costs` (a calibration's) with each cost field that `generation_config` sets in place of its measurement: e.g.
    `draft_round_cost=0` makes the drafter never priced out of a round while the verification keeps its measured
    price, so the planner still chooses how many drafts to verify. A pinned drafter cost drops the measured batch
    points, and a pinned verification cost the measured curves of `forward_costs` (else the pin would be ignored)."""
    pinned = {name: getattr(generation_config, name, None) for name in COST_FIELDS}
    pinned = {name: value for name, value in pinned.items() if value is not None}
    if not pinned:
        return costs
    DraftingKnobs(**pinned)  # validated as any knob
    if "draft_round_cost" in pinned:
        pinned["draft_batch_costs"] = ()
    if {"verify_round_cost", "verify_token_cost"} & set(pinned):
        pinned["forward_costs"] = pinned["long_forward_costs"] = ()
    return replace(costs, **pinned)


def check_costs(costs: RoundCosts, source: str) -> RoundCosts:
    """Returns `costs` if every field is finite and >= 0 (`step_doubling_length` an integer, the measured batch
    points at increasing sizes); else raises a `ValueError` naming the field and `source` (where they came from)."""
    for name in COST_FIELDS:
        value = getattr(costs, name)
        valid = isinstance(value, int) if name == "step_doubling_length" else _is_number(value)
        if not valid or not math.isfinite(value) or value < 0:
            raise ValueError(f"{source}: {name} must be a finite number >= 0, got {value!r}.")
    if type(costs.long_prefix_length) is not int or costs.long_prefix_length < 0:
        raise ValueError(f"{source}: long_prefix_length must be a whole number of tokens >= 0, got "
                         f"{costs.long_prefix_length!r}.")  # fmt: skip
    for name in ("forward_costs", "draft_batch_costs", "long_forward_costs"):
        points = getattr(costs, name)
        sizes = [n for n, _ in points]
        if (
            any(n < 2 for n in sizes)
            or sizes != sorted(set(sizes))
            or not all(math.isfinite(c) and c >= 0 for _, c in points)
        ):
            raise ValueError(
                f"{source}: {name} must be (size, cost) pairs with increasing sizes >= 2 and finite costs >= 0, got "
                f"{points!r}."
            )
    return costs


def _where(name: str) -> str:
    return f"The drafter's generation_config field {name!r}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(name: str, value: Any, low: float, high: float = math.inf) -> None:
    if not _is_number(value) or not math.isfinite(value) or not low <= value <= high:
        bounds = f"in [{low:g}, {high:g}]" if math.isfinite(high) else f"a finite number >= {low:g}"
        raise ValueError(
            f"{_where(name)} must be {bounds}, got {value!r}. Fix it in generation_config.json (or "
            f"drafter.generation_config.{name} = ...), or remove it for the default."
        )


def _check_integer(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(
            f"{_where(name)} must be an integer >= {low}, got {value!r}. Fix it in generation_config.json (or "
            f"drafter.generation_config.{name} = ...), or remove it for the default."
        )


__all__ = ["COST_FIELDS", "DraftingKnobs", "check_costs", "pinned_costs"]
