"""cachelife inside transformers: building pinned caches, and guarding `generate` and the forward call.

The invariant: every layer of every static cache a model decodes with, self-attention and
cross-attention, is pinned before the model's first forward call with that cache. `enable(model)` (or
`CacheLifecycleMixin`) establishes it at two places and checks it at a third:

1. after `_prepare_cache_for_generation` (the model's own override included), where `generate` has its
   cache: every layer is pinned there, outside any compiled region;
2. at the decoding boundary, eagerly before each forward call (a forward pre-hook for a compiled
   `model.forward`, and a wrapper around transformers' auto-compiled call): a cache that reached it
   unpinned (replaced after preparation, or built by hand) is pinned there and a WARNING is logged, or,
   with `on_unpinned="raise"`, refused with `UnpinnedCacheError`;
3. after each forward call, content is recorded (`Pinned -> Filled`) without reading any tensor.

With `enable(model, encoder_buckets=...)`, the encoder output and its attention mask are padded to a bucket
length (`cachelife.buckets`) on the way into `_prepare_cache_for_generation`, so that the cross-attention
cache is pinned, and decoding compiled, at the bucket length.

All of this runs in eager Python around compiled code, never inside it: the hooks return at once while
dynamo traces, so they add no graph break, recompilation or host-device synchronisation.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeAlias

import torch
from attrs import define, field
from torch._dynamo.utils import counters
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import EncoderDecoderCache, StaticCache, StaticLayer

from cachelife import buffers, reorder
from cachelife.buckets import Buckets, check_bucketable, check_buckets, pad_generation_kwargs
from cachelife.cache_lifecycle import (
    CacheLifecycle,
    ManagedCache,
    is_encoder_decoder_cache,
    is_managed_cache,
    is_static_cache,
    lifecycle,
)
from cachelife.compile_cache import pinned_compile_cache
from cachelife.errors import CacheShapeError, ReplacedBuffersError, UnsupportedCacheError
from cachelife.layer_lifecycle import Filled, FillRecord, Pinned, Unallocated
from cachelife.placement import cache_layer_devices
from cachelife.pool import DEFAULT_BUDGET_BYTES, BufferSet, CachePool, pool_key
from cachelife.shapes import CacheShapes, model_cache_shapes
from cachelife.skips import describe as skips_describe
from cachelife.skips import skip_log as skips_log

logger = logging.getLogger(__name__)

OnUnpinned: TypeAlias = Literal["pin", "raise"]

# Where transformers passes the cache to forward and to `generate`'s model_kwargs: `cache` from 5.24 on,
# `past_key_values` before.
CACHE_ARGUMENT_NAMES = ("cache", "past_key_values")
# Inputs whose first two dims are (batch, query length), in the order a decoder step reads them.
_QUERY_INPUTS = ("decoder_input_ids", "input_ids", "decoder_inputs_embeds", "inputs_embeds")
# Instance attributes `enable` sets; `disable` restores each exactly.
_PATCHED = ("generate", "_prepare_cache_for_generation", "get_compiled_call")
_GUARD_ATTRIBUTE = "_cachelife_guard"


# -- building pinned caches --------------------------------------------------------------------------------


def prepare_static_cache(
    model: PreTrainedModel,
    *,
    batch_size: int,
    max_cache_len: int,
    encoder_length: int | None = None,
    pool: CachePool | None = None,
) -> StaticCache | EncoderDecoderCache:
    """A static cache for `model` in which every layer is pinned, in the model's dtype, each layer on the
    device of the decoder layer that writes it (the model's device unless it is spread over several).

    Decoder-only models get a `StaticCache`; encoder-decoder models an `EncoderDecoderCache` whose
    cross-attention cache holds exactly `encoder_length` positions in every layer (full attention, whatever
    the decoder's self-attention layer types are). Pass it to `generate(..., past_key_values=cache)` (or
    `cache=` from transformers 5.24) or to your own decoding loop. With a `pool` (`pool_of(model)`), the
    buffers of an earlier cache of the same shape are reused, at the same addresses.
    """
    _check_positive("batch_size", batch_size)
    _check_positive("max_cache_len", max_cache_len)
    shapes = model_cache_shapes(model)
    is_encoder_decoder = bool(model.config.is_encoder_decoder)
    if is_encoder_decoder and encoder_length is None:
        msg = f"{type(model).__name__} is an encoder-decoder model: pass encoder_length (the encoder's output length)"
        raise CacheShapeError(msg)
    if not is_encoder_decoder and encoder_length is not None:
        msg = f"{type(model).__name__} is decoder-only: it has no cross-attention cache, so pass no encoder_length"
        raise CacheShapeError(msg)
    decoder_config = model.config.get_text_config(decoder=True)
    self_cache = StaticCache(config=decoder_config, max_cache_len=max_cache_len)
    _size_from_decoder(self_cache, len(shapes.self_attention), max_cache_len)
    cache: StaticCache | EncoderDecoderCache = self_cache
    if encoder_length is not None:
        _check_positive("encoder_length", encoder_length)
        cross_cache = StaticCache(config=decoder_config, max_cache_len=encoder_length)
        cross_cache.layers = [StaticLayer(max_cache_len=encoder_length) for _ in shapes.cross_attention]
        cache = EncoderDecoderCache(self_cache, cross_cache)
    pin_for_model(cache, model, batch_size=batch_size, shapes=shapes, pool=pool)
    return cache


def pin_for_model(
    cache: ManagedCache,
    model: PreTrainedModel,
    *,
    batch_size: int,
    shapes: CacheShapes | None = None,
    encoder_length: int | None = None,
    pool: CachePool | None = None,
) -> CacheLifecycle:
    """Pin every unpinned layer of `cache` for `model`'s shapes and dtype, each on its decoder layer's device.

    Cross-attention layers that are not yet allocated and are not full attention over `encoder_length`
    positions (transformers sizes them with the decoder's sliding windows) are replaced by full-attention
    layers of that length first. With a `pool`, a wholly unallocated cache reuses the buffers of an earlier
    cache of the same shape, and lends its own to a later one once it is garbage-collected.
    """
    if shapes is None:
        shapes = model_cache_shapes(model)
    if encoder_length is not None and is_encoder_decoder_cache(cache):
        _make_cross_full_attention(cache, encoder_length)
    state = lifecycle(cache)
    devices = cache_layer_devices(model, len(shapes.self_attention), len(shapes.cross_attention))
    specs = state.specs_for(batch_size=batch_size, shapes=shapes, dtype=model.dtype, device=devices)
    if pool is None or not all(isinstance(layer.state, Unallocated) for layer in state.storage_layers):
        state.pin_specs(specs)
        return state
    key = pool_key(state, specs)
    entry = pool.lease(key)
    try:
        state.pin_specs(specs, None if entry is None else entry.tensors)
    except BaseException:
        if entry is not None:
            pool.give_back(entry)
        raise
    pool.lend(cache, entry if entry is not None else BufferSet.of(key, state))
    return state


# -- enabling a model --------------------------------------------------------------------------------------


def enable(
    model: PreTrainedModel,
    *,
    on_unpinned: OnUnpinned = "pin",
    pool_bytes: int = DEFAULT_BUDGET_BYTES,
    encoder_buckets: Sequence[int] | None = None,
) -> PreTrainedModel:
    """Guard `model` so that every static cache it decodes with is pinned first; returns the model.

    Idempotent (a second call updates the settings). `on_unpinned` decides what happens when a cache
    reaches a forward call unpinned (it was replaced after `generate` prepared it, or built by hand): "pin"
    pins it there and logs a WARNING (the default), "raise" raises `UnpinnedCacheError`. `pool_bytes` is the
    budget of idle pinned buffers kept between `generate` calls so that the next call of the same shape
    decodes at the same addresses (no CUDA-graph re-recording); 0 turns the pool off. `encoder_buckets`
    (encoder-decoder models whose cross-attention honours the encoder mask, see `cachelife.buckets`), e.g.
    `(64, 128, 256, 512)`, pads every encoder output and its attention mask to the smallest bucket that fits,
    so that a few cross-attention cache shapes serve every input length; None (the default) pads nothing.
    Fails at once, before anything is patched, if the model is no transformers generation model, its shapes
    cannot be inferred, or the buckets are invalid (`InvalidBucketsError`) or unsafe for it
    (`UnsupportedGenerationError`).
    """
    if on_unpinned not in ("pin", "raise"):
        msg = f"on_unpinned must be 'pin' or 'raise', got {on_unpinned!r}"
        raise ValueError(msg)
    _check_pool_budget(pool_bytes)
    buckets = None if encoder_buckets is None else check_buckets(encoder_buckets)
    existing = _guard_of(model)
    if existing is not None:
        if buckets is not None:
            check_bucketable(model)
        existing.on_unpinned = on_unpinned
        existing.pool = _make_pool(pool_bytes, existing.pool)
        existing.encoder_buckets = buckets
        return model
    if not isinstance(model, PreTrainedModel) or not callable(getattr(model, "generate", None)):
        msg = f"cachelife.enable needs a transformers generation model, got a {type(model).__name__}"
        raise UnsupportedCacheError(msg)
    model_cache_shapes(model)  # fail now, not in the middle of generate
    if buckets is not None:
        check_bucketable(model)
    guard = _DecodingGuard(on_unpinned=on_unpinned, pool=_make_pool(pool_bytes, None), encoder_buckets=buckets)
    guard.install(model)
    return model


def pool_of(model: object) -> CachePool | None:
    """The buffer pool of an enabled model (None if cachelife is off for it or its pool is off)."""
    guard = _guard_of(model)
    return None if guard is None else guard.pool


def release_pool(model: object) -> None:
    """Drop the idle pinned buffers an enabled model keeps between `generate` calls."""
    pool = pool_of(model)
    if pool is not None:
        pool.clear()


def _check_pool_budget(budget: object) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        msg = f"pool_bytes must be an int >= 0 (0 turns the pool off), got {budget!r}"
        raise ValueError(msg)


def _make_pool(budget: int, current: CachePool | None) -> CachePool | None:
    if budget == 0:
        return None
    if current is not None:
        current.budget_bytes = budget
        return current
    return CachePool(budget)


def disable(model: PreTrainedModel) -> PreTrainedModel:
    """Undo `enable`: remove the hooks and restore every patched attribute exactly. Idempotent."""
    guard = _guard_of(model)
    if guard is not None:
        guard.uninstall(model)
    return model


def is_enabled(model: object) -> bool:
    """Whether `enable` (or `CacheLifecycleMixin`) guards this model."""
    return _guard_of(model) is not None


class CacheLifecycleMixin:
    """Mix into a transformers model class, before its `PreTrainedModel` base, to enable cachelife on every
    instance (`enable(self)` at the end of `__init__`, so `from_pretrained` models are guarded too).

    Override `cachelife_cache_shapes()` (the `DeclaresCacheShapes` extension point) when the model's cache
    shapes do not follow its config family's rule.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self, PreTrainedModel):
            msg = f"CacheLifecycleMixin must be mixed into a transformers PreTrainedModel, not {type(self).__name__}"
            raise UnsupportedCacheError(msg)
        enable(self)


# -- the guard ---------------------------------------------------------------------------------------------


@define(eq=False)
class _DecodingGuard:
    """What `enable` installs on one model: two forward hooks and three wrapped methods."""

    on_unpinned: OnUnpinned
    pool: CachePool | None
    encoder_buckets: Buckets | None = None
    # CUDA-graph skips counted by torch when this guard last looked (process-wide counter).
    _skips_seen: int = field(factory=lambda: int(counters["inductor"]["cudagraph_skips"]), alias="skips_seen")
    # Skip reasons torch had logged when this guard last looked (`cachelife.skips`).
    _skip_lines_seen: int = field(factory=lambda: skips_log().count, alias="skip_lines_seen")
    # Whether a pinned layer was found holding replaced tensors (then a stale compile cache is no likely cause).
    _replaced_seen: bool = field(default=False, alias="replaced_seen")
    # Caches whose replaced tensors were already reported, to warn once per cache.
    _warned_replaced: weakref.WeakSet[CacheLifecycle] = field(factory=weakref.WeakSet, alias="warned_replaced")
    _hooks: list[torch.utils.hooks.RemovableHandle] = field(factory=list, alias="hooks")
    # Attribute name -> the instance attribute that was there before (absent if the class provided it).
    _saved: dict[str, Any] = field(factory=dict, alias="saved")

    def install(self, model: PreTrainedModel) -> None:
        originals = {name: getattr(model, name) for name in _PATCHED}
        self._saved = {name: model.__dict__[name] for name in _PATCHED if name in model.__dict__}
        prepare_signature = inspect.signature(originals["_prepare_cache_for_generation"])

        @functools.wraps(originals["generate"])
        def generate(*args: Any, **kwargs: Any) -> Any:
            with pinned_compile_cache():
                return originals["generate"](*args, **kwargs)

        def prepare_cache_for_generation(*args: Any, **kwargs: Any) -> Any:
            arguments = prepare_signature.bind(*args, **kwargs).arguments
            self.before_cache_preparation(arguments)
            result = originals["_prepare_cache_for_generation"](*args, **kwargs)
            self.after_cache_preparation(model, arguments)
            return result

        def get_compiled_call(*args: Any, **kwargs: Any) -> Any:
            compiled = originals["get_compiled_call"](*args, **kwargs)
            return self.guard_compiled_call(model, compiled)

        model.__dict__["generate"] = generate
        model.__dict__["_prepare_cache_for_generation"] = prepare_cache_for_generation
        model.__dict__["get_compiled_call"] = get_compiled_call
        self._hooks = [
            model.register_forward_pre_hook(self.before_forward, with_kwargs=True),
            model.register_forward_hook(self.after_forward, with_kwargs=True),
        ]
        model.__dict__[_GUARD_ATTRIBUTE] = self

    def uninstall(self, model: PreTrainedModel) -> None:
        if self.pool is not None:
            self.pool.clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for name in _PATCHED:
            if name in self._saved:
                model.__dict__[name] = self._saved[name]
            else:
                model.__dict__.pop(name, None)
        model.__dict__.pop(_GUARD_ATTRIBUTE, None)

    # 0. where generate has run the encoder (and expanded its output for beams) but built no cache yet
    def before_cache_preparation(self, arguments: Mapping[str, Any]) -> None:
        """Pad the encoder output and mask to their bucket, so the cache is built and pinned at that length."""
        model_kwargs = arguments.get("model_kwargs")
        if self.encoder_buckets is not None and isinstance(model_kwargs, dict):
            pad_generation_kwargs(model_kwargs, self.encoder_buckets)

    # 1. where generate has built (or been handed) its cache
    def after_cache_preparation(self, model: PreTrainedModel, arguments: Mapping[str, Any]) -> None:
        model_kwargs = arguments.get("model_kwargs")
        generation_config = arguments.get("generation_config")
        batch_size = arguments.get("batch_size")
        if not isinstance(model_kwargs, dict) or not isinstance(batch_size, int):
            return
        cache = find_cache(model_kwargs)
        if not is_managed_cache(cache):
            return
        if isinstance(generation_config, GenerationConfig):
            batch_size *= max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        encoder_length = _encoder_length(model_kwargs)
        state = pin_for_model(cache, model, batch_size=batch_size, encoder_length=encoder_length, pool=self.pool)
        if isinstance(generation_config, GenerationConfig) and (generation_config.num_beams or 1) > 1:
            # generate expanded the encoder output per beam: every beam of one input gets the same
            # cross-attention rows, which a beam reorder never needs to move (see cachelife.reorder).
            for layer in state.cross_attention:
                if isinstance(layer.state, Pinned):
                    reorder.share_rows_within_beams(layer.layer)

    # 2. the decoding boundary
    def before_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            return
        cache = find_cache(kwargs)
        if not is_managed_cache(cache):
            return
        state = lifecycle(cache)
        if state.is_filled:  # steady-state decoding: a memoised verdict and one identity check per layer
            self.check_replaced(module, state)
            return
        _check_encoder_fits(state, kwargs)
        if not state.is_pinned:
            self.pin_late(module, cache, state, kwargs)
        self.check_replaced(module, state)
        if isinstance(module, PreTrainedModel):
            _check_call_fits(state, module, kwargs)

    def check_replaced(self, module: torch.nn.Module, state: CacheLifecycle) -> None:
        """A pinned layer whose tensors were replaced behind the lifecycle's back (beam reorders of a layer
        without cachelife's in-place reorder, `Cache.crop`, `batch_select_indices`, code assigning
        `layer.keys`, ...): copy their content back into the pinned tensors and warn once per cache, or
        refuse with `ReplacedBuffersError`."""
        replaced = state.replaced()
        if not replaced:
            return
        self._replaced_seen = True
        names = "; ".join(f"{layer.describe()}: {', '.join(tensors)}" for layer, tensors in replaced)
        fix = (
            "Replace no tensor of a pinned layer: write into it in place (copy_, index_copy_), or release and pin "
            "the cache again."
        )
        if self.on_unpinned == "raise":
            msg = (
                f"{len(replaced)} pinned cache layer(s) of {type(module).__name__} hold tensors they were not "
                f"pinned with ({names}), so CUDA graphs would skip or re-record. {fix}"
            )
            raise ReplacedBuffersError(msg)
        for layer, _ in replaced:
            layer.restore_buffers()
        if state in self._warned_replaced:
            logger.debug("replaced cache tensors restored again before %s's forward: %s", type(module).__name__, names)
            return
        self._warned_replaced.add(state)
        logger.warning(
            "%d pinned cache layer(s) reached %s's forward holding tensors they were not pinned with (%s); "
            "cachelife copied their content back into the pinned tensors, at the pinned addresses. %s Pass "
            "on_unpinned='raise' to cachelife.enable to make this an error.",
            len(replaced),
            type(module).__name__,
            names,
            fix,
        )

    def pin_late(
        self, module: torch.nn.Module, cache: ManagedCache, state: CacheLifecycle, kwargs: Mapping[str, Any]
    ) -> None:
        """A cache reached the forward call unpinned: pin it there and warn, or refuse it."""
        batch_size = _batch_size(kwargs)
        if self.on_unpinned == "raise" or not isinstance(module, PreTrainedModel) or batch_size is None:
            state.require_pinned()
            return
        late = ", ".join(layer.describe() for layer in state.unpinned())
        pin_for_model(cache, module, batch_size=batch_size, encoder_length=_encoder_length(kwargs), pool=self.pool)
        logger.warning(
            "cache layers reached %s's forward unpinned and were pinned there: %s. Pin caches ahead "
            "(cachelife.prepare_static_cache, or leave cache preparation to generate); pass "
            "on_unpinned='raise' to cachelife.enable to make this an error.",
            type(module).__name__,
            late,
        )

    # 3. after the forward call
    def after_forward(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if torch.compiler.is_compiling():
            return
        compiled = _is_compiled(getattr(module, "forward", None))
        self.record_content(kwargs, compiled=compiled)
        if compiled:
            self.report_cudagraph_skips(module)

    def record_content(self, kwargs: Mapping[str, Any], *, compiled: bool) -> None:
        cache = find_cache(kwargs)
        if not is_managed_cache(cache):
            return
        state = lifecycle(cache)
        if state.is_filled:
            return
        state.fill(FillRecord("forward", _query_length(kwargs), compiled), cross=False)
        for layer in state.cross_attention:
            if layer.cross_content_written:
                layer.fill(FillRecord("forward", _encoder_length(kwargs), compiled))

    def report_cudagraph_skips(self, module: torch.nn.Module) -> None:
        """Warn when torch skipped CUDA graphs since the last look (the graph then runs correct but slow),
        naming the reason torch gave and its fix."""
        skips = int(counters["inductor"]["cudagraph_skips"])
        if skips <= self._skips_seen:
            return
        log = skips_log()
        reasons = log.since(self._skip_lines_seen)
        logger.warning(
            "torch skipped CUDA graphs for %d compiled graph(s) while %s decoded, so they run correct but slow: %s",
            skips - self._skips_seen,
            type(module).__name__,
            skips_describe(reasons, caches_hold_pinned_tensors=not self._replaced_seen),
        )
        self._skips_seen = skips
        self._skip_lines_seen = log.count

    def guard_compiled_call(self, model: PreTrainedModel, compiled: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap transformers' auto-compiled `__call__` so the boundary checks run eagerly around it."""
        if not _is_compiled(compiled):  # e.g. models transformers never compiles
            return compiled

        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.before_forward(model, args, kwargs)
            output = compiled(*args, **kwargs)
            self.record_content(kwargs, compiled=True)
            self.report_cudagraph_skips(model)
            return output

        return guarded


# -- helpers -----------------------------------------------------------------------------------------------


def find_cache(kwargs: Mapping[str, Any]) -> object:
    """The cache object in forward kwargs or `generate`'s model_kwargs, under either transformers name."""
    for name in CACHE_ARGUMENT_NAMES:
        cache = kwargs.get(name)
        if cache is not None:
            return cache
    return None


def cache_argument_name(model: PreTrainedModel) -> str:
    """The keyword `model.forward` and `generate` take the cache under: `cache` (5.24+) or `past_key_values`."""
    parameters = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _guard_of(model: object) -> _DecodingGuard | None:
    guard = getattr(model, "__dict__", {}).get(_GUARD_ATTRIBUTE)
    return guard if isinstance(guard, _DecodingGuard) else None


def _is_compiled(function: object) -> bool:
    return getattr(function, "_torchdynamo_orig_callable", None) is not None


def _first_tensor(kwargs: Mapping[str, Any], names: tuple[str, ...]) -> torch.Tensor | None:
    for name in names:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            return value
    return None


def _batch_size(kwargs: Mapping[str, Any]) -> int | None:
    query = _first_tensor(kwargs, _QUERY_INPUTS)
    if query is not None:
        return int(query.shape[0])
    encoded = _encoder_states(kwargs)
    return None if encoded is None else int(encoded.shape[0])


def _query_length(kwargs: Mapping[str, Any]) -> int | None:
    query = _first_tensor(kwargs, _QUERY_INPUTS)
    return None if query is None or query.dim() < 2 else int(query.shape[1])


def _encoder_states(kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    encoder_outputs = kwargs.get("encoder_outputs")
    if encoder_outputs is None:
        return None
    states = encoder_outputs[0]
    return states if isinstance(states, torch.Tensor) else None


def _encoder_length(kwargs: Mapping[str, Any]) -> int | None:
    states = _encoder_states(kwargs)
    return None if states is None or states.dim() < 2 else int(states.shape[1])


def _check_encoder_fits(state: CacheLifecycle, kwargs: Mapping[str, Any]) -> None:
    length = _encoder_length(kwargs)
    if length is None:
        return
    for layer in state.cross_attention:
        capacity = layer.capacity
        if capacity is not None and length > capacity:
            msg = (
                f"the encoder output has {length} positions but {layer.describe()} holds {capacity}; build "
                "the cache with encoder_length >= the encoder's output length"
            )
            raise CacheShapeError(msg)


def _check_call_fits(state: CacheLifecycle, model: PreTrainedModel, kwargs: Mapping[str, Any]) -> None:
    """Before a cache's first forward call: its buffers must fit this model and this call (host facts only)."""
    batch_size = _batch_size(kwargs)
    query_length = _query_length(kwargs)
    shapes = model_cache_shapes(model)
    expected = [*shapes.self_attention, *shapes.cross_attention]
    if len(expected) != len(state.layers):
        msg = (
            f"the cache has {len(state.self_attention)} self-attention and {len(state.cross_attention)} "
            f"cross-attention layers but {type(model).__name__} has {len(shapes.self_attention)} and "
            f"{len(shapes.cross_attention)}: is it a cache of another model?"
        )
        raise CacheShapeError(msg)
    devices = cache_layer_devices(model, len(shapes.self_attention), len(shapes.cross_attention))
    for layer, shape, device in zip(state.layers, expected, devices, strict=True):
        current = layer.state
        if not isinstance(current, Pinned | Filled):
            continue
        have = current.buffers
        problems = []
        if batch_size is not None and have.key_shape[0] != batch_size:
            problems.append(
                f"it holds a batch of {have.key_shape[0]} but this call has {batch_size} sequences "
                "(generate needs batch x max(num_beams, num_return_sequences))"
            )
        if (have.key_shape[1], have.key_shape[3], have.value_shape[3]) != (
            shape.num_kv_heads,
            shape.key_head_dim,
            shape.value_head_dim,
        ):
            problems.append(
                f"it holds {have.key_shape[1]} heads of {have.key_shape[3]}/{have.value_shape[3]} (key/value dims) "
                f"but {type(model).__name__} writes {shape.num_kv_heads} heads of "
                f"{shape.key_head_dim}/{shape.value_head_dim}: is it a cache of another model?"
            )
        if have.dtype != model.dtype or have.device != device:
            problems.append(
                f"it holds {have.dtype} on {have.device} but the model computes {model.dtype} on {device} there"
            )
        if (
            layer.role == "self"
            and isinstance(current, Pinned)
            and query_length is not None
            and not buffers.is_sliding_layer(layer.layer)
            and query_length > have.key_shape[2]
        ):
            problems.append(
                f"the call writes {query_length} positions but it holds {have.key_shape[2]} (max_cache_len)"
            )
        if problems:
            msg = f"{layer.describe()} does not fit this forward call: {'; '.join(problems)}"
            raise CacheShapeError(msg)


def _make_cross_full_attention(cache: EncoderDecoderCache, encoder_length: int) -> None:
    cross_cache = cache.cross_attention_cache
    if not is_static_cache(cross_cache):
        return
    for index, layer in enumerate(cross_cache.layers):
        full = type(layer) is StaticLayer and layer.max_cache_len == encoder_length
        if not full and isinstance(layer, StaticLayer) and not layer.is_initialized:
            cross_cache.layers[index] = StaticLayer(max_cache_len=encoder_length)


def _size_from_decoder(cache: StaticCache, layers: int, max_cache_len: int) -> None:
    # transformers sizes a StaticCache by `num_hidden_layers`, which some encoder-decoder configs (T5 with
    # num_decoder_layers != num_layers) set to the encoder's layer count.
    if len(cache.layers) == layers:
        return
    if all(type(layer) is StaticLayer for layer in cache.layers):
        cache.layers = [StaticLayer(max_cache_len=max_cache_len) for _ in range(layers)]
        return
    msg = f"the decoder has {layers} layers but its config builds a StaticCache of {len(cache.layers)}"
    raise CacheShapeError(msg)


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        msg = f"{name} must be a positive int, got {value!r}"
        raise CacheShapeError(msg)
