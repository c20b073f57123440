"""What every benchmark times with: wall-clock seconds of one call (the device drained before and after), the
marginal cost of a decoding step, its kernels' timeline, and latency spreads."""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.attention import SDPBackend
from torch.profiler import ProfilerActivity, profile

from cachelife.generation import repeatable


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def as_tokens(output: object) -> torch.Tensor:
    """A `generate` output narrowed to the token tensor it returns by default."""
    if not isinstance(output, torch.Tensor):
        msg = f"expected a token tensor, got {type(output).__name__}"
        raise TypeError(msg)
    return output


def timed(device: torch.device, call: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    """Seconds `call` takes, kernels included, and what it returned. Python's garbage collector runs before
    the call and not during it, so that a collection falling into one of the two calls a marginal figure
    subtracts does not enter that figure."""
    gc.collect()
    gc.disable()
    try:
        synchronize(device)
        started = time.perf_counter()
        tokens = call()
        synchronize(device)
        return time.perf_counter() - started, tokens
    finally:
        gc.enable()


def marginal_ms(
    device: torch.device, run: Callable[[int], torch.Tensor], short: int, long: int, repeats: int
) -> tuple[float, bool]:
    """Milliseconds per decoding step, the marginal way: (best of `repeats` calls of `run(long)` - best of
    `repeats` calls of `run(short)`) / (long - short), so that prefill drops out; and whether every call of a
    length gave the same tokens."""
    calls = {
        tokens: [timed(device, functools.partial(run, tokens)) for _ in range(repeats)] for tokens in (short, long)
    }
    best = {tokens: min(seconds for seconds, _ in done) for tokens, done in calls.items()}
    same = all(torch.equal(out, done[0][1]) for done in calls.values() for _, out in done)
    return 1000 * (best[long] - best[short]) / (long - short), same


def kernel_timeline(device: torch.device, run: Callable[[int], Any], short: int, long: int) -> dict[str, float] | None:
    """Per decoding step, the marginal way (as `marginal_ms`): the GPU kernels' summed milliseconds, the
    milliseconds at least one kernel ran (`busy_ms`: their union, which overlapping kernels keep below the sum),
    the milliseconds from the first kernel's start to the last one's end (`span_ms`: busy time and the gaps
    between kernels), and the kernels launched. None off CUDA. The profiled runs are not the timed ones: the
    profiler's own host work can widen the gaps."""
    if device.type != "cuda":
        return None
    totals: dict[int, tuple[float, float, float, int]] = {}
    for tokens in (short, long):
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            run(tokens)
            synchronize(device)
        ranges = sorted(
            (event.time_range.start, event.time_range.end)
            for event in trace.events()
            if event.device_type.name == "CUDA" and event.time_range.end > event.time_range.start
        )
        busy, reached = 0.0, -math.inf
        for start, end in ranges:
            busy += max(0.0, end - max(start, reached))
            reached = max(reached, end)
        summed = sum(end - start for start, end in ranges)
        span = ranges[-1][1] - ranges[0][0] if ranges else 0.0
        totals[tokens] = (summed / 1000, busy / 1000, span / 1000, len(ranges))
    steps = long - short
    per_step = [(totals[long][i] - totals[short][i]) / steps for i in range(4)]
    names = ("kernel_ms_per_step", "busy_ms_per_step", "span_ms_per_step", "kernels_per_step")
    return {name: round(value, 4) for name, value in zip(names, per_step, strict=True)}


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile `share` (0-100) of `values`."""
    ordered = sorted(values)
    return ordered[min(max(1, math.ceil(share / 100 * len(ordered))), len(ordered)) - 1]


def milliseconds(values: list[float]) -> dict[str, float]:
    """p50, p99, max and mean of `values` (seconds), in milliseconds."""
    return {"p50": round(1000 * percentile(values, 50), 2), "p99": round(1000 * percentile(values, 99), 2),
            "max": round(1000 * max(values), 2), "mean": round(1000 * statistics.fmean(values), 2)}  # fmt: skip


@contextlib.contextmanager
def cudnn_attention_allowed() -> Iterator[None]:
    """Steps compiled within may choose torch's cuDNN attention, as cachelife's steps did before they kept to
    `cachelife.generation.repeatable.REPEATABLE_ATTENTION`: a benchmark's instrument, for the side-by-side cost
    of repeatable attention."""
    kept = repeatable.REPEATABLE_ATTENTION
    repeatable.REPEATABLE_ATTENTION = (*kept, SDPBackend.CUDNN_ATTENTION)
    try:
        yield
    finally:
        repeatable.REPEATABLE_ATTENTION = kept
