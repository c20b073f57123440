"""Before a cache's first forward call: do its pinned buffers fit this model and this call?"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedModel

from cachelife.core import buffers
from cachelife.core.cache_lifecycle import CacheLifecycle
from cachelife.core.fit import Need, check_fits
from cachelife.core.layer_lifecycle import Pinned
from cachelife.core.placement import cache_layer_devices
from cachelife.core.shapes import model_cache_shapes
from cachelife.errors import CacheShapeError
from cachelife.integration import call_arguments


def check_call_fits(state: CacheLifecycle, model: PreTrainedModel, kwargs: Mapping[str, Any]) -> None:
    """Before a cache's first forward call: its pinned buffers must fit this model and this call (batch,
    heads, head dims, dtype, each layer's device, and the positions the call writes), host facts only."""
    shapes = model_cache_shapes(model)
    expected = [*shapes.self_attention, *shapes.cross_attention]
    if len(expected) != len(state.layers):
        msg = (
            f"the cache has {len(state.self_attention)} self-attention and {len(state.cross_attention)} "
            f"cross-attention layers but {type(model).__name__} has {len(shapes.self_attention)} and "
            f"{len(shapes.cross_attention)}: is it a cache of another model?"
        )
        raise CacheShapeError(msg)
    batch_size = call_arguments.batch_size(kwargs)
    query_length = call_arguments.query_length(kwargs)
    devices = cache_layer_devices(model, len(shapes.self_attention), len(shapes.cross_attention))
    for layer, shape, device in zip(state.layers, expected, devices, strict=True):
        # An empty full-attention self-attention layer must hold every position the call writes.
        writes_from_empty = (
            layer.role == "self" and isinstance(layer.state, Pinned) and not buffers.is_sliding_layer(layer.layer)
        )
        need = Need(
            batch_size=batch_size,
            shape=shape,
            dtype=model.dtype,
            device=device,
            writes=query_length if writes_from_empty else None,
        )
        check_fits(layer, need, request="call")
