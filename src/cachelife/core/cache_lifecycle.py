"""Whole-cache view: the lifecycles of every layer of a `StaticCache` or an `EncoderDecoderCache`.

`lifecycle(cache)` returns the one `CacheLifecycle` of a cache (kept while the cache lives, never keeping it
alive). Operations here apply a layer transition to every layer that needs it, all or nothing: they check
every layer first (`LayerLifecycle.check`, and `cachelife.core.fit` for pin requests) and change a layer only when
every check passed. Should acting still fail part way (out of memory while pinning), `pin` releases what the
same call pinned.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import TypeAlias, TypeGuard

import torch
from attrs import define, field
from transformers.cache_utils import Cache, EncoderDecoderCache, StaticCache, StaticLayer
from typing_extensions import TypeIs

from cachelife.core.buffers import PinSpec
from cachelife.core.fit import Need, check_fits
from cachelife.core.layer_lifecycle import (
    Filled,
    FillRecord,
    LayerLifecycle,
    NoStorage,
    Pinned,
    Role,
    TransitionCount,
    Unallocated,
)
from cachelife.core.placement import resolve_device
from cachelife.core.shapes import CacheShapes, LayerShape
from cachelife.errors import CacheShapeError, UnpinnedCacheError, UnsupportedCacheError
from cachelife.validate import check_int

ManagedCache: TypeAlias = StaticCache | EncoderDecoderCache
# A pinned layer and the keys, values and cumulative_length it must still hold.
Watched: TypeAlias = tuple[StaticLayer, torch.Tensor, torch.Tensor, torch.Tensor]
Devices: TypeAlias = torch.device | str | Sequence[torch.device | str]


def is_static_cache(cache: object) -> TypeIs[StaticCache]:
    """Whether `cache` is a transformers `StaticCache`."""
    return isinstance(cache, StaticCache)


def is_encoder_decoder_cache(cache: object) -> TypeIs[EncoderDecoderCache]:
    """Whether `cache` is a transformers `EncoderDecoderCache` (static or not inside)."""
    return isinstance(cache, EncoderDecoderCache)


def is_static_encoder_decoder_cache(cache: object) -> TypeGuard[EncoderDecoderCache]:
    """Whether `cache` is an `EncoderDecoderCache` whose self-attention cache is static. A `TypeGuard`, not a
    `TypeIs`: it is False for an `EncoderDecoderCache` of dynamic caches, so False says nothing about the type."""
    return is_encoder_decoder_cache(cache) and is_static_cache(cache.self_attention_cache)


def is_managed_cache(cache: object) -> TypeGuard[ManagedCache]:
    """Whether cachelife manages this cache: a `StaticCache`, or an `EncoderDecoderCache` around one (a
    `TypeGuard`: False for an `EncoderDecoderCache` of dynamic caches)."""
    return is_static_cache(cache) or is_static_encoder_decoder_cache(cache)


@define(eq=False, kw_only=True)
class CacheLifecycle:
    """The lifecycles of every layer of one cache: self-attention layers first, then cross-attention."""

    _self_attention: tuple[LayerLifecycle, ...] = field(alias="self_attention")
    _cross_attention: tuple[LayerLifecycle, ...] = field(alias="cross_attention")
    # Identity of the layer objects the lifecycles were built for, to notice replaced layers or sub-caches.
    _layer_ids: tuple[int, ...] = field(alias="layer_ids")
    # Every transition of these layers counts here (each layer was adopted with it).
    _transitions: TransitionCount = field(factory=TransitionCount, alias="transitions")
    # (the transition count when computed, is_pinned, is_filled): checked once per step while decoding.
    _verdict: tuple[int, bool, bool] = field(default=(-1, False, False), alias="verdict")
    # (the transition count when computed, (layer, keys, values, cumulative_length) of every pinned layer):
    # what each pinned layer must still hold, compared by identity once per decoding step.
    _watched: tuple[int, tuple[Watched, ...]] = field(default=(-1, ()), alias="watched")

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[type(layer.state).__name__] = counts.get(type(layer.state).__name__, 0) + 1
        states = ", ".join(f"{count} {name}" for name, count in counts.items())
        return (
            f"<CacheLifecycle {len(self.self_attention)} self-attention and {len(self.cross_attention)} "
            f"cross-attention layers: {states}>"
        )

    @property
    def transitions(self) -> TransitionCount:
        """The count of its layers' transitions, which its memoised verdicts follow."""
        return self._transitions

    @property
    def layers(self) -> tuple[LayerLifecycle, ...]:
        """Every layer: self-attention layers in order, then cross-attention layers in order."""
        return self._self_attention + self._cross_attention

    @property
    def self_attention(self) -> tuple[LayerLifecycle, ...]:
        """The self-attention layers (all layers of a decoder-only `StaticCache`)."""
        return self._self_attention

    @property
    def cross_attention(self) -> tuple[LayerLifecycle, ...]:
        """The cross-attention layers of an `EncoderDecoderCache` (empty for a `StaticCache`)."""
        return self._cross_attention

    @property
    def storage_layers(self) -> tuple[LayerLifecycle, ...]:
        """The layers that store keys and values: every layer but the `NoStorage` ones (transformers' DummyLayer)."""
        return tuple(layer for layer in self.layers if layer.holds_storage)

    @property
    def is_pinned(self) -> bool:
        """Whether every storage layer holds static buffers (state `Pinned` or `Filled`); `NoStorage` layers
        never block it."""
        return self._current_verdict()[1]

    @property
    def is_filled(self) -> bool:
        """Whether every storage layer holds content."""
        return self._current_verdict()[2]

    def _current_verdict(self) -> tuple[int, bool, bool]:
        # States change only through transitions, so the verdict holds until the next transition of a layer.
        now = self._transitions.value
        if self._verdict[0] != now:
            layers = self.storage_layers
            self._verdict = (
                now,
                all(layer.is_pinned for layer in layers),
                all(isinstance(layer.state, Filled) for layer in layers),
            )
        return self._verdict

    def unpinned(self) -> tuple[LayerLifecycle, ...]:
        """The storage layers that hold no static buffers (`NoStorage` layers are never listed)."""
        return tuple(layer for layer in self.storage_layers if not layer.is_pinned)

    def replaced(self) -> tuple[tuple[LayerLifecycle, list[str]], ...]:
        """Pinned layers whose tensors were replaced behind the lifecycle's back, each with the names of the
        replaced tensors (keys, values, cumulative_length); empty when every layer holds its pinned tensors."""
        if not self._any_replaced():
            return ()
        found = []
        for layer in self.layers:
            names = layer.replaced_tensors()
            if names:
                found.append((layer, names))
        return tuple(found)

    def _any_replaced(self) -> bool:
        # The per-step fast path: identity checks against a list rebuilt only after a transition.
        now = self._transitions.value
        if self._watched[0] != now:
            self._watched = (now, tuple(_pinned_tensors(layer) for layer in self.layers if layer.is_pinned))
        for layer, keys, values, length in self._watched[1]:
            if layer.keys is not keys or layer.values is not values or layer.cumulative_length is not length:
                return True
        return False

    def require_pinned(self) -> None:
        """Raise `UnpinnedCacheError` naming every layer that is not pinned."""
        missing = self.unpinned()
        if missing:
            names = ", ".join(f"{layer.describe()} is {type(layer.state).__name__}" for layer in missing)
            msg = (
                f"{len(missing)} of {len(self.storage_layers)} cache layers are not pinned: {names}. Pin them before "
                "compiled decoding with CacheLifecycle.pin(...) or cachelife.prepare_static_cache(...)."
            )
            raise UnpinnedCacheError(msg)

    def pin(self, *, batch_size: int, shapes: CacheShapes, dtype: torch.dtype, device: Devices) -> None:
        """Pin every unallocated layer; check that already pinned layers match the same request.

        `device` is one device for all layers, or one per layer in `layers` order. Nothing changes unless
        every layer can be pinned: the request is checked first, and layers pinned by this call are
        released again if a later one fails (out of memory, say).
        """
        self.pin_specs(self.specs_for(batch_size=batch_size, shapes=shapes, dtype=dtype, device=device))

    def specs_for(
        self, *, batch_size: int, shapes: CacheShapes, dtype: torch.dtype, device: Devices
    ) -> list[PinSpec | None]:
        """One checked `PinSpec` per layer, in `layers` order, for a `pin` request; None for `NoStorage` layers,
        whose entry in `shapes` is skipped (it is there only so that indices line up with decoder layers)."""
        counts = (len(self._self_attention), len(self._cross_attention))
        given = (len(shapes.self_attention), len(shapes.cross_attention))
        if counts != given:
            msg = (
                f"the cache has {counts[0]} self-attention and {counts[1]} cross-attention layers, but the "
                f"shapes describe {given[0]} and {given[1]}; build the cache from the same model config"
            )
            raise CacheShapeError(msg)
        check_int("batch_size", batch_size, error=CacheShapeError)
        devices = _per_layer_devices(device, len(self.layers))
        layer_shapes: list[LayerShape] = [*shapes.self_attention, *shapes.cross_attention]
        return [
            None
            if isinstance(layer.state, NoStorage)
            else PinSpec(
                batch_size=batch_size,
                num_kv_heads=shape.num_kv_heads,
                key_head_dim=shape.key_head_dim,
                value_head_dim=shape.value_head_dim,
                dtype=dtype,
                device=dev,
            )
            for layer, shape, dev in zip(self.layers, layer_shapes, devices, strict=True)
        ]

    def pin_specs(
        self, specs: Sequence[PinSpec | None], reuse: Sequence[Mapping[str, torch.Tensor]] | None = None
    ) -> None:
        """`pin` with one spec per layer (None exactly for `NoStorage` layers), and optionally the tensors to
        reuse for each (from a pool)."""
        if len(specs) != len(self.layers):
            msg = f"got {len(specs)} pin specs for {len(self.layers)} cache layers; give one per layer"
            raise CacheShapeError(msg)
        for layer, spec in zip(self.layers, specs, strict=True):
            if (spec is None) != isinstance(layer.state, NoStorage):
                msg = (
                    f"{layer.describe()} is {type(layer.state).__name__} but its pin spec is {spec!r}; "
                    "expected None for a layer without storage and a PinSpec for every other layer"
                )
                raise CacheShapeError(msg)
            if spec is not None:
                check_fits(layer, Need.of_spec(spec), request="pin")
        pinned_here: list[LayerLifecycle] = []
        try:
            for index, (layer, spec) in enumerate(zip(self.layers, specs, strict=True)):
                if isinstance(layer.state, Unallocated) and spec is not None:
                    layer.pin(spec, None if reuse is None else reuse[index])
                    pinned_here.append(layer)
        except BaseException:
            for layer in reversed(pinned_here):
                layer.release()
            raise

    def fill(self, record: FillRecord, *, cross: bool | None = None) -> None:
        """Record content in every pinned layer (or only the self- or cross-attention ones); `NoStorage` and
        unallocated layers stay as they are."""
        chosen = {None: self.layers, False: self._self_attention, True: self._cross_attention}[cross]
        for layer in chosen:
            if isinstance(layer.state, Pinned):
                layer.fill(record)

    def reset(self) -> None:
        """Empty every pinned layer in place, keeping its addresses; unallocated and `NoStorage` layers stay so.

        All or nothing: every pinned layer is checked first (its live tensors are still the recorded ones, else
        `ReplacedBuffersError`; not inside a compiled region), and no layer is zeroed unless all pass.
        """
        pinned = [layer for layer in self.layers if layer.is_pinned]
        for layer in pinned:
            layer.check("reset")
        for layer in pinned:
            layer.reset(checked=True)

    def release(self) -> None:
        """Drop every layer's buffers; the cache is back to lazy allocation (`NoStorage` layers stay so).

        All or nothing: every pinned layer is checked first (it still exists; not inside a compiled region),
        and none is released unless all pass. Buffers replaced outside cachelife are released like any others:
        releasing, then pinning again, is the way out of `ReplacedBuffersError`.
        """
        pinned = [layer for layer in self.layers if layer.is_pinned]
        for layer in pinned:
            layer.check("release")
        for layer in pinned:
            layer.release()


