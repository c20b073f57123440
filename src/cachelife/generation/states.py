"""The static state buffers of one `cachelife.generate` call, leased from the model's runtime.

A second call of the same shape must decode at the same addresses as the first (the step's CUDA graph reads
them; new addresses would mean a new capture), so the token and beam buffers, the sampling noise and the static
copies of the encoder output and mask outlive the call: `StateLeases` takes each set from the model's runtime
(`ModelRuntime.states`, keyed by role and shape) or makes it, and puts every set back when the call ends. A set
is one call's while leased: a call that runs inside another on the same model (a nested `generate`) gets sets
of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

import torch

from cachelife.errors import UnsupportedGenerationError
from cachelife.integration.runtime import Key, ModelRuntime

T = TypeVar("T")


class StateLeases:
    """The state sets one call leased; `with` returns them all to the runtime when the call ends."""

    def __init__(self, runtime: ModelRuntime) -> None:
        self.runtime = runtime
        self.leased: list[tuple[Key, object]] = []

    def __enter__(self) -> StateLeases:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        with self.runtime.lock:
            for key, value in self.leased:
                self.runtime.states.put(key, value)
        self.leased.clear()

    def lease(self, key: Key, kind: type[T], make: Callable[[], T]) -> T:
        """The idle set of `key` (the addresses an earlier call decoded at), or a new one from `make`."""
        with self.runtime.lock:
            found = self.runtime.states.take(key)
        value = make() if found is None else found
        if not isinstance(value, kind):
            msg = f"the state kept for {key!r} is a {type(value).__name__}, expected a {kind.__name__}"
            raise UnsupportedGenerationError(msg)
        self.leased.append((key, value))
        return value

    def static_copy(self, role: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` copied into a leased static buffer of its role, shape and dtype."""

        def make() -> torch.Tensor:
            buffer = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            torch._dynamo.mark_static_address(buffer)
            return buffer

        key = (role, tuple(tensor.shape), tensor.dtype, tensor.device)
        return self.lease(key, torch.Tensor, make).copy_(tensor)
