"""The storage of one transformers cache layer: how it is allocated, marked static, zeroed and dropped.

These functions act on transformers' layer objects (`StaticLayer` and its sliding-window subclass) and know
their attributes; they hold no lifecycle state. `cachelife.core.layer_lifecycle` decides when each one may run.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from attrs import field, frozen
from transformers import cache_utils
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer
from typing_extensions import TypeIs

from cachelife.core import reorder
from cachelife.core.tracing import tracing_here
from cachelife.errors import CacheShapeError, CompiledRegionError, ReplacedBuffersError, UnsupportedCacheError

# transformers >= 5.24 fills the layers that store nothing (KV-sharing consumers, "moe"/"mlp" layer types) with
# a `DummyLayer`; older versions have no such class. Not in typings/: the stubs describe 5.17 as well.
_DUMMY_LAYER: type | None = getattr(cache_utils, "DummyLayer", None)

# Attributes `StaticLayer.lazy_initialization` adds; dropping the storage removes them again so a released
# layer looks exactly like one transformers has just built.
_INIT_ATTRIBUTES = ("device", "batch_size", "num_heads", "k_head_dim", "v_head_dim")


@frozen(kw_only=True)
class PinSpec:
    """What one layer's buffers must look like: everything but the sequence length, which the layer owns."""

    batch_size: int
    num_kv_heads: int
    key_head_dim: int
    value_head_dim: int
    dtype: torch.dtype
    device: torch.device


@frozen(kw_only=True)
class Buffers:
    """The storage a pinned layer holds, as recorded when it was pinned."""

    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    # (name, data pointer) of every tensor marked static, in a fixed order.
    data_ptrs: tuple[tuple[str, int], ...]
    # The tensors themselves, in the same order: what the layer must still hold (compared by identity, once
    # per decoding step) and what replaced tensors' content is copied back into.
    tensors: tuple[torch.Tensor, ...] = field(default=(), eq=False, repr=False)


def is_static_layer(layer: object) -> TypeIs[StaticLayer]:
    """Whether `layer` is a transformers static layer whose storage cachelife can manage."""
    return isinstance(layer, StaticLayer)


def is_storage_less_layer(layer: object) -> bool:
    """Whether `layer` is exactly transformers' `DummyLayer` (>= 5.24), which stores no keys or values by design."""
    return _DUMMY_LAYER is not None and type(layer) is _DUMMY_LAYER


def is_plain_static_layer(layer: StaticLayer) -> bool:
    """Whether the layer is exactly a `StaticLayer` or `StaticSlidingWindowLayer`, not a subclass with more storage."""
    return type(layer) in (StaticLayer, StaticSlidingWindowLayer)


def is_sliding_layer(layer: StaticLayer) -> TypeIs[StaticSlidingWindowLayer]:
    """Whether a static layer keeps only a sliding window of positions."""
    return isinstance(layer, StaticSlidingWindowLayer)


def compiled_region() -> str | None:
    """Name the compiled or captured region the caller is in, or None in plain eager code."""
    if tracing_here():
        return "while dynamo traces a compiled function"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "while a CUDA graph is being captured"
    return None


def refuse_in_compiled_region(action: str, who: str) -> None:
    """Raise `CompiledRegionError` if buffers would be touched inside a compiled or captured region."""
    region = compiled_region()
    if region is not None:
        msg = (
            f"cannot {action} {who} {region}: buffers made there are not marked static and land in the "
            "CUDA-graph memory pool. Pin caches before compiled decoding starts, e.g. with "
            "cachelife.prepare_static_cache(model, ...) or cachelife.enable(model) before model.generate(...)."
        )
        raise CompiledRegionError(msg)