def _pinned_tensors(layer: LayerLifecycle) -> Watched:
    keys, values, length = layer.buffers.tensors  # a pinned layer records exactly these three
    return layer.layer, keys, values, length


_REGISTRY: weakref.WeakKeyDictionary[Cache, CacheLifecycle] = weakref.WeakKeyDictionary()


def lifecycle(cache: object) -> CacheLifecycle:
    """The lifecycle of a `StaticCache` or `EncoderDecoderCache`, adopting its layers on first use.

    Layers already holding buffers are adopted as they are (`Pinned` or `Filled`); layers or sub-caches
    replaced since the last call get fresh lifecycles, so the view always matches the cache.
    """
    top, own, cross = static_parts(cache)
    ids = tuple(id(obj) for part in (own, cross) if part is not None for obj in (part, *part.layers))
    known = _REGISTRY.get(top)
    if known is not None and known._layer_ids == ids:
        return known
    fresh = _build(own, cross, top if is_encoder_decoder_cache(top) else None, ids, known)
    _REGISTRY[top] = fresh
    return fresh


def static_parts(cache: object) -> tuple[ManagedCache, StaticCache, StaticCache | None]:
    """The cache itself, its static self-attention cache and, for an `EncoderDecoderCache`, its static
    cross-attention cache. Raises `UnsupportedCacheError` for any other cache, naming what it got.
    """
    if is_static_cache(cache):
        return cache, cache, None
    if is_encoder_decoder_cache(cache):
        own, cross = cache.self_attention_cache, cache.cross_attention_cache
        if is_static_cache(own) and is_static_cache(cross):
            return cache, own, cross
        if is_static_cache(own):
            msg = (
                "the EncoderDecoderCache has a static self-attention cache but a "
                f"{type(cross).__name__} cross-attention cache; both must be StaticCache for compiled "
                "decoding (cachelife.prepare_static_cache builds such a pair)"
            )
            raise UnsupportedCacheError(msg)
    msg = (
        f"cachelife manages a StaticCache or an EncoderDecoderCache of StaticCaches, got "
        f"{_describe_cache(cache)}; use cache_implementation='static' or cachelife.prepare_static_cache"
    )
    raise UnsupportedCacheError(msg)


