"""The whole-cache view: adoption, all-or-nothing pinning, require_pinned, resync after replaced layers."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache, StaticCache, StaticLayer

import cachelife
from cachelife.core import buffers
from cachelife.core.cache_lifecycle import CacheLifecycle, static_parts
from cachelife.core.layer_lifecycle import Filled, FillRecord, Pinned, Unallocated
from cachelife.core.shapes import CacheShapes, LayerShape
from cachelife.errors import CacheShapeError, UnpinnedCacheError, UnsupportedCacheError
from cachelife.integration.runtime import runtime_of
from cachelife.tools import zoo

CONFIG = zoo.t5_tiny()  # 2 decoder layers
SELF = LayerShape(num_kv_heads=4, key_head_dim=16, value_head_dim=16)
CROSS = LayerShape(num_kv_heads=4, key_head_dim=8, value_head_dim=12)
SHAPES = CacheShapes.uniform(2, SELF, CROSS)


def encoder_decoder_cache(self_len: int = 10, cross_len: int = 7) -> EncoderDecoderCache:
    return EncoderDecoderCache(
        StaticCache(config=CONFIG, max_cache_len=self_len), StaticCache(config=CONFIG, max_cache_len=cross_len)
    )


def pin(state: CacheLifecycle, batch_size: int = 3) -> None:
    state.pin(batch_size=batch_size, shapes=SHAPES, dtype=torch.float32, device="cpu")


def test_layers_roles_and_indices() -> None:
    cache = encoder_decoder_cache()
    state = cachelife.lifecycle(cache)
    assert [(layer.index, layer.role) for layer in state.layers] == [
        (0, "self"),
        (1, "self"),
        (0, "cross"),
        (1, "cross"),
    ]
    assert all(isinstance(layer.state, Unallocated) for layer in state.layers)


def test_lifecycle_is_one_object_per_cache_and_does_not_keep_it_alive() -> None:
    cache = encoder_decoder_cache()
    assert cachelife.lifecycle(cache) is cachelife.lifecycle(cache)
    ref = weakref.ref(cache)
    state = cachelife.lifecycle(cache)
    pin(state)
    del cache
    gc.collect()
    assert ref() is None
    assert isinstance(state.layers[0].state, Pinned)  # the record outlives the cache; the buffers do not


def test_pin_all_with_separate_self_and_cross_shapes() -> None:
    cache = encoder_decoder_cache()
    state = cachelife.lifecycle(cache)
    pin(state)
    state.require_pinned()
    shapes = [(layer.role, layer.buffers.key_shape, layer.buffers.value_shape) for layer in state.layers]
    assert shapes == [
        ("self", (3, 4, 10, 16), (3, 4, 10, 16)),
        ("self", (3, 4, 10, 16), (3, 4, 10, 16)),
        ("cross", (3, 4, 7, 8), (3, 4, 7, 12)),
        ("cross", (3, 4, 7, 8), (3, 4, 7, 12)),
    ]
    _, own, cross = static_parts(cache)
    for part in (own, cross):
        assert part is not None
        for layer in part.layers:
            assert all(buffers.is_marked_static(t) for _, t in buffers.static_tensors(layer))


def test_pin_is_idempotent_and_checks_already_pinned_layers() -> None:
    cache = encoder_decoder_cache()
    state = cachelife.lifecycle(cache)
    pin(state)
    before = [layer.state for layer in state.layers]
    pin(state)
    assert [layer.state for layer in state.layers] == before
    with pytest.raises(CacheShapeError, match=r"layer 0 \(self-attention\) is already Pinned and holds keys of shape"):
        pin(state, batch_size=5)
    assert [layer.state for layer in state.layers] == before


def test_require_pinned_names_every_missing_layer() -> None:
    cache = encoder_decoder_cache()
    state = cachelife.lifecycle(cache)
    state.self_attention[0].pin(
        buffers.PinSpec(
            batch_size=3,
            num_kv_heads=4,
            key_head_dim=16,
            value_head_dim=16,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
    )
    with pytest.raises(UnpinnedCacheError) as raised:
        state.require_pinned()
    message = str(raised.value)
    assert "3 of 4 cache layers are not pinned" in message
    assert "layer 1 (self-attention) is Unallocated" in message
    assert "layer 0 (cross-attention) is Unallocated" in message
    assert "layer 0 (self-attention)" not in message


def test_pin_rolls_back_when_a_later_layer_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = encoder_decoder_cache()
    state = cachelife.lifecycle(cache)
    real = buffers.allocate
    calls = {"n": 0}

    def fail_third(layer: StaticLayer, spec: buffers.PinSpec, reuse: object = None) -> buffers.Buffers:
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("injected on the third layer")
        return real(layer, spec)

    monkeypatch.setattr(buffers, "allocate", fail_third)
    with pytest.raises(torch.OutOfMemoryError):
        pin(state)
    assert all(isinstance(layer.state, Unallocated) for layer in state.layers)
    _, own, cross = static_parts(cache)
    assert cross is not None
    assert not any(layer.is_initialized for layer in [*own.layers, *cross.layers])


def test_wrong_layer_counts_and_devices_change_nothing() -> None:
    cache = encoder_decoder_cache()
    state = cachelife.lifecycle(cache)
    with pytest.raises(CacheShapeError, match="2 self-attention and 2 cross-attention layers"):
        state.pin(batch_size=3, shapes=CacheShapes.uniform(3, SELF, CROSS), dtype=torch.float32, device="cpu")
    with pytest.raises(CacheShapeError, match="got 3 devices for 4 cache layers"):
        state.pin(batch_size=3, shapes=SHAPES, dtype=torch.float32, device=["cpu"] * 3)
    with pytest.raises(CacheShapeError, match="batch_size must be a positive int"):
        state.pin(batch_size=0, shapes=SHAPES, dtype=torch.float32, device="cpu")
    assert all(isinstance(layer.state, Unallocated) for layer in state.layers)


def test_reset_and_release_whole_cache() -> None:
    cache = encoder_decoder_cache()
    state = cachelife.lifecycle(cache)
    pin(state)
    pointers = [layer.buffers.data_ptrs for layer in state.layers]
    state.fill(FillRecord("test"), cross=False)
    assert [type(layer.state) for layer in state.layers] == [Filled, Filled, Pinned, Pinned]
    state.reset()
    assert all(isinstance(layer.state, Pinned) for layer in state.layers)
    assert [layer.buffers.data_ptrs for layer in state.layers] == pointers
    state.release()
    assert all(isinstance(layer.state, Unallocated) for layer in state.layers)
    assert not static_parts(cache)[1].layers[0].is_initialized


def test_a_whole_cache_reset_checks_each_layer_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every prefill of the engine and every generate call resets a cache: each layer's buffers are checked
    # once (all of them before any is emptied), not again by the layer's own reset.
    cache = encoder_decoder_cache()  # held: the lifecycle holds its cache weakly
    state = cachelife.lifecycle(cache)
    pin(state)
    checked: list[object] = []
    check = buffers.check_unreplaced

    def counting(layer: StaticLayer, recorded: buffers.Buffers, who: str) -> None:
        checked.append(layer)
        check(layer, recorded, who)

    monkeypatch.setattr(buffers, "check_unreplaced", counting)
    state.reset()
    assert len(checked) == len(state.layers) == 4
    assert all(isinstance(layer.state, Pinned) for layer in state.layers)


def test_replaced_sub_cache_gets_fresh_lifecycles() -> None:
    cache = encoder_decoder_cache()
    state = cachelife.lifecycle(cache)
    pin(state)
    # What a model's own _prepare_cache_for_generation may do after transformers built the cache.
    cache.cross_attention_cache = StaticCache(config=CONFIG, max_cache_len=7)
    resynced = cachelife.lifecycle(cache)
    assert [type(layer.state) for layer in resynced.layers] == [Pinned, Pinned, Unallocated, Unallocated]
    assert resynced.self_attention[0] is state.self_attention[0]
    assert not resynced.is_pinned


def test_unmanaged_caches_are_refused_with_their_type() -> None:
    with pytest.raises(UnsupportedCacheError, match="got a DynamicCache"):
        cachelife.lifecycle(DynamicCache())
    with pytest.raises(UnsupportedCacheError, match="got an EncoderDecoderCache of DynamicCache and DynamicCache"):
        cachelife.lifecycle(EncoderDecoderCache(DynamicCache(), DynamicCache()))
    mixed = EncoderDecoderCache(StaticCache(config=CONFIG, max_cache_len=4), DynamicCache())
    with pytest.raises(UnsupportedCacheError, match="DynamicCache cross-attention cache"):
        cachelife.lifecycle(mixed)
    with pytest.raises(UnsupportedCacheError):
        cachelife.lifecycle(object())


def test_a_lifecycle_whose_cache_is_gone_says_so() -> None:
    state = cachelife.lifecycle(encoder_decoder_cache())  # the cache is dropped at once
    gc.collect()
    with pytest.raises(UnsupportedCacheError, match="no longer exists: its cache was garbage-collected"):
        pin(state)


def test_whole_cache_verdicts_follow_every_transition() -> None:
    cache = encoder_decoder_cache()
    state = cachelife.lifecycle(cache)
    assert (state.is_pinned, state.is_filled) == (False, False)
    pin(state)
    assert (state.is_pinned, state.is_filled) == (True, False)
    state.fill(FillRecord("test"))
    assert (state.is_pinned, state.is_filled) == (True, True)
    state.cross_attention[1].release()
    assert (state.is_pinned, state.is_filled) == (False, False)


def test_reprs_are_short_and_say_the_states() -> None:
    built = zoo.build("t5")
    model = cachelife.enable(built.model)
    cache = cachelife.prepare_static_cache(model, batch_size=2, max_cache_len=8, encoder_length=9)
    state = cachelife.lifecycle(cache)
    assert repr(state) == "<CacheLifecycle 2 self-attention and 2 cross-attention layers: 4 Pinned>"
    assert repr(state.layers[2]) == "<LayerLifecycle 0 cross: Pinned 2x4x9x16 float32 on cpu>"
    pool = cachelife.pool_of(model)
    assert pool is not None
    assert repr(pool).startswith("CachePool(0 idle set(s), 0 of 4294967296 bytes")
    assert len(repr(runtime_of(model))) < 200


def test_each_cache_counts_its_own_layers_transitions() -> None:
    """The memoised verdicts follow a count of the cache's own layers: another cache's transitions leave it,
    and a lifecycle rebuilt around kept layers shares the count they add to."""
    caches = encoder_decoder_cache(), encoder_decoder_cache()
    first, second = (cachelife.lifecycle(cache) for cache in caches)
    before = second.transitions.value
    pin(first)
    assert first.transitions.value == 4
    assert second.transitions.value == before
    cache = encoder_decoder_cache()
    state = cachelife.lifecycle(cache)
    pin(state)
    cache.cross_attention_cache = StaticCache(config=CONFIG, max_cache_len=7)
    resynced = cachelife.lifecycle(cache)
    assert resynced.transitions is state.transitions
    pin(resynced)
    assert resynced.is_pinned
    state.self_attention[0].release()  # a kept layer, through the lifecycle that adopted it
    assert not resynced.is_pinned
