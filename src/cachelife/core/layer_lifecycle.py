"""The lifecycle of one cache layer: its states, its transitions, and nothing else.

Rules:
- Everything that changes a layer's lifecycle state lives in this module. A `LayerLifecycle` changes state
  only in its four transition methods (`pin`, `fill`, `reset`, `release`); callers read `.state`.
- The legal transitions are the table `TRANSITIONS`: (state, event) -> the state it enters. An event the table
  does not list for the current state raises `IllegalTransitionError` naming the layer, its role, the state and
  the fix, and changes nothing; a transition enters only the state the table names for it.
- A transition first checks everything that can refuse it (`LayerLifecycle.check`: legal, layer alive, not in a
  compiled region, buffers not replaced), then acts on the buffers (`cachelife.core.buffers`), then records the new
  state and logs one DEBUG line. If acting fails, the state stays as it was. Whole-cache operations run every
  layer's check before they act on any.
- Buffers are never allocated, marked or dropped inside a compiled or captured region.
- A layer that stores nothing by design (transformers' `DummyLayer`) is `NoStorage` for its whole life: the
  table lists no event from it, so every transition it is asked for raises; whole-cache operations skip it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import Final, Literal, TypeAlias

import torch
from attrs import define, field, frozen
from transformers.cache_utils import EncoderDecoderCache, StaticLayer

from cachelife.core import buffers, reorder
from cachelife.core.buffers import Buffers, PinSpec
from cachelife.errors import IllegalTransitionError, UnmarkedBuffersError, UnpinnedCacheError, UnsupportedCacheError

logger = logging.getLogger(__name__)

Role: TypeAlias = Literal["self", "cross"]
Event: TypeAlias = Literal["pin", "fill", "reset", "release"]


@frozen
class Unallocated:
    """No storage yet: unless pinned first, the layer allocates lazily on its first update."""


@frozen
class NoStorage:
    """Stores no keys or values by design (transformers' `DummyLayer`: a KV-sharing consumer, or a layer without
    attention); nothing to pin, fill, reset or release, and never blocking a cache from being pinned."""


@frozen
class Pinned:
    """Buffers allocated at their final shape, dtype and device, marked static, holding no content."""

    buffers: Buffers


@frozen
class FillRecord:
    """What first wrote content into a pinned layer."""

    source: str
    # Positions that first write covered, when known.
    positions: int | None = None
    # Whether the write ran inside a compiled function; None when cachelife did not see it.
    compiled: bool | None = None


@frozen
class Filled:
    """Pinned buffers that hold content."""

    buffers: Buffers
    filled_by: FillRecord


LayerState: TypeAlias = Unallocated | Pinned | Filled | NoStorage

TRANSITIONS: Final[Mapping[tuple[type[LayerState], Event], type[LayerState]]] = {
    (Unallocated, "pin"): Pinned,
    (Pinned, "fill"): Filled,
    (Filled, "reset"): Pinned,
    # Resetting an empty layer zeroes it again; it keeps the call idempotent for pools and loops.
    (Pinned, "reset"): Pinned,
    (Pinned, "release"): Unallocated,
    (Filled, "release"): Unallocated,
    # NoStorage has no entry: it is final from adoption on.
}

_NO_STORAGE_FIX: Final = (
    "it stores no keys or values (transformers' DummyLayer); CacheLifecycle operations skip such layers"
)

_FIXES: Final[Mapping[tuple[type[LayerState], Event], str]] = {
    (Pinned, "pin"): "it is already pinned; CacheLifecycle.pin() skips pinned layers",
    (Filled, "pin"): "it is already pinned and holds content; call reset() to empty it in place",
    (Unallocated, "fill"): "pin it first, outside any compiled region",
    (Filled, "fill"): "it already holds content; reset() it before filling it again",
    (Unallocated, "reset"): "it holds no buffers to reset; pin it first",
    (Unallocated, "release"): "it holds no buffers to release",
    **{(NoStorage, event): _NO_STORAGE_FIX for event in ("pin", "fill", "reset", "release")},
}


@define(eq=False)
class TransitionCount:
    """How many transitions the layers of one cache have made: a cache's verdicts on its layers (pinned? filled?
    tensors replaced?) hold until it changes. A cache hands its own to every layer it adopts."""

    value: int = 0


@define(eq=False, kw_only=True)
class LayerLifecycle:
    """The lifecycle of one transformers cache layer: which buffers it holds and whether they are pinned.

    Holds the layer weakly: the cache owns its layers, and a dropped cache frees its buffers at once.
    """

    index: int
    role: Role
    # A StaticLayer, or a DummyLayer (state NoStorage).
    _layer: weakref.ReferenceType[object] = field(alias="layer")
    _owner: weakref.ReferenceType[EncoderDecoderCache] | None = field(alias="owner")
    _state: LayerState = field(alias="state")
    _count: TransitionCount = field(alias="count")

    @classmethod
    def adopt(
        cls, layer: object, *, index: int, role: Role, owner: EncoderDecoderCache | None = None,
        count: TransitionCount | None = None,
    ) -> LayerLifecycle:  # fmt: skip
        """Start tracking a transformers layer, deriving its state from the storage it holds now; `count` is the
        owning cache's `TransitionCount` (a layer adopted alone counts for itself).

        A layer with content that was never seen by cachelife is `Filled`; reading a full-attention
        layer's length for that costs one host-device synchronisation, here only, never per step.
        """
        who = f"layer {index} ({role}-attention)"
        count = TransitionCount() if count is None else count
        if buffers.is_storage_less_layer(layer):
            adopted = cls(index=index, role=role, layer=weakref.ref(layer), owner=None, state=NoStorage(), count=count)
            logger.debug(
                "layer=%d role=%s adopt: NoStorage (%s stores no keys or values)", index, role, type(layer).__name__
            )
            return adopted
        if not buffers.is_static_layer(layer):
            msg = (
                f"{who} is a {type(layer).__name__}; cachelife pins static caches whose layers are "
                "transformers' StaticLayer or StaticSlidingWindowLayer. Use cache_implementation='static'."
            )
            raise UnsupportedCacheError(msg)
        if not buffers.is_plain_static_layer(layer):
            msg = (
                f"{who} is a {type(layer).__name__}, a StaticLayer subclass that may hold storage beyond keys "
                "and values (indexer or linear-attention state); cachelife pins StaticLayer and "
                "StaticSlidingWindowLayer only, and refuses the whole cache rather than pin part of it."
            )
            raise UnsupportedCacheError(msg)
        owner_ref = None if owner is None else weakref.ref(owner)
        state = _observed_state(layer, who, index, owner)
        if isinstance(state, Pinned | Filled):
            reorder.install(layer)
        return cls(index=index, role=role, layer=weakref.ref(layer), owner=owner_ref, state=state, count=count)

    @property
    def state(self) -> LayerState:
        """The layer's current state (a frozen value; compare or match on its class)."""
        return self._state

    @property
    def layer(self) -> StaticLayer:
        """The transformers layer this lifecycle tracks; a `NoStorage` layer has no `StaticLayer` to give."""
        layer = self._layer()
        if layer is None:
            msg = f"{self.describe()} no longer exists: its cache was garbage-collected"
            raise UnsupportedCacheError(msg)
        if not buffers.is_static_layer(layer):
            msg = f"{self.describe()} is a {type(layer).__name__}, not a StaticLayer: it has no buffers to give"
            raise UnsupportedCacheError(msg)
        return layer

    @property
    def buffers(self) -> Buffers:
        """The buffers of a pinned layer (`Pinned` or `Filled`) as recorded when it was pinned; any other state
        raises `UnpinnedCacheError` naming the layer, its role and its state."""
        state = self._state
        if isinstance(state, Pinned | Filled):
            return state.buffers
        if isinstance(state, NoStorage):
            fix = "it stores no keys or values (transformers' DummyLayer), so it never holds buffers"
        else:
            fix = "pin it first (CacheLifecycle.pin or cachelife.prepare_static_cache)"
        msg = f"{self.describe()} is {type(state).__name__} and holds no pinned buffers; {fix}"
        raise UnpinnedCacheError(msg)

    def tracks(self, layer: object) -> bool:
        """Whether this lifecycle tracks exactly that layer object."""
        return self._layer() is layer

    @property
    def is_pinned(self) -> bool:
        """Whether the layer holds static buffers (state `Pinned` or `Filled`)."""
        return isinstance(self._state, Pinned | Filled)

    @property
    def holds_storage(self) -> bool:
        """Whether the layer stores keys and values at all (every state but `NoStorage`)."""
        return not isinstance(self._state, NoStorage)

    @property
    def capacity(self) -> int | None:
        """How many positions the layer holds (its `max_cache_len`), or None if it is gone or stores nothing."""
        layer = self._layer()
        return layer.max_cache_len if buffers.is_static_layer(layer) else None

    @property
    def cross_content_written(self) -> bool:
        """For a cross-attention layer: whether the model has announced its encoder keys and values."""
        owner = None if self._owner is None else self._owner()
        return owner is not None and bool(owner.is_updated.get(self.index, False))

    def replaced_tensors(self) -> list[str]:
        """For a pinned layer: the names of the tensors it no longer holds (something assigned new ones behind
        the lifecycle's back); empty for every other state. An identity check, cheap enough for every step."""
        state = self._state
        if not isinstance(state, Pinned | Filled):
            return []
        return buffers.replaced_tensors(self.layer, state.buffers)

    def restore_buffers(self) -> None:
        """Move the content of replaced tensors back into the pinned ones, which the layer then holds again
        (same data pointers); the state is unchanged. Raises `ReplacedBuffersError`, changing nothing, when
        the replacements do not fit the pinned tensors."""
        state = self._state
        if not isinstance(state, Pinned | Filled):
            return
        names = self.replaced_tensors()
        if not names:
            return
        buffers.refuse_in_compiled_region("restore the buffers of", self.describe())
        buffers.restore(self.layer, state.buffers, self.describe())
        logger.debug(
            "layer=%d role=%s restore: %s were replaced; content copied back into the pinned tensors",
            self.index,
            self.role,
            ",".join(names),
        )

    def __repr__(self) -> str:
        state = self._state
        if isinstance(state, Pinned | Filled):
            shape = "x".join(map(str, state.buffers.key_shape))
            dtype = str(state.buffers.dtype).removeprefix("torch.")
            where = f"{shape} {dtype} on {state.buffers.device}"
            return f"<LayerLifecycle {self.index} {self.role}: {type(state).__name__} {where}>"
        return f"<LayerLifecycle {self.index} {self.role}: {type(state).__name__}>"

    def describe(self) -> str:
        """Name the layer for messages: index and role, and that it stores nothing if it is `NoStorage`."""
        if isinstance(self._state, NoStorage):
            return f"layer {self.index} ({self.role}-attention, no storage)"
        return f"layer {self.index} ({self.role}-attention)"

    # -- transitions -------------------------------------------------------------------------------------

    def check(self, event: Event) -> None:
        """Raise what `event` would raise before it acts, and change nothing: an illegal transition, a layer
        that no longer exists, a compiled or captured region, or (for reset) buffers replaced outside cachelife
        (`ReplacedBuffersError`). Whole-cache operations check every layer with it before changing any."""
        self._target(event)
        if event == "fill":
            return
        layer = self.layer
        buffers.refuse_in_compiled_region(event, self.describe())
        state = self._state
        if event == "reset" and isinstance(state, Pinned | Filled):
            buffers.check_unreplaced(layer, state.buffers, self.describe())

    def pin(self, spec: PinSpec, reuse: Mapping[str, torch.Tensor] | None = None) -> Pinned:
        """Give the layer static buffers at final shape, dtype and device: new ones, or `reuse` (tensors a
        pinned layer of the same shape held, from a pool), zeroed in place at their addresses."""
        self.check("pin")
        layer = self.layer
        new = Pinned(buffers.allocate(layer, spec, reuse))
        self._enter("pin", new, origin=" source=new" if reuse is None else " source=pool")
        return new

    def fill(self, record: FillRecord) -> Filled:
        """Record that the pinned buffers now hold content, and what wrote it."""
        self.check("fill")
        new = Filled(self.buffers, record)
        self._enter("fill", new)
        return new

    def reset(self, *, checked: bool = False) -> Pinned:
        """Empty the buffers in place, keeping every data pointer, so they can be filled again. `checked`: the
        caller has just run `check("reset")` (a whole cache checks every layer before it empties any)."""
        if not checked:
            self.check("reset")
        new = Pinned(self.buffers)
        buffers.zero(self.layer)
        self._forget_cross_content()
        self._enter("reset", new)
        return new

    def release(self) -> Unallocated:
        """Drop the buffers; the layer is back to lazy allocation, exactly as transformers builds it. Buffers
        replaced outside cachelife are dropped too: releasing is the way out of `ReplacedBuffersError`."""
        self.check("release")
        buffers.drop(self.layer)
        self._forget_cross_content()
        new = Unallocated()
        self._enter("release", new)
        return new

    # -- machinery ---------------------------------------------------------------------------------------

    def _target(self, event: Event) -> type[LayerState]:
        """The state `event` enters from the current one (`TRANSITIONS`); `IllegalTransitionError` if none."""
        target = TRANSITIONS.get((type(self._state), event))
        if target is None:
            raise self._illegal(event)
        return target

    def _illegal(self, event: Event) -> IllegalTransitionError:
        key = (type(self._state), event)
        fix = _FIXES.get(key, "see cachelife.core.layer_lifecycle.TRANSITIONS for the legal transitions")
        msg = f"cannot {event} {self.describe()}: it is {type(self._state).__name__}; {fix}"
        return IllegalTransitionError(msg)

    def _enter(self, event: Event, new: LayerState, origin: str = "") -> None:
        """Take `event` to `new`, which must be of the state `TRANSITIONS` names for it."""
        target = self._target(event)
        if type(new) is not target:
            msg = f"{event} of {self.describe()} leads to {target.__name__}, not {type(new).__name__} (TRANSITIONS)"
            raise IllegalTransitionError(msg)
        old = self._state
        self._state = new
        self._count.value += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s%s", describe_transition(self, event, old, new), origin)

    def _forget_cross_content(self) -> None:
        # A cross-attention layer's content is announced to the model by `EncoderDecoderCache.is_updated`;
        # an emptied layer must not be read as computed encoder keys and values.
        owner = None if self._owner is None else self._owner()
        if owner is not None and self.index in owner.is_updated:
            owner.is_updated[self.index] = False


