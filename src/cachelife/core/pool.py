"""Pinned buffers kept across `generate` calls, so compiled decoding sees the same addresses every time.

transformers builds a fresh static cache for every `generate` call. Fresh buffers get new addresses, and
CUDA graphs re-record (or, for cachelife's own graphs, are captured again) whenever their static inputs moved.
The pool hands the buffers a cache pinned last time to the next cache of the same shape:
`CachePool.pin(cache, specs)` leases a set, pins the new cache's layers with those tensors, zeroed in place
(`CacheLifecycle.pin_specs(..., reuse=...)`), and lends the set to the cache.

A set lent to a cache is the cache's while the cache lives. When the cache is garbage-collected the set comes
back, but it is reused only once nothing outside the pool reaches any of its tensors: a caller that keeps
`k = out.past_key_values.layers[0].keys`, a view of it, or the whole cache keeps that set out of use (checked at
each lease from the tensors' reference counts and their storages' use counts, exact in CPython; no garbage
collection is run). Returned sets are kept up to `budget_bytes`, least recently returned evicted first;
`clear()` drops them all.
"""

from __future__ import annotations

import logging
import sys
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


def _outside_references(tensor: torch.Tensor) -> tuple[int, int]:
    """The tensor's Python reference count and its storage's use count, as seen from here."""
    use_count = torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
    return sys.getrefcount(tensor), int(use_count)


def _unreached_baseline() -> tuple[int, int]:
    """What `_outside_references` reads for a tensor that only a `BufferSet` mapping holds."""
    holder = {"keys": torch.zeros(1)}
    return _outside_references(holder["keys"])


_UNREACHED = _unreached_baseline()


def is_unreached(entry: BufferSet) -> bool:
    """Whether only the pool reaches `entry`'s tensors: no other reference to any of them or to their storage
    (a cache, a caller's variable, a view)."""
    for layer in entry.tensors:
        for name in layer:
            counts = _outside_references(layer[name])
            if counts[0] > _UNREACHED[0] or counts[1] > _UNREACHED[1]:
                return False
    return True


@define(eq=False, kw_only=True)
class CachePool:
    """Idle pinned buffer sets by shape, under a byte budget, least recently used evicted first."""

    budget_bytes: int = DEFAULT_BUDGET_BYTES
    hits: int = 0
    misses: int = 0
    # Sets whose cache is gone, least recently returned first (a caller may still reach some of their tensors).
    _returned: OrderedDict[int, BufferSet] = field(factory=OrderedDict, alias="returned")
    _lock: threading.Lock = field(factory=threading.Lock, alias="lock")

    @property
    def idle_bytes(self) -> int:
        """Bytes held by sets whose cache is gone (lent sets belong to their caches)."""
        with self._lock:
            return sum(entry.nbytes for entry in self._returned.values())

    @property
    def idle_sets(self) -> int:
        """Sets whose cache is gone, free for the next cache of their shape once nothing else reaches them."""
        with self._lock:
            return len(self._returned)

    def __repr__(self) -> str:
        return (
            f"CachePool({self.idle_sets} idle set(s), {self.idle_bytes} of {self.budget_bytes} bytes, "
            f"{self.hits} hit(s), {self.misses} miss(es))"
        )

    def pin(self, cache: ManagedCache, specs: Sequence[PinSpec | None]) -> CacheLifecycle:
        """Pin `cache` for `specs` (one per layer, as `CacheLifecycle.pin_specs` takes them) with the buffers
        of a free set of the same shape if there is one, else new ones, and lend that set to the cache until
        it is garbage-collected. If pinning fails, a leased set goes back. A cache with a layer pinned
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
        """Take the most recently returned set of this shape that nothing outside the pool reaches, if any."""
        with self._lock:
            found = None
            for identity in reversed(self._returned):
                entry = self._returned[identity]
                if entry.key == key and is_unreached(entry):
                    found = self._returned.pop(identity)
                    break
            if found is None:
                self.misses += 1
            else:
                self.hits += 1
            return found

    def lend(self, owner: object, entry: BufferSet) -> None:
        """Mark `entry` as used by `owner` (a cache); it comes back when `owner` is collected."""
        weakref.finalize(owner, self.give_back, entry)

    def clear(self) -> None:
        """Drop every returned set (memory goes back to PyTorch's allocator); lent sets are untouched."""
        with self._lock:
            self._returned.clear()

    def give_back(self, entry: BufferSet) -> None:
        """Return a set whose cache is gone, evicting the least recently returned beyond the budget."""
        with self._lock:
            if self.budget_bytes <= 0 or entry.nbytes > self.budget_bytes:
                return
            self._returned[id(entry)] = entry
            total = sum(returned.nbytes for returned in self._returned.values())
            while total > self.budget_bytes:
                _, evicted = self._returned.popitem(last=False)
                total -= evicted.nbytes
                logger.debug("pool: evicted a buffer set of %d bytes (budget %d)", evicted.nbytes, self.budget_bytes)
