"""The one owner of a model's runtime state: everything cachelife keeps for a model between calls.

A model's `ModelRuntime` holds
- the pool of idle pinned cache buffers (enabled models; `cachelife.core.pool`),
- the fast loop's state buffers (tokens, beams, noise, static copies of the encoder output and mask), each set
  leased to one call at a time and kept afterwards for the next call of its shape,
- the CUDA graphs cachelife captured and the memory pool they share,
- the compiled step functions, and the warnings given once per model,
- the lock that lets one decoding call at a time use all of the above.

`release(model)` frees all of it (`cachelife.release`; `disable` releases too). Nothing else in cachelife keeps
per-model state: a model that is garbage-collected takes its runtime with it (the registry is weak), and a
deep copy of a model starts with a runtime of its own.

Threads: a `generate` call of an enabled model and `cachelife.generate` hold the model's lock for the whole
call, so calls on one model run one after another, in any threads; calls on different models run in parallel,
except for what `FIRST_CALLS` serialises (compiling a step for the first time and capturing a CUDA graph, which
share process-wide machinery).
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

import attrs
import torch
from attrs import define, field, frozen

from cachelife.core.pool import CachePool

logger = logging.getLogger(__name__)

V = TypeVar("V")
Key = tuple[object, ...]

STATES_KEPT = 24
"""State-buffer sets kept idle per model: a call leases up to three (its state, the encoder output, its mask)."""
GRAPHS_KEPT = 8
"""Captured graphs kept per model, the least recently used dropped first."""

FIRST_CALLS = threading.RLock()
"""Held around the first call of a newly compiled step and around every CUDA-graph capture, in every thread:
dynamo's compilation and a capture's stream and memory pool are not made for two threads at once."""


@define(eq=False)
class Kept(Generic[V]):
    """Values by key, at most `limit` of them, the least recently used dropped first."""

    limit: int
    _values: OrderedDict[Key, list[V]] = field(factory=OrderedDict, alias="values")

    def take(self, key: Key) -> V | None:
        """Remove and return the most recently put value of `key`, if any (a lease: it is the caller's now)."""
        found = self._values.get(key)
        if not found:
            return None
        value = found.pop()
        if not found:
            del self._values[key]
        return value

    def get(self, key: Key) -> V | None:
        """The most recently put value of `key`, left in place and marked as used."""
        found = self._values.get(key)
        if not found:
            return None
        self._values.move_to_end(key)
        return found[-1]

    def put(self, key: Key, value: V) -> None:
        self._values.setdefault(key, []).append(value)
        self._values.move_to_end(key)
        while len(self) > self.limit:
            oldest = next(iter(self._values))
            self._values[oldest].pop(0)
            if not self._values[oldest]:
                del self._values[oldest]

    def keys(self) -> tuple[Key, ...]:
        """The keys held, least recently used first."""
        return tuple(self._values)

    def values(self) -> Iterator[V]:
        for values in self._values.values():
            yield from values

    def clear(self) -> None:
        self._values.clear()

    def __len__(self) -> int:
        return sum(len(values) for values in self._values.values())


@frozen(kw_only=True)
class Released:
    """What `release` freed: bytes of tensors cachelife held (idle pool buffers, state buffers, captured
    graphs' settings), and how many graphs, compiled steps and warnings it forgot."""

    pool_bytes: int
    state_bytes: int
    graphs: int
    compiled_steps: int

    @property
    def nbytes(self) -> int:
        """Tensor bytes freed (a CUDA graph's private memory pool is freed too, and counted by torch alone)."""
        return self.pool_bytes + self.state_bytes


@define(eq=False, kw_only=True)
class ModelRuntime:
    """Everything cachelife keeps for one model between calls (see the module docstring)."""

    model_name: str
    pool: CachePool | None = None
    states: Kept[object] = field(factory=lambda: Kept(STATES_KEPT))
    graphs: Kept[object] = field(factory=lambda: Kept(GRAPHS_KEPT))
    # torch.cuda.graph_pool_handle() of the model's first capture, shared by all of its graphs.
    graph_memory: object | None = None
    captures: int = 0
    compiled: dict[Key, Callable[..., Any]] = field(factory=dict)
    warned: set[Key] = field(factory=set)
    lock: threading.RLock = field(factory=threading.RLock, repr=False)

    def pool_for(self, budget_bytes: int) -> CachePool | None:
        """The pool under this budget (made on first use; 0 means no pool, and drops an existing one)."""
        with self.lock:
            if budget_bytes == 0:
                self.pool = None
            elif self.pool is None:
                self.pool = CachePool(budget_bytes=budget_bytes)
            else:
                self.pool.budget_bytes = budget_bytes
            return self.pool

    def warn_once(self, key: Key) -> bool:
        """True the first time `key` is asked for on this model: give that warning now."""
        with self.lock:
            if key in self.warned:
                return False
            self.warned.add(key)
            return True

    def release(self) -> Released:
        """Free every buffer, graph, compiled step and warning this runtime holds; waits for a running call."""
        with self.lock:
            pool_bytes = 0 if self.pool is None else self.pool.idle_bytes
            if self.pool is not None:
                self.pool.clear()
            freed = Released(
                pool_bytes=pool_bytes,
                state_bytes=sum(tensor_bytes(value) for value in (*self.states.values(), *self.graphs.values())),
                graphs=len(self.graphs),
                compiled_steps=len(self.compiled),
            )
            self.states.clear()
            self.graphs.clear()
            self.graph_memory = None
            self.captures = 0
            self.compiled.clear()
            self.warned.clear()
        logger.debug(
            "released %s: %d bytes of buffers, %d graph(s), %d compiled step(s)",
            self.model_name, freed.nbytes, freed.graphs, freed.compiled_steps,
        )  # fmt: skip
        return freed

    def __repr__(self) -> str:
        pool = "off" if self.pool is None else f"{self.pool.idle_sets} idle set(s)"
        return (
            f"ModelRuntime({self.model_name}: pool {pool}, {len(self.states)} state set(s), "
            f"{len(self.graphs)} graph(s), {len(self.compiled)} compiled step(s))"
        )


_RUNTIMES: weakref.WeakKeyDictionary[object, ModelRuntime] = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


def runtime_of(model: object) -> ModelRuntime:
    """The runtime of `model`, made empty on first use."""
    with _REGISTRY_LOCK:
        found = _RUNTIMES.get(model)
        if found is None:
            found = _RUNTIMES[model] = ModelRuntime(model_name=type(model).__name__)
        return found


def existing_runtime(model: object) -> ModelRuntime | None:
    """The runtime of `model` if it has one (nothing is made)."""
    with _REGISTRY_LOCK:
        return _RUNTIMES.get(model)


def _compilations() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@contextmanager
def collecting_after_compilation() -> Iterator[None]:
    """Run the garbage collector once after a call in which dynamo compiled a graph: its traces keep the
    traced caches in reference cycles, which would keep their pooled buffers out of use until the collector
    ran by itself. A call that compiles nothing collects nothing (no collection on the hot path)."""
    before = _compilations()
    try:
        yield
    finally:
        if _compilations() != before:
            gc.collect()


def tensor_bytes(value: object, seen: set[int] | None = None) -> int:
    """Bytes of the distinct tensors in `value` (tensors, tuples, lists, dicts and attrs instances)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item, seen) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(item, seen) for item in value)
    if attrs.has(type(value)):
        names = [f.name for f in attrs.fields(type(value))]  # type: ignore[arg-type]  # attrs.has narrows no type
        return sum(tensor_bytes(getattr(value, name), seen) for name in names)
    return 0
