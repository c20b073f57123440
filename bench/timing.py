"""What every benchmark times with: wall-clock seconds of one call, the device drained before and after."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


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


def greedy(tokens: int) -> dict[str, Any]:
    """`generate` settings for exactly `tokens` new tokens, greedy."""
    return {"do_sample": False, "max_new_tokens": tokens, "min_new_tokens": tokens}


def kernels_per_step(
    device: torch.device, run: Callable[[int], Any], short: int, long: int
) -> tuple[float, float] | None:
    """GPU kernel milliseconds and kernel launches per decoding step, measured the marginal way: (a run of
    `long` new tokens - a run of `short`) / (long - short), each under torch.profiler. None off CUDA."""
    if device.type != "cuda":
        return None
    totals: dict[int, tuple[float, int]] = {}
    for tokens in (short, long):
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            run(tokens)
            synchronize(device)
        events = [event for event in trace.key_averages() if event.device_type.name == "CUDA"]
        totals[tokens] = (sum(event.self_device_time_total for event in events) / 1000, sum(e.count for e in events))
    steps = long - short
    return (totals[long][0] - totals[short][0]) / steps, (totals[long][1] - totals[short][1]) / steps


def marginal_runs(generate: Callable[[int], tuple[float, bool]], short: int, long: int, repeats: int) -> dict[str, Any]:
    """`repeats` alternating calls of `short` and `long` new tokens (`generate(tokens)` returns seconds and
    whether the tokens were right): every call's seconds, the marginal ms per step (best long - best short,
    over long - short), and whether every call was right."""
    times: dict[int, list[float]] = {short: [], long: []}
    right = []
    for _ in range(repeats):
        for tokens in (short, long):
            seconds, ok = generate(tokens)
            times[tokens].append(seconds)
            right.append(ok)
    return {
        "call_s": {str(tokens): [round(t, 4) for t in values] for tokens, values in times.items()},
        "marginal_ms_per_step": round(1000 * (min(times[long]) - min(times[short])) / (long - short), 4),
        "all_equal": all(right),
        "calls": len(right),
    }
