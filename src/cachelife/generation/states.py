"""The static state buffers of `cachelife.generate`, kept per model and shape between calls.

A second call of the same shape must decode at the same addresses as the first (the compiled step's CUDA
graph reads them; new addresses would mean a re-recording), so the token and beam buffers, the sampling noise
and the static copies of the encoder output and mask outlive the call. They sit outside the pool's byte
budget, so each model keeps those of its `KEPT` most recently used keys (a role and a shape) and drops older
ones: a caller that cycles through many shapes does not hold buffers for all of them.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from cachelife.errors import UnsupportedGenerationError

KEPT = 24
"""Keys kept per model: a call uses up to three (its state, the encoder output, the encoder mask)."""

_STATES: weakref.WeakKeyDictionary[PreTrainedModel, OrderedDict[tuple[object, ...], object]] = (
    weakref.WeakKeyDictionary()
)


def pooled_state(model: PreTrainedModel, key: tuple[object, ...], make: Callable[[], object]) -> object:
    """The state buffers of an earlier call with the same key (same addresses), or new ones from `make`."""
    states = _STATES.setdefault(model, OrderedDict())
    if key in states:
        states.move_to_end(key)
        return states[key]
    states[key] = made = make()
    while len(states) > KEPT:
        states.popitem(last=False)  # the least recently used
    return made


def kept_keys(model: PreTrainedModel) -> tuple[tuple[object, ...], ...]:
    """The keys whose buffers `model` keeps, least recently used first."""
    return tuple(_STATES.get(model, OrderedDict()))


def static_copy(model: PreTrainedModel, role: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` copied into this model's kept static buffer of its role, shape and dtype."""

    def make() -> torch.Tensor:
        buffer = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        torch._dynamo.mark_static_address(buffer)
        return buffer

    buffer = pooled_state(model, (role, tuple(tensor.shape), tensor.dtype, tensor.device), make)
    if not isinstance(buffer, torch.Tensor):
        msg = f"kept {role} buffer is a {type(buffer).__name__}, expected a tensor"
        raise UnsupportedGenerationError(msg)
    return buffer.copy_(tensor)
