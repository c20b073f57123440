"""The attention a decoding step may use: backends whose results repeat exactly on identical inputs.

torch chooses a backend for each `scaled_dot_product_attention` among those its process-wide switches enable
(`torch.backends.cuda.enable_cudnn_sdp` and the others). On Hopper GPUs it prefers cuDNN's attention for bf16
and fp16, whose results vary between identical calls: identical `cachelife.generate` calls then decoded other
tokens. So cachelife's steps keep to `REPEATABLE_ATTENTION`:

- a compiled step is traced inside `torch.nn.attention.sdpa_kernel(REPEATABLE_ATTENTION)`: dynamo records the
  choice in the step's graph, so it holds for every call of the compiled step, replays of its CUDA graphs too;
- every call of a step, eager or compiled, runs with the switches restricted (`restricted_switches`): an eager
  step chooses its attention from them, and a compiled step's tracing changes them only inside the
  restriction. It is one restriction for the process, however many threads' steps run at once, lifted when
  the last one ends, so the switches are the user's again between steps. Attention that another thread runs
  meanwhile is restricted too.

Dynamo records the restriction as calls of two functions of `torch.nn.attention` in the step's graph, which
torch's AOTAutograd cache does not know: it would pass every step by, so that every process ran AOTAutograd
and its graph passes on every step again, however warm its compile cache. `cacheable_switch_calls` marks them
cacheable for the step's compilation: both only set or name the switches from the constants the graph holds,
so the graph that is the cache key determines what they do.

Transformers' prefill keeps the process's switches.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

REPEATABLE_ATTENTION: tuple[SDPBackend, ...] = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)
"""The backends a step's attention chooses among: all of torch's but cuDNN's."""


# The functions of `torch.nn.attention` that a traced `sdpa_kernel` leaves in a graph.
_SWITCH_CALLS = ("torch.nn.attention._sdpa_kernel", "torch.nn.attention._backend_from_string")


def cacheable_switch_calls() -> dict[str, str]:
    """The inductor option `unsafe_marked_cacheable_functions` for a step's compilation: the functions a user
    already marked, and the switch calls keyed to torch's version (their code comes with torch)."""
    marked: dict[str, str] = dict(torch._inductor.config.unsafe_marked_cacheable_functions)
    return {**marked, **dict.fromkeys(_SWITCH_CALLS, torch.__version__)}


def with_repeatable_attention(function: Callable[..., None]) -> Callable[..., None]:
    """`function`, its attention restricted to `REPEATABLE_ATTENTION` (for a step that is compiled)."""

    def run(**arguments: Any) -> None:
        with sdpa_kernel(list(REPEATABLE_ATTENTION)):
            function(**arguments)

    return run


class _Restriction:
    """The process's one restriction of the switches: how many eager steps hold it, and the switches it saved."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.saved: list[SDPBackend] = []


_RESTRICTION = _Restriction()


@contextlib.contextmanager
def restricted_switches() -> Iterator[None]:
    """The process's attention switches restricted to the enabled ones of `REPEATABLE_ATTENTION` (MATH if none
    is) while any caller is within; the first caller in saves them, the last one out restores them."""
    restriction = _RESTRICTION
    with restriction.lock:
        if restriction.holders == 0:
            restriction.saved = torch.nn.attention._cur_sdpa_kernel_backends()
            allowed = [backend for backend in REPEATABLE_ATTENTION if backend in restriction.saved]
            torch.nn.attention._sdpa_kernel(allowed or [SDPBackend.MATH])
        restriction.holders += 1
    try:
        yield
    finally:
        with restriction.lock:
            restriction.holders -= 1
            if restriction.holders == 0:
                torch.nn.attention._sdpa_kernel(restriction.saved)


def within_restricted_switches(function: Callable[..., None]) -> Callable[..., None]:
    """`function`, run within `restricted_switches` (every call of a step)."""

    def run(**arguments: Any) -> None:
        with restricted_switches():
            function(**arguments)

    return run
