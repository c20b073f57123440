"""Python values into device tensors without waiting for the device.

A plain `torch.tensor(values, device="cuda")` copies from pageable host memory, which waits for everything queued
on the stream: on the engine's scheduler thread, for the step in flight, so the device would idle while the host
prepares the next one. These values go through pinned host memory instead, copied in stream order; torch's
pinned-memory allocator keeps the host block until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_tensor(values: Sequence[float], *, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` as a 1-D tensor on `device`; on CUDA copied without waiting for the work queued before it."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_values(into: torch.Tensor, values: Sequence[float]) -> None:
    """Write `values` (as many as `into` holds) into the 1-D tensor `into` in place, as `device_tensor` copies."""
    host = torch.tensor(values, dtype=into.dtype)
    if into.device.type == "cuda":
        into.copy_(host.pin_memory(), non_blocking=True)
    else:
        into.copy_(host)
