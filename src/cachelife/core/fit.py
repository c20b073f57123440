"""Does a pinned layer fit what is asked of it: the one comparison of recorded buffers with what is needed.

Two requests ask: a pin request for a cache whose layers are partly pinned already (`CacheLifecycle.pin_specs`),
and a forward call about to write a cache (the decoding guard, before a cache's first forward call). Each
states per layer what it needs as a `Need`; both get the same comparison and the same words ("holds X where
Y is needed"). Only host-side facts are read (recorded shapes, dtype, device, capacity), never a tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, TypeAlias

import torch
from attrs import frozen

from cachelife.core.buffers import Buffers, PinSpec
from cachelife.core.layer_lifecycle import LayerLifecycle
from cachelife.core.shapes import LayerShape
from cachelife.errors import CacheShapeError

Request: TypeAlias = Literal["pin", "call"]

_SHAPE_NOTE = (
    "shape is batch, key/value heads, positions, head dim; generate's batch is batch x "
    "max(num_beams, num_return_sequences)"
)
_FIX: dict[Request, str] = {
    "pin": "Build the cache for this model and call, or release it first.",
    "call": "Is it a cache of another model, or built for another batch or max_cache_len?",
}


@frozen(kw_only=True)
class Need:
    """What one layer's buffers must be for a request; None where the request does not say."""

    batch_size: int | None
    shape: LayerShape
    dtype: torch.dtype
    device: torch.device
    # Positions one call writes into the layer from empty (they must fit in its length); None: not checked.
    writes: int | None = None

    @classmethod
    def of_spec(cls, spec: PinSpec) -> Need:
        """What a pin request asks of a layer that is already pinned."""
        shape = LayerShape(spec.num_kv_heads, spec.key_head_dim, spec.value_head_dim)
        return cls(batch_size=spec.batch_size, shape=shape, dtype=spec.dtype, device=spec.device)


def problems(have: Buffers, need: Need) -> list[str]:
    """Every way recorded buffers differ from `need` ("holds X where Y is needed"); empty when they fit."""
    batch = have.key_shape[0] if need.batch_size is None else need.batch_size
    heads, positions = need.shape.num_kv_heads, have.key_shape[2]
    want_keys = (batch, heads, positions, need.shape.key_head_dim)
    want_values = (batch, heads, have.value_shape[2], need.shape.value_head_dim)
    found = [
        f"holds {what} {got!r} where {wanted!r} is needed"
        for what, got, wanted in (
            ("keys of shape", have.key_shape, want_keys),
            ("values of shape", have.value_shape, want_values),
            ("dtype", have.dtype, need.dtype),
            ("device", str(have.device), str(need.device)),
        )
        if got != wanted
    ]
    if need.writes is not None and need.writes > positions:
        found.append(f"the call writes {need.writes} positions but it holds {positions} (max_cache_len)")
    return found


def check_fits(layer: LayerLifecycle, need: Need, *, request: Request) -> None:
    """Raise `CacheShapeError` naming every mismatch unless the layer, if pinned, holds what `need` asks for.
    A layer that is not pinned fits any request (it will be pinned for it)."""
    if not layer.is_pinned:
        return
    found = problems(layer.buffers, need)
    if found:
        state = type(layer.state).__name__
        lead = f"is already {state} and" if request == "pin" else f"does not fit this forward call: it is {state} and"
        msg = f"{layer.describe()} {lead} {'; '.join(found)} ({_SHAPE_NOTE}). {_FIX[request]}"
        raise CacheShapeError(msg)


def check_encoder_fits(cross_attention: Iterable[LayerLifecycle], length: int | None) -> None:
    """Raise `CacheShapeError` if an encoder output of `length` positions (None: unknown) exceeds a
    cross-attention layer's length."""
    if length is None:
        return
    for layer in cross_attention:
        capacity = layer.capacity
        if capacity is not None and length > capacity:
            msg = (
                f"the encoder output has {length} positions but {layer.describe()} holds {capacity}; build "
                "the cache with encoder_length >= the encoder's output length"
            )
            raise CacheShapeError(msg)