def _build(
    own: StaticCache,
    cross: StaticCache | None,
    owner: EncoderDecoderCache | None,
    ids: tuple[int, ...],
    known: CacheLifecycle | None,
) -> CacheLifecycle:
    previous = () if known is None else known.layers
    # The layers kept from `known` count their transitions in its count: the new ones join it.
    count = TransitionCount() if known is None else known.transitions

    def adopt(layer: object, index: int, role: Role) -> LayerLifecycle:
        for kept in previous:
            if kept.tracks(layer) and kept.role == role and kept.index == index:
                return kept
        cross_owner = owner if role == "cross" else None
        return LayerLifecycle.adopt(layer, index=index, role=role, owner=cross_owner, count=count)

    return CacheLifecycle(
        self_attention=tuple(adopt(layer, i, "self") for i, layer in enumerate(own.layers)),
        cross_attention=()
        if cross is None
        else tuple(adopt(layer, i, "cross") for i, layer in enumerate(cross.layers)),
        layer_ids=ids,
        transitions=count,
    )


def _per_layer_devices(device: Devices, count: int) -> list[torch.device]:
    if isinstance(device, torch.device | str):
        return [resolve_device(device)] * count
    devices = [resolve_device(d) for d in device]
    if len(devices) != count:
        msg = f"got {len(devices)} devices for {count} cache layers; give one device or one per layer"
        raise CacheShapeError(msg)
    return devices


def _describe_cache(cache: object) -> str:
    if is_encoder_decoder_cache(cache):
        return (
            f"an EncoderDecoderCache of {type(cache.self_attention_cache).__name__} and "
            f"{type(cache.cross_attention_cache).__name__}"
        )
    return f"a {type(cache).__name__}"