def describe_transition(layer: LayerLifecycle, event: Event, old: LayerState, new: LayerState) -> str:
    """One greppable line: layer, role, event, from -> to, shapes, dtype, device, pointers, marks, region."""
    head = f"layer={layer.index} role={layer.role} {event}: {type(old).__name__} -> {type(new).__name__}"
    state = new if isinstance(new, Pinned | Filled) else old
    if not isinstance(state, Pinned | Filled):
        return head
    recorded = state.buffers
    live = layer.layer
    static = "yes" if all(buffers.is_marked_static(t) for _, t in buffers.static_tensors(live)) else "no"
    if isinstance(new, Filled):
        compiled = {True: "yes", False: "no", None: "unknown"}[new.filled_by.compiled]
        origin = f" by={new.filled_by.source} positions={new.filled_by.positions}"
    else:
        compiled = "no" if buffers.compiled_region() is None else "yes"
        origin = ""
    ptrs = ",".join(f"{name}=0x{ptr:x}" for name, ptr in recorded.data_ptrs)
    return (
        f"{head} keys={recorded.key_shape} values={recorded.value_shape} "
        f"dtype={str(recorded.dtype).removeprefix('torch.')} device={recorded.device} data_ptr={ptrs} "
        f"static={static if not isinstance(new, Unallocated) else 'released'} compiled={compiled}{origin}"
    )


def _observed_state(layer: StaticLayer, who: str, index: int, owner: EncoderDecoderCache | None) -> LayerState:
    recorded = buffers.observe(layer)
    if recorded is None:
        return Unallocated()
    unmarked = buffers.unmarked_tensors(layer)
    if unmarked:
        msg = (
            f"{who} holds buffers that were never marked static ({', '.join(unmarked)}): they were allocated "
            "lazily inside a compiled region, where transformers skips mark_static_address, and may live in "
            "the CUDA-graph memory pool. Build a fresh cache (cachelife.prepare_static_cache) instead."
        )
        raise UnmarkedBuffersError(msg)
    if owner is not None:
        written = bool(owner.is_updated.get(index, False))
        positions = recorded.key_shape[2] if written else 0
    elif buffers.is_sliding_layer(layer):
        positions = layer.cumulative_length_int
    else:
        positions = int(layer.cumulative_length)
    if positions == 0:
        return Pinned(recorded)
    return Filled(recorded, FillRecord("content found when cachelife adopted the cache", positions))
