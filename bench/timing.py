"""What every benchmark times with: wall-clock seconds of one call (the device drained before and after), the
marginal cost of a decoding step, its kernels' timeline, and latency spreads."""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from attrs import field, frozen
from torch.nn.attention import SDPBackend
from torch.profiler import ProfilerActivity, profile

from bench.profile_step import group_of
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


def kernel_timeline(device: torch.device, run: Callable[[int], Any], short: int, long: int) -> dict[str, Any] | None:
    """Per decoding step, the marginal way (as `marginal_ms`): the GPU kernels' summed milliseconds, the
    milliseconds at least one kernel ran (`busy_ms`: their union, which overlapping kernels keep below the sum),
    the milliseconds from the first kernel's start to the last one's end (`span_ms`: busy time and the gaps
    between kernels), the kernels launched, and the idle milliseconds by the group of the kernel that ends each
    gap (`idle_ms_before`, `bench.profile_step`'s groups: which kernels the device waits for). None off CUDA. The
    profiled runs are not the timed ones: the profiler's own host work can widen the gaps."""
    if device.type != "cuda":
        return None
    totals: dict[int, Timeline] = {}
    for tokens in (short, long):
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            run(tokens)
            synchronize(device)
        totals[tokens] = timeline(
            (event.name, event.time_range.start / 1000, event.time_range.end / 1000)
            for event in trace.events()
            if event.device_type.name == "CUDA"
        )
    return per_step(totals[short], totals[long], long - short)


@frozen
class Timeline:
    """Kernels on a device's timeline, in milliseconds (see `kernel_timeline`)."""

    kernel_ms: float
    busy_ms: float
    span_ms: float
    kernels: int
    idle_ms_before: dict[str, float]
    # (kernels, summed ms) by kernel name
    by_name: dict[str, tuple[int, float]] = field(factory=dict)


def timeline(kernels: Iterable[tuple[str, float, float]]) -> Timeline:
    """The `Timeline` of kernels given as (name, start ms, end ms); kernels of no duration are left out. A gap
    is time no kernel runs between the first start and the last end; it counts for the group
    (`bench.profile_step.group_of`) of the kernel whose start ends it."""
    ranges = sorted((start, end, name) for name, start, end in kernels if end > start)
    busy, reached = 0.0, -math.inf
    idle: dict[str, float] = {}
    for start, end, name in ranges:
        if start > reached > -math.inf:
            group = group_of(name)
            idle[group] = idle.get(group, 0.0) + start - reached
        busy += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    by_name: dict[str, tuple[int, float]] = {}
    for start, end, name in ranges:
        count, ms = by_name.get(name, (0, 0.0))
        by_name[name] = (count + 1, ms + end - start)
    summed = sum(end - start for start, end, _ in ranges)
    span = max(end for _, end, _ in ranges) - ranges[0][0] if ranges else 0.0
    return Timeline(
        kernel_ms=summed, busy_ms=busy, span_ms=span, kernels=len(ranges), idle_ms_before=idle, by_name=by_name
    )


TOP_KERNELS = 16
"""Kernel names `per_step` lists, those that added the most time per step."""
NAME_LENGTH = 100
"""Characters of a kernel's name `per_step` keeps (template instantiations run to thousands)."""


def per_step(short: Timeline, long: Timeline, steps: int) -> dict[str, Any]:
    """What `steps` more decoding steps added to a timeline, per step (`kernel_timeline`'s record): its figures,
    the idle time before each group of kernels, and per group and for the `TOP_KERNELS` names that added most
    time, kernels and milliseconds per step."""
    groups = sorted(set(short.idle_ms_before) | set(long.idle_ms_before))
    idle = {
        group: round((long.idle_ms_before.get(group, 0.0) - short.idle_ms_before.get(group, 0.0)) / steps, 4)
        for group in groups
    }
    added: dict[str, tuple[float, float]] = {}
    for name in set(short.by_name) | set(long.by_name):
        short_count, short_ms = short.by_name.get(name, (0, 0.0))
        long_count, long_ms = long.by_name.get(name, (0, 0.0))
        added[name] = ((long_count - short_count) / steps, (long_ms - short_ms) / steps)
    by_group: dict[str, list[float]] = {}
    for name, (count, ms) in added.items():
        group = by_group.setdefault(group_of(name), [0.0, 0.0])
        group[0] += count
        group[1] += ms
    top = sorted(added.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
    return {
        "kernel_ms_per_step": round((long.kernel_ms - short.kernel_ms) / steps, 4),
        "busy_ms_per_step": round((long.busy_ms - short.busy_ms) / steps, 4),
        "span_ms_per_step": round((long.span_ms - short.span_ms) / steps, 4),
        "kernels_per_step": round((long.kernels - short.kernels) / steps, 4),
        "idle_ms_per_step_before": dict(sorted(idle.items(), key=lambda item: -item[1])),
        "groups": {
            group: {"kernels_per_step": round(count, 2), "ms_per_step": round(ms, 4)}
            for group, (count, ms) in sorted(by_group.items(), key=lambda item: -item[1][1])
        },
        "top": [
            {"kernel": name[:NAME_LENGTH], "kernels_per_step": round(count, 2), "ms_per_step": round(ms, 4)}
            for name, (count, ms) in top
        ],
    }


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