def static_tensors(layer: StaticLayer) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an allocated layer that compiled decoding mutates in place."""
    if layer.keys is not None:
        yield "keys", layer.keys
    if layer.values is not None:
        yield "values", layer.values
    yield "cumulative_length", layer.cumulative_length


def is_marked_static(tensor: torch.Tensor) -> bool:
    """Whether `torch._dynamo.mark_static_address` was applied to this tensor object."""
    return getattr(tensor, "_dynamo_static_input_type", None) is not None


def observe(layer: StaticLayer) -> Buffers | None:
    """Describe the storage a layer holds now, or None if it holds none."""
    if not layer.is_initialized or layer.keys is None or layer.values is None:
        return None
    return Buffers(
        key_shape=tuple(layer.keys.shape),
        value_shape=tuple(layer.values.shape),
        dtype=layer.keys.dtype,
        device=layer.keys.device,
        data_ptrs=tuple((name, tensor.data_ptr()) for name, tensor in static_tensors(layer)),
        tensors=tuple(tensor for _, tensor in static_tensors(layer)),
    )


def unmarked_tensors(layer: StaticLayer) -> list[str]:
    """Names of the layer's tensors that were never marked static."""
    return [name for name, tensor in static_tensors(layer) if not is_marked_static(tensor)]


def allocate(layer: StaticLayer, spec: PinSpec, reuse: Mapping[str, torch.Tensor] | None = None) -> Buffers:
    """Give the layer its buffers at their final shape, every one marked static; return what it holds.

    Without `reuse`, transformers' own `lazy_initialization` allocates them, fed zero-length keys and values
    (the recipe of `Cache.early_initialization`), so the layer ends up exactly as a lazy first `update`
    would leave it; any tensor transformers did not mark is marked here. With `reuse` (tensors of a pinned
    layer of the same shape, from a pool), `lazy_initialization` runs on meta tensors, which allocates
    nothing but sets every attribute the installed transformers version sets, and the reused tensors are
    installed and zeroed in place, keeping their addresses. On failure the layer is put back as it was.
    """
    device = spec.device if reuse is None else torch.device("meta")
    empty_keys = torch.zeros(
        (spec.batch_size, spec.num_kv_heads, 0, spec.key_head_dim), dtype=spec.dtype, device=device
    )
    empty_values = torch.zeros(
        (spec.batch_size, spec.num_kv_heads, 0, spec.value_head_dim), dtype=spec.dtype, device=device
    )
    try:
        layer.lazy_initialization(empty_keys, empty_values)
        if reuse is not None:
            _install(layer, spec, reuse)
        for _, tensor in static_tensors(layer):
            if not is_marked_static(tensor):
                torch._dynamo.mark_static_address(tensor)
    except BaseException:
        drop(layer)
        raise
    buffers = observe(layer)
    if buffers is None:
        drop(layer)
        msg = (
            f"{type(layer).__name__}.lazy_initialization allocated no keys and values; cachelife manages "
            "layers that store them (transformers' StaticLayer family)"
        )
        raise UnsupportedCacheError(msg)
    reorder.install(layer)
    return buffers


def _install(layer: StaticLayer, spec: PinSpec, reuse: Mapping[str, torch.Tensor]) -> None:
    keys, values, length = reuse["keys"], reuse["values"], reuse["cumulative_length"]
    want_keys = (spec.batch_size, spec.num_kv_heads, layer.max_cache_len, spec.key_head_dim)
    want_values = (spec.batch_size, spec.num_kv_heads, layer.max_cache_len, spec.value_head_dim)
    if tuple(keys.shape) != want_keys or tuple(values.shape) != want_values or keys.dtype != spec.dtype:
        msg = (
            f"reused buffers do not fit: keys {tuple(keys.shape)} {keys.dtype}, values {tuple(values.shape)}; "
            f"expected keys {want_keys}, values {want_values}, {spec.dtype}"
        )
        raise CacheShapeError(msg)
    layer.keys, layer.values, layer.cumulative_length = keys, values, length
    # lazy_initialization recorded the meta device (and, before transformers 5.24, the dtype) of its inputs.
    layer.__dict__["device"] = keys.device
    if "dtype" in layer.__dict__:
        layer.__dict__["dtype"] = keys.dtype
    keys.zero_()
    values.zero_()
    length.zero_()


