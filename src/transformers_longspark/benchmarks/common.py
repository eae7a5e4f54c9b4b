"""What every benchmark shares: synced timing, medians of interleaved repeats, chunked prefill, machine info."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import Cache

from .settings import DecodingSettings


def synchronize(device: str | torch.device) -> None:
    """Waits for the device's queued work (CUDA kernels run asynchronously); a no-op on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(function: Callable[..., Any], *args: Any, device: str | torch.device = "cpu") -> tuple[float, Any]:
    """`(seconds, result)` of one call of `function(*args)`, with the device synchronized before and after."""
    synchronize(device)
    start = time.perf_counter()
    result = function(*args)
    synchronize(device)
    return time.perf_counter() - start, result


@dataclass
class Timings:
    """Seconds of the measured repeats of one timed call: `seconds[r][p]` is phase `p` of repeat `r`."""

    seconds: list[tuple[float, ...]] = field(default_factory=list)

    def median_ms(self, phase: int | None = None) -> float:
        """Median milliseconds of one phase, or of the phases' sum per repeat when `phase` is None."""
        values = [sum(phases) if phase is None else phases[phase] for phases in self.seconds]
        return 1000.0 * statistics.median(values)


Phases = Callable[[], Any] | Sequence[Callable[..., Any]]


def measure(
    calls: Mapping[str, Phases],
    repeats: int,
    warmup: int = 1,
    *,
    device: str | torch.device = "cpu",
    prepare: Callable[[str], None] | None = None,
    progress: str | None = None,
) -> dict[str, Timings]:
    """`{name: Timings}` of several calls interleaved: `warmup` untimed repeats, then `repeats` timed ones.

    Each repeat runs every call once, the order rotated from repeat to repeat (A B, B A, ...), so that machine noise
    hits them alike. A call is a callable or a sequence of phases, each timed separately: the first phase takes no
    argument and each next phase gets the previous one's result. `prepare(name)`, untimed, runs before each call.
    `progress`, when given, labels a progress bar of the repeats on stderr.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"Need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}.")
    names = list(calls)
    timings = {name: Timings() for name in names}
    bar = tqdm(range(warmup + repeats), desc=progress, unit="repeat", leave=False, disable=progress is None)
    for repeat in bar:
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            if prepare is not None:
                prepare(name)
            laps, arguments = [], ()
            for phase in [calls[name]] if callable(calls[name]) else calls[name]:
                seconds, result = timed_call(phase, *arguments, device=device)
                laps.append(seconds)
                arguments = (result,)
            if repeat >= warmup:
                timings[name].seconds.append(tuple(laps))
    return timings


@contextlib.contextmanager
def time_forward_calls(model: torch.nn.Module, device: str | torch.device = "cpu") -> Iterator[list[float]]:
    """Seconds of each call of `model`'s forward (a list, appended in place) while the context is open.

    The device is synchronized around each call, as assisted decoding does anyway when it reads the verified tokens.
    """
    seconds: list[float] = []
    start = [0.0]

    def before(module, args, kwargs):
        synchronize(device)
        start[0] = time.perf_counter()

    def after(module, args, kwargs, output):
        synchronize(device)
        seconds.append(time.perf_counter() - start[0])

    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield seconds
    finally:
        for handle in handles:
            handle.remove()


def generate_kwargs(
    mode: str, max_new_tokens: int, settings: DecodingSettings, pad_token_id: int | None
) -> dict[str, Any]:
    """`generate`'s decoding arguments: greedy, or (`mode == "sampled"`) plain sampling at `settings.temperature`, with
    no top-k / top-p truncation; `settings.ignore_eos` forces exactly `max_new_tokens` tokens."""
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=mode == "sampled")
    if pad_token_id is not None:
        kwargs["pad_token_id"] = pad_token_id
    if mode == "sampled":
        kwargs.update(temperature=settings.temperature, top_k=0, top_p=1.0)
    if settings.ignore_eos:
        kwargs["min_new_tokens"] = max_new_tokens
    return kwargs


def eos_token_ids(target: torch.nn.Module) -> list[int]:
    """The target's EOS ids (its generation config may give none, one, or several)."""
    eos = target.generation_config.eos_token_id
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]


def pad_token_id(target: torch.nn.Module, default: int | None = None) -> int | None:
    """The target's pad id, else its first EOS id, else `default`."""
    pad, eos = target.generation_config.pad_token_id, eos_token_ids(target)
    return pad if pad is not None else eos[0] if eos else default


def prefill(target: torch.nn.Module, input_ids: torch.Tensor, chunk: int = 2048, cache: Cache | None = None) -> Cache:
    """Fills `cache` (default a fresh `DynamicCache`) with `input_ids` `(1, t)`, `chunk` tokens per target forward,
    which bounds the prefill's activation memory. Returns the cache."""
    cache = DynamicCache(config=target.config) if cache is None else cache
    with torch.no_grad():
        for start in range(0, input_ids.shape[1], chunk):
            target(input_ids[:, start : start + chunk], cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def machine_info(device: str | torch.device = "cpu") -> dict[str, Any]:
    """CPU model, core counts, torch threads and library versions (plus the GPU name on CUDA)."""
    import transformers

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.lower().startswith("model name")), cpu)
    info = {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "cpu_cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        # Read by OpenMP when torch starts: ACTIVE keeps its threads spinning between forwards (docs/results.md).
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info
