"""What cachelife's Triton kernels share: Triton itself (None where it is not installed), the annotations of
kernel parameters, whether the kernels serve tensors of a device, and where they launch."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import torch

triton: Any
tl: Any
try:
    triton = importlib.import_module("triton")
    tl = importlib.import_module("triton.language")
except ImportError:
    triton = tl = None

DTYPES: Final = (torch.bfloat16, torch.float16, torch.float32)
"""The floating-point dtypes the kernels take (they accumulate in float32)."""
LAUNCH: Final = {"num_warps": 4, "enable_fp_fusion": True}
"""Launch options of every kernel; fused multiply-adds stated, since Triton 3.10 changes its default."""

# Kernel parameter annotations. Triton takes a parameter annotated `constexpr` (by that name) as a compile-time
# constant, and resolves every annotation in a kernel's module when it compiles, where it accepts only Triton's
# own objects; mypy reads them as what the host passes.
if TYPE_CHECKING:
    constexpr: TypeAlias = int
    Pointer: TypeAlias = Any
    Scalar: TypeAlias = Any
else:
    constexpr = int if tl is None else tl.constexpr
    Pointer = Scalar = object if tl is None else tl.tensor


def triton_runs_on(device: torch.device) -> bool:
    """Whether the kernels serve tensors of `device`: Triton installed, and the device CUDA without
    `TRITON_INTERPRET=1`, or the CPU with it (Triton's interpreter, which would copy CUDA tensors to the host
    and back: the torch fallbacks serve them then)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    if triton is None:
        return False
    if device.type == "cuda":
        return not interpreting
    return device.type == "cpu" and interpreting


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA `device`; 1 elsewhere (the interpreter runs programs one after
    another)."""
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def power_of_two_at_least(n: int) -> int:
    """The smallest power of two not below `n` (Triton's ranges are powers of two); 1 for 0."""
    return 1 << max(n - 1, 0).bit_length()


# Triton's interpreter patches its language module for the length of a launch, so that launches from two threads
# (an engine's steps beside its prefills) undo each other's patches: on the CPU they run one at a time.
_INTERPRETER_LAUNCH = threading.Lock()


def launching_on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device, not the tensors': this makes it theirs. Under the interpreter
    (the CPU), one launch at a time."""
    return torch.cuda.device(device) if device.type == "cuda" else _INTERPRETER_LAUNCH
