"""Building pinned caches for a model: every layer at the model's shapes and dtype, on its decoder layer's device.

`prepare_static_cache` builds a new cache for your own loop; `pin_for_model` pins a cache transformers built
(the decoding guard calls it). Both size caches from the decoder, never from the encoder, and give
cross-attention full attention over the encoder's length. With a pool (`cachelife.pool_of(model)`), buffers of
an earlier cache of the same shape are reused at their addresses (`CachePool.pin`).
"""

from __future__ import annotations

from transformers import PreTrainedModel
from transformers.cache_utils import EncoderDecoderCache, StaticCache, StaticLayer

from cachelife.core.cache_lifecycle import (
    CacheLifecycle,
    ManagedCache,
    is_encoder_decoder_cache,
    is_static_cache,
    lifecycle,
)
from cachelife.core.placement import cache_layer_devices
from cachelife.core.pool import CachePool
from cachelife.core.shapes import CacheShapes, model_cache_shapes
from cachelife.errors import CacheShapeError, InvalidArgumentError
from cachelife.validate import check_int


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
    check_model_and_pool(model, pool)
    check_int("batch_size", batch_size, error=CacheShapeError)
    check_int("max_cache_len", max_cache_len, error=CacheShapeError)
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
        check_int("encoder_length", encoder_length, error=CacheShapeError)
        cross_cache = StaticCache(config=decoder_config, max_cache_len=encoder_length)
        cross_cache.layers = [StaticLayer(max_cache_len=encoder_length) for _ in shapes.cross_attention]
        cache = EncoderDecoderCache(self_cache, cross_cache)
    pin_for_model(cache, model, batch_size=batch_size, shapes=shapes, pool=pool)
    return cache


def check_model_and_pool(model: object, pool: object) -> None:
    """Raise `InvalidArgumentError` unless `model` is a transformers model and `pool` a `CachePool` or None."""
    if not isinstance(model, PreTrainedModel):
        msg = f"model must be a transformers PreTrainedModel, got a {type(model).__name__}"
        raise InvalidArgumentError(msg)
    if pool is not None and not isinstance(pool, CachePool):
        msg = f"pool must be a CachePool (cachelife.pool_of(model)) or None, got {type(pool).__name__} {pool!r:.60}"
        raise InvalidArgumentError(msg)


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
    check_model_and_pool(model, pool)
    if shapes is None:
        shapes = model_cache_shapes(model)
    if encoder_length is not None and is_encoder_decoder_cache(cache):
        _make_cross_full_attention(cache, encoder_length)
    state = lifecycle(cache)
    devices = cache_layer_devices(model, len(shapes.self_attention), len(shapes.cross_attention))
    specs = state.specs_for(batch_size=batch_size, shapes=shapes, dtype=model.dtype, device=devices)
    if pool is None:
        state.pin_specs(specs)
        return state
    return pool.pin(cache, specs)


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
