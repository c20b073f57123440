"""What every benchmark times with: wall-clock seconds of one call, the device drained before and after."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, call: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    """Seconds `call` takes, kernels included, and what it returned."""
    synchronize(device)
    started = time.perf_counter()
    tokens = call()
    synchronize(device)
    return time.perf_counter() - started, tokens


def greedy(tokens: int) -> dict[str, Any]:
    """`generate` settings for exactly `tokens` new tokens, greedy."""
    return {"do_sample": False, "max_new_tokens": tokens, "min_new_tokens": tokens}