def zero(layer: StaticLayer) -> None:
    """Empty the layer in place (transformers' own `reset`), keeping every data pointer; the caller checked
    that it holds its recorded tensors (`check_unreplaced`)."""
    layer.reset()
    reorder.share_rows_within_beams(layer, shared=False)


def check_unreplaced(layer: StaticLayer, recorded: Buffers, who: str) -> None:
    """Raise `ReplacedBuffersError` if the layer no longer holds the tensors recorded at pin time."""
    held = layer.is_initialized and layer.keys is not None and layer.values is not None
    now = tuple((name, tensor.data_ptr()) for name, tensor in static_tensors(layer)) if held else None
    if now != recorded.data_ptrs:
        msg = (
            f"{who}: its buffers were replaced outside cachelife (pinned at {_format_ptrs(recorded.data_ptrs)}, "
            f"now {'none' if now is None else _format_ptrs(now)}). Something reassigned the layer's tensors, "
            "e.g. Cache.reorder_cache during beam search; release and pin the cache again."
        )
        raise ReplacedBuffersError(msg)


def drop(layer: StaticLayer) -> None:
    """Drop the layer's storage so that it is exactly as transformers builds it: lazily allocated."""
    layer.keys = None
    layer.values = None
    layer.is_initialized = False
    layer.cumulative_length = torch.tensor(0, dtype=torch.int64)
    if is_sliding_layer(layer):
        layer.cumulative_length_int = 0
    for name in _INIT_ATTRIBUTES:
        layer.__dict__.pop(name, None)
    reorder.remove(layer)


def replaced_tensors(layer: StaticLayer, recorded: Buffers) -> list[str]:
    """Names of the tensors the layer no longer holds since they were recorded (an identity check: cheap
    enough for every decoding step)."""
    live = (layer.keys, layer.values, layer.cumulative_length)
    return [
        name
        for (name, _), pinned, now in zip(recorded.data_ptrs, recorded.tensors, live, strict=False)
        if now is not pinned
    ]


def restore(layer: StaticLayer, recorded: Buffers, who: str) -> None:
    """Put the recorded tensors back into a layer whose tensors were replaced, carrying over the content of
    the replacements (copied in place, so every data pointer is the recorded one again).

    Raises `ReplacedBuffersError`, changing nothing, when a replacement does not fit its recorded tensor
    (another shape, dtype or device): its content cannot be kept at the pinned addresses.
    """
    live = {"keys": layer.keys, "values": layer.values, "cumulative_length": layer.cumulative_length}
    pairs = [(name, pinned, live[name]) for (name, _), pinned in zip(recorded.data_ptrs, recorded.tensors, strict=True)]
    misfits = [
        f"{name} is now {_describe(now)}, pinned as {_describe(pinned)}"
        for name, pinned, now in pairs
        if now is not pinned and not _fits(now, pinned)
    ]
    if misfits:
        msg = (
            f"{who}: its buffers were replaced by tensors that do not fit them ({'; '.join(misfits)}), so their "
            "content cannot be moved back to the pinned addresses; release the cache and pin it again."
        )
        raise ReplacedBuffersError(msg)
    for name, pinned, now in pairs:
        if now is not pinned and isinstance(now, torch.Tensor):
            pinned.copy_(now)
            setattr(layer, name, pinned)


def _fits(now: object, pinned: torch.Tensor) -> bool:
    return (
        isinstance(now, torch.Tensor)
        and now.shape == pinned.shape
        and now.dtype == pinned.dtype
        and now.device == pinned.device
    )


def _describe(tensor: object) -> str:
    if not isinstance(tensor, torch.Tensor):
        return repr(tensor)
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} on {tensor.device}"


def _format_ptrs(data_ptrs: tuple[tuple[str, int], ...]) -> str:
    return ", ".join(f"{name}=0x{ptr:x}" for name, ptr in data_ptrs)
