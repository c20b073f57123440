"""Pinned buffers kept across `generate` calls, so compiled decoding sees the same addresses every time.

transformers builds a fresh static cache for every `generate` call. Fresh buffers get new addresses, and
CUDA-graph trees re-record every graph whose static inputs moved. The pool hands the buffers a cache
pinned last time to the next cache of the same shape: `CachePool.pin(cache, specs)` leases a set, pins the
new cache's layers with those tensors, zeroed in place (`CacheLifecycle.pin_specs(..., reuse=...)`), and
lends the set to the cache.

A buffer set is leased to one cache at a time and comes back when that cache object is garbage-collected,
so a cache a caller keeps (returned by `generate(..., return_dict_in_generate=True)`, say) is never
overwritten: the next call gets other buffers. Idle sets are kept up to `budget_bytes`, least recently
used evicted first; `clear()` drops them all.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TypeAlias

import torch
from attrs import define, field, frozen

from cachelife.core import buffers
from cachelife.core.buffers import PinSpec
from cachelife.core.cache_lifecycle import CacheLifecycle, ManagedCache, lifecycle
from cachelife.core.layer_lifecycle import Unallocated

logger = logging.getLogger(__name__)

# Per layer: (layer class, key shape, value shape, dtype, device).
PoolKey: TypeAlias = tuple[tuple[str, tuple[int, ...], tuple[int, ...], str, str], ...]

DEFAULT_BUDGET_BYTES = 4 * 1024**3


@frozen(eq=False)
class BufferSet:
    """The static tensors of every layer of one pinned cache, in `CacheLifecycle.layers` order."""

    key: PoolKey
    tensors: tuple[Mapping[str, torch.Tensor], ...]
    nbytes: int

    @classmethod
    def of(cls, key: PoolKey, state: CacheLifecycle) -> BufferSet:
        tensors = tuple(
            dict(buffers.static_tensors(layer.layer)) if layer.holds_storage else {} for layer in state.layers
        )
        size = sum(t.numel() * t.element_size() for layer in tensors for t in layer.values())
        return cls(key, tensors, size)


def pool_key(state: CacheLifecycle, specs: Sequence[PinSpec | None]) -> PoolKey:
    """What a buffer set must match to be reused for this pin request (a layer without storage, spec None,
    holds its place with empty shapes)."""
    key: list[tuple[str, tuple[int, ...], tuple[int, ...], str, str]] = []
    for layer, spec in zip(state.layers, specs, strict=True):
        if spec is None:
            key.append(("NoStorage", (), (), "-", "-"))
            continue
        length = layer.capacity or 0
        key.append(
            (
                type(layer.layer).__name__,
                (spec.batch_size, spec.num_kv_heads, length, spec.key_head_dim),
                (spec.batch_size, spec.num_kv_heads, length, spec.value_head_dim),
                str(spec.dtype),
                str(spec.device),
            )
        )
    return tuple(key)


@define(eq=False)
class CachePool:
    """Idle pinned buffer sets by shape, under a byte budget, least recently used evicted first."""

    budget_bytes: int = DEFAULT_BUDGET_BYTES
    hits: int = 0
    misses: int = 0
    _idle: OrderedDict[int, BufferSet] = field(factory=OrderedDict, alias="idle")
    # Buffer sets lent to caches that are still alive, by shape.
    _lent: dict[PoolKey, int] = field(factory=dict, alias="lent")
    _lock: threading.Lock = field(factory=threading.Lock, alias="lock")

    @property
    def idle_bytes(self) -> int:
        """Bytes held by idle buffer sets (leased sets belong to their caches)."""
        with self._lock:
            return sum(entry.nbytes for entry in self._idle.values())

    @property
    def idle_sets(self) -> int:
        with self._lock:
            return len(self._idle)

    def pin(self, cache: ManagedCache, specs: Sequence[PinSpec | None]) -> CacheLifecycle:
        """Pin `cache` for `specs` (one per layer, as `CacheLifecycle.pin_specs` takes them) with the buffers
        of an idle set of the same shape if there is one, else new ones, and lend that set to the cache until
        it is garbage-collected. If pinning fails, a leased set goes back idle. A cache with a layer pinned
        already is pinned without the pool: its buffers are not one set."""
        state = lifecycle(cache)
        if not all(isinstance(layer.state, Unallocated) for layer in state.storage_layers):
            state.pin_specs(specs)
            return state
        key = pool_key(state, specs)
        entry = self.lease(key)
        try:
            state.pin_specs(specs, None if entry is None else entry.tensors)
        except BaseException:
            if entry is not None:
                self.give_back(entry)
            raise
        self.lend(cache, entry if entry is not None else BufferSet.of(key, state))
        return state

    def lease(self, key: PoolKey) -> BufferSet | None:
        """Take the most recently returned idle set of this shape, if any.

        When none is idle but a set of this shape is still lent, its cache may be garbage kept only by
        reference cycles: a `torch.compile` trace keeps the objects it traced (the cache among them) in
        cycles until the collector runs, so right after a compilation the previous call's cache is not
        yet returned. One `gc.collect()` then gives it back, instead of re-recording every CUDA graph on
        new addresses. It runs only on such a miss, never in steady state.
        """
        entry = self._take(key)
        if entry is None and self._lent.get(key, 0) > 0:
            gc.collect()
            entry = self._take(key)
        with self._lock:
            if entry is None:
                self.misses += 1
            else:
                self.hits += 1
        return entry

    def _take(self, key: PoolKey) -> BufferSet | None:
        with self._lock:
            for identity in reversed(self._idle):
                if self._idle[identity].key == key:
                    return self._idle.pop(identity)
            return None

    def lend(self, owner: object, entry: BufferSet) -> None:
        """Mark `entry` as used by `owner` (a cache); it returns to the pool when `owner` is collected."""
        with self._lock:
            self._lent[entry.key] = self._lent.get(entry.key, 0) + 1
        weakref.finalize(owner, self.give_back, entry)

    def clear(self) -> None:
        """Drop every idle set (memory goes back to PyTorch's allocator); leased sets are untouched."""
        with self._lock:
            self._idle.clear()

    def give_back(self, entry: BufferSet) -> None:
        """Return a set to the idle list (it must no longer be used), evicting beyond the budget."""
        with self._lock:
            self._lent[entry.key] = max(0, self._lent.get(entry.key, 0) - 1)
            if self.budget_bytes <= 0 or entry.nbytes > self.budget_bytes:
                return
            self._idle[id(entry)] = entry
            total = sum(idle.nbytes for idle in self._idle.values())
            while total > self.budget_bytes:
                _, evicted = self._idle.popitem(last=False)
                total -= evicted.nbytes
                logger.debug(
                    "pool: evicted an idle buffer set of %d bytes (budget %d)", evicted.nbytes, self.budget_bytes
                )
