"""Beam-search reorders that keep a pinned layer's buffers: the selected rows are written back in place.

transformers' `CacheLayerMixin.reorder_cache` (5.17 to 5.24; `Cache.reorder_cache` and
`EncoderDecoderCache.reorder_cache` call it once per layer after every beam-search step) replaces `keys` and
`values` with `index_select` results. After the first reorder a pinned layer holds new tensors that are not
marked static, and CUDA graphs skip ("mutated inputs") on every later call. It also tests
`get_seq_length() > 0`, which reads a static layer's length tensor: one host-device synchronisation per layer
per step.

Every layer cachelife pins gets an instance-level `reorder_cache` (`install`) that gathers the selected rows
and copies them into the same tensors: same data pointers, still marked static, no synchronisation. It runs
in eager code between compiled forward calls, where `generate` calls it, and also traces without a graph
break (`index_select` and `copy_`). Releasing the layer removes it (`remove`), so the layer is again exactly
as transformers builds it; caches cachelife does not manage are never touched.

A cross-attention layer whose content `generate` computes from the encoder output it expanded for beam
search holds the same rows for every beam of one input, and beam indices never leave their input's group:
its reorder would copy equal rows onto each other. `share_rows_within_beams` turns its reorder into a no-op
until the layer is next emptied or released.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import StaticLayer

# The instance attribute that shadows transformers' `CacheLayerMixin.reorder_cache`.
_ATTRIBUTE = "reorder_cache"


class InPlaceReorder:
    """A pinned layer's `reorder_cache`: gathers the beams' rows into the layer's own tensors."""

    __slots__ = ("_layer", "rows_shared_within_beams")

    def __init__(self, layer: StaticLayer) -> None:
        # Weak, so that the layer and this object form no reference cycle: a dropped cache is freed at once
        # and its pooled buffers go back to the pool without waiting for the garbage collector.
        self._layer = weakref.ref(layer)
        self.rows_shared_within_beams = False

    def __deepcopy__(self, memo: dict[int, Any]) -> InPlaceReorder:
        # A deep copy of the layer (and of its cache) reorders the copy: `copy.deepcopy` records the copied
        # layer in `memo` before it copies the layer's attributes, this one among them.
        layer = self._layer()
        if layer is None:  # the layer is gone: nothing left to reorder, in the copy either
            return self
        twin = InPlaceReorder(memo.get(id(layer), layer))
        twin.rows_shared_within_beams = self.rows_shared_within_beams
        return twin

    def __call__(self, beam_idx: torch.Tensor) -> None:
        layer = self._layer()
        if layer is None or self.rows_shared_within_beams:
            return
        for tensor in (layer.keys, layer.values):
            if tensor is not None:
                tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))


def install(layer: StaticLayer) -> None:
    """Give a pinned layer the in-place reorder (idempotent)."""
    if not isinstance(layer.__dict__.get(_ATTRIBUTE), InPlaceReorder):
        layer.__dict__[_ATTRIBUTE] = InPlaceReorder(layer)


def remove(layer: StaticLayer) -> None:
    """Give the layer back transformers' own reorder (for a released layer)."""
    if isinstance(layer.__dict__.get(_ATTRIBUTE), InPlaceReorder):
        del layer.__dict__[_ATTRIBUTE]


def is_in_place(layer: StaticLayer) -> bool:
    """Whether the layer reorders in place (cachelife's reorder is installed)."""
    return isinstance(layer.__dict__.get(_ATTRIBUTE), InPlaceReorder)


def share_rows_within_beams(layer: StaticLayer, shared: bool = True) -> None:
    """Declare that every beam of one input holds the same rows in this layer (or no longer does), so that a
    beam reorder leaves it as it is."""
    reorder = layer.__dict__.get(_ATTRIBUTE)
    if isinstance(reorder, InPlaceReorder):
        reorder.rows_shared_within_beams = shared


def rows_shared_within_beams(layer: StaticLayer) -> bool:
    """Whether a beam reorder skips this layer (see `share_rows_within_beams`)."""
    reorder = layer.__dict__.get(_ATTRIBUTE)
    return isinstance(reorder, InPlaceReorder) and reorder.rows_shared_within_beams
