"""CUDA graphs of the decoding step, captured and replayed by cachelife itself.

torch.compile's "reduce-overhead" mode replays a graph on every call of the compiled function through
cudagraph trees, whose host work per call (dynamo's frame, the runtime wrappers, checks and copies of the
inputs, bookkeeping of the outputs) can outlast the GPU's work on a decoding step. Here the step is compiled
without CUDA graphs, and `steps_per_call` calls of it are captured once in one
`torch.cuda.CUDAGraph`, then replayed with one `replay()` per `steps_per_call` steps and no Python per step.
Several steps per graph need no unrolled compilation either.

A graph reads and writes fixed addresses, so each model keeps its graphs under a key of everything a call
passes: the addresses, shapes, strides and dtypes of what the step updates in place or reads as it is (state
buffers, caches, the encoder output, the model's parameters), and the structure (shapes, dtypes, non-tensor
values) of its settings (processors, end tokens, lengths), whose tensor values may differ from call to call:
they are copied into the captured settings' tensors before the first replay. A call with other addresses or
other settings' structure captures a new graph. The graphs, and the memory pool they share, belong to the
model's runtime (`cachelife.integration.runtime`), which keeps the most recently used; captures run under its
process-wide `FIRST_CALLS` lock, on one capture stream per device.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import attrs
import torch
from attrs import define, frozen

from cachelife.integration.runtime import FIRST_CALLS, runtime_of

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger(__name__)


class Graph(Protocol):
    def replay(self) -> None: ...


# (warm-up, calls, device, memory pool) -> graph
Capture = Callable[[Callable[[], None], Callable[[], None], torch.device, "_POOL_HANDLE | None"], Graph]


def capture_cuda(
    warm_up: Callable[[], None], calls: Callable[[], None], device: torch.device, pool: _POOL_HANDLE | None
) -> Graph:
    """`warm_up` run on the capture stream, then `calls` captured in one CUDA graph there. The warm-up runs
    the compiled step once, so that what a capture must not do happens before it (compilation, autotuning,
    lazy initialisation, the matrix-product library's workspace for this stream)."""
    stream, before = _capture_stream(device), torch.cuda.current_stream(device)
    stream.wait_stream(before)
    with torch.cuda.stream(stream):
        warm_up()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            calls()
    except BaseException:
        _end_failed_capture(device, graph, pool, before)
        raise
    before.wait_stream(stream)
    return graph


def _end_failed_capture(
    device: torch.device, graph: torch.cuda.CUDAGraph, pool: _POOL_HANDLE | None, stream: torch.cuda.Stream
) -> None:
    """Undo what a failed capture leaves behind, so that the process's later captures can succeed. When the
    capture was invalidated, torch's `capture_end` raises before it stops routing the thread's allocations
    to the graph's memory pool (every later capture then fails with "already recording to mempool_id") and
    before `torch.cuda.graph` gives the thread its `stream` back (later work would run on the capture stream)."""
    try:
        torch._C._cuda_endAllocateToPool(_index(device), pool if pool is not None else graph.pool())
    except RuntimeError:  # the capture had ended it (a torch that ends it before raising, or no capture began)
        logger.debug("cachelife: the failed capture's memory pool was not recording", exc_info=True)
    torch.cuda.set_stream(stream)


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    # Called under FIRST_CALLS: one capture at a time uses a device's capture stream.
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch leaves it untyped
    return _STREAMS[device]


# How graphs are captured, and on which device types: CUDA, and in tests a stand-in that records the calls.
capture: Capture = capture_cuda
CAPTURING_DEVICES = frozenset({"cuda"})


@frozen
class Leaves:
    """What a call passes, flattened: its tensors and a hashable description of everything else."""

    tensors: tuple[torch.Tensor, ...]
    structure: tuple[object, ...]

    @classmethod
    def of(cls, root: object) -> Leaves:
        tensors: list[torch.Tensor] = []
        structure: list[object] = []
        _walk(root, tensors, structure, set())
        return cls(tuple(tensors), tuple(structure))

    def addresses(self) -> tuple[object, ...]:
        return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) for t in self.tensors)

    def layout(self) -> tuple[object, ...]:
        return tuple((t.shape, t.stride(), t.dtype, t.device) for t in self.tensors)


