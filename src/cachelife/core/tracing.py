"""Whether this thread's code is being traced by `torch.compile`.

`torch.compiler.is_compiling()` is True inside traced code, and also in plain eager code of every other thread
while any thread compiles (torch holds one process-wide flag for a compile session). cachelife's eager checks
(pinning, the model's hooks, fused weights) must run in those other threads as usual, so they ask
`tracing_here`, which also requires a tracing context in this thread.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._guards


def _has_tracing_context() -> bool:
    return torch._guards.TracingContext.try_get() is not None


# Evaluated once while dynamo traces (in the tracing thread, where it is True) and kept as a constant.
_constant_result: Callable[[Callable[[], bool]], Callable[[], bool]] = torch._dynamo.assume_constant_result
_traced_in_this_thread = _constant_result(_has_tracing_context)


def tracing_here() -> bool:
    """Whether the calling code runs inside a `torch.compile` trace of this thread."""
    return torch.compiler.is_compiling() and _traced_in_this_thread()