def _walk(node: object, tensors: list[torch.Tensor], structure: list[object], seen: set[int]) -> None:  # noqa: PLR0911 (one case per kind of node)
    if isinstance(node, torch.Tensor):
        tensors.append(node)
        structure.append(torch.Tensor)
        return
    if node is None or isinstance(node, bool | int | float | str | torch.dtype | torch.device | type):
        structure.append(node)
        return
    if id(node) in seen:
        structure.append(("seen", type(node)))
        return
    seen.add(id(node))
    if isinstance(node, torch.nn.Module):
        structure.append(torch.nn.Module)
        tensors.extend(node.parameters())
        tensors.extend(node.buffers())
        return
    if isinstance(node, dict):
        structure.append((dict, tuple(node)))
        for value in node.values():
            _walk(value, tensors, structure, seen)
        return
    if isinstance(node, list | tuple):
        structure.append((type(node), len(node)))
        for value in node:
            _walk(value, tensors, structure, seen)
        return
    structure.append(type(node))
    if attrs.has(type(node)):
        for field in attrs.fields(type(node)):  # type: ignore[arg-type]  # attrs.has narrows no type
            if not field.metadata.get("host_only", False):
                _walk(getattr(node, field.name), tensors, structure, seen)
        return
    if type(node).__module__.startswith("transformers."):  # caches, layers, logits processors
        _walk(vars(node), tensors, structure, seen)
    # anything else (functions, cachelife's lifecycle objects): its type only


@define(kw_only=True)
class Captured:
    """One graph, the settings it was captured with (kept alive: the graph reads their tensors' addresses)
    and the call that replays it now (weakly: a finished call's caches go back to their pool)."""

    graph: Graph
    settings: object
    tensors: tuple[torch.Tensor, ...]
    current: Callable[[], GraphedSteps | None]


def captures_on(device: torch.device) -> bool:
    return device.type in CAPTURING_DEVICES


@define(kw_only=True)
class GraphedSteps:
    """`calls` calls of one step, replayed from a graph of `model` (see the module docstring).

    `call(index, settings)` runs the step once, the index-th of a graph, with `settings` (this call's or
    the captured ones); `in_place` is what the step updates or reads as it is (it must keep its addresses),
    `settings` what it reads and may differ in value from call to call. `rewind`, if given, undoes the
    warm-up's effect before the capture (a prefill's cache, whose host-side flags decide what the model
    computes and so what is captured); the first call then replays the new graph. `live_settings` says that
    the caller changes the settings' tensors in place between calls (an engine's per-row fields): a found
    graph would read the captured tensors, so with it the settings are keyed by address, as `in_place` is."""

    model: object
    name: str
    call: Callable[[int, object], None]
    calls: int
    in_place: object
    settings: object
    device: torch.device
    rewind: Callable[[], None] | None = None
    live_settings: bool = False
    _replay: Callable[[], None] | None = None

    def advance(self) -> int:
        """Run steps: the first time without a graph for this call's key, one eager step and the capture;
        else one replay of `calls` steps. Returns the number of steps run."""
        if self._replay is not None:
            self._replay()
            return self.calls
        runtime = runtime_of(self.model)
        settings = Leaves.of(self.settings)
        where = settings.addresses() if self.live_settings else settings.layout()
        key = (self.name, self.calls, Leaves.of(self.in_place).addresses(), settings.structure, where)
        found = runtime.graphs.get(key)
        if isinstance(found, Captured):
            for captured, value in zip(found.tensors, settings.tensors, strict=True):
                if captured.data_ptr() != value.data_ptr():
                    captured.copy_(value)
            found.current = weakref.ref(self)
            self._replay = found.graph.replay
            return self.advance()
        entry = Captured(
            graph=_NOT_CAPTURED, settings=self.settings, tensors=settings.tensors, current=weakref.ref(self)
        )
        ended = f"a {self.name} graph of {type(self.model).__name__} replayed after its call ended"

        def calls() -> None:  # run at capture (a stand-in graph runs it at every replay); holds no call's objects
            current = entry.current()
            if current is None:
                raise RuntimeError(ended)
            for index in range(current.calls):
                current.call(index, entry.settings)

        def warm_up() -> None:
            self.call(0, self.settings)
            if self.rewind is not None:
                self.rewind()

        with FIRST_CALLS:
            if runtime.graph_memory is None and self.device.type == "cuda":
                runtime.graph_memory = torch.cuda.graph_pool_handle()
            memory = runtime.graph_memory
            entry.graph = capture(warm_up, calls, self.device, memory)  # type: ignore[arg-type]  # a graph_pool_handle
        runtime.graphs.put(key, entry)
        runtime.captures += 1
        logger.debug(
            "captured a graph of %d %s step(s) for %s (%d captured, %d kept)",
            self.calls, self.name, type(self.model).__name__, runtime.captures, len(runtime.graphs),
        )  # fmt: skip
        self._replay = entry.graph.replay
        if self.rewind is not None:  # the warm-up's step was undone: run it from the graph
            return self.advance()
        return 1


class _NotCaptured:
    def replay(self) -> None:
        msg = "replay of a graph that is being captured"
        raise RuntimeError(msg)


_NOT_CAPTURED = _NotCaptured()
