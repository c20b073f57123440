"""The bad-input matrix: each misuse gets its specific error (also the matching builtin) and changes nothing.

README.md's "Errors" table lists these rows; each test below is one row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import T5ForConditionalGeneration
from transformers.cache_utils import DynamicCache, StaticCache

import cachelife
from cachelife.core.buffers import PinSpec
from cachelife.core.layer_lifecycle import LayerState
from cachelife.errors import (
    CacheShapeError,
    CompiledRegionError,
    IllegalTransitionError,
    UnmarkedBuffersError,
    UnpinnedCacheError,
    UnsupportedCacheError,
)
from cachelife.integration.call_arguments import cache_argument_name
from cachelife.tools import zoo

SETTINGS: dict[str, Any] = {"do_sample": False, "max_new_tokens": 4, "min_new_tokens": 4}


def states(cache: object) -> list[LayerState]:
    return [layer.state for layer in cachelife.lifecycle(cache).layers]


def generate_with(built: zoo.ZooModel, cache: object, inputs: zoo.Inputs, **settings: Any) -> torch.Tensor:
    return zoo.generate_tokens(
        built.model, inputs, **{**SETTINGS, **settings}, **{cache_argument_name(built.model): cache}
    )


def enabled(name: str) -> zoo.ZooModel:
    built = zoo.build(name)
    cachelife.enable(built.model)
    return built


def test_batch_size_that_ignores_beams() -> None:
    built = enabled("t5")
    cache = cachelife.prepare_static_cache(built.model, batch_size=2, max_cache_len=16, encoder_length=9)
    before = states(cache)
    with pytest.raises(
        CacheShapeError, match=r"holds keys of shape \(2, 4, 16, 16\) where \(6, 4, 16, 16\) is needed"
    ) as raised:
        generate_with(built, cache, built.inputs(2, 9, 1), num_beams=3)
    assert isinstance(raised.value, ValueError)
    assert states(cache) == before


def test_dtype_other_than_the_models() -> None:
    built = enabled("llama")
    cache = cachelife.prepare_static_cache(built.model, batch_size=2, max_cache_len=16)
    built.model.to(torch.bfloat16)
    before = states(cache)
    with pytest.raises(CacheShapeError, match=r"holds dtype torch\.float32 where torch\.bfloat16 is needed"):
        generate_with(built, cache, built.inputs(2, 5, 1))
    assert states(cache) == before


def test_device_other_than_the_models() -> None:
    built = enabled("llama")
    model = built.model
    cache = StaticCache(config=model.config, max_cache_len=16)
    shapes = cachelife.model_cache_shapes(model)
    cachelife.lifecycle(cache).pin(batch_size=2, shapes=shapes, dtype=torch.float32, device="meta")
    with pytest.raises(CacheShapeError, match="holds device 'meta' where 'cpu' is needed"):
        generate_with(built, cache, built.inputs(2, 5, 1))


def test_mixed_devices_in_one_pin_request_are_checked_per_layer() -> None:
    model = zoo.build("llama").model
    cache = StaticCache(config=model.config, max_cache_len=8)
    state = cachelife.lifecycle(cache)
    shapes = cachelife.model_cache_shapes(model)
    with pytest.raises(CacheShapeError, match="got 1 devices for 2 cache layers"):
        state.pin(batch_size=1, shapes=shapes, dtype=torch.float32, device=["cpu"])
    state.pin(batch_size=1, shapes=shapes, dtype=torch.float32, device=["cpu", "meta"])
    built = zoo.ZooModel(cachelife.enable(model), zoo.build("llama").inputs)
    with pytest.raises(CacheShapeError, match=r"layer 1 \(self-attention\) is already Pinned and holds device 'meta'"):
        generate_with(built, cache, built.inputs(1, 5, 1))


def test_encoder_output_longer_than_the_cross_cache() -> None:
    built = enabled("bart")
    cache = cachelife.prepare_static_cache(built.model, batch_size=2, max_cache_len=16, encoder_length=4)
    before = states(cache)
    with pytest.raises(
        CacheShapeError, match=r"encoder output has 9 positions but layer 0 \(cross-attention\) holds 4"
    ):
        generate_with(built, cache, built.inputs(2, 9, 1))
    assert states(cache) == before


def test_cache_of_another_model() -> None:
    built = enabled("t5")
    config = zoo.t5_tiny()
    config.d_kv = 8  # same layer count and heads, other head dim
    other = T5ForConditionalGeneration(config)
    cache = cachelife.prepare_static_cache(other, batch_size=2, max_cache_len=16, encoder_length=9)
    with pytest.raises(CacheShapeError, match=r"holds keys of shape \(2, 4, 16, 8\) where \(2, 4, 16, 16\)"):
        generate_with(built, cache, built.inputs(2, 9, 1))


def test_shapes_that_do_not_match_the_model() -> None:
    built = enabled("llama")
    cache = StaticCache(config=built.model.config, max_cache_len=16)
    wrong = cachelife.CacheShapes.uniform(2, cachelife.LayerShape(4, 16, 16))  # llama-tiny has 2 kv heads
    cachelife.lifecycle(cache).pin(batch_size=2, shapes=wrong, dtype=torch.float32, device="cpu")
    with pytest.raises(CacheShapeError, match=r"holds keys of shape \(2, 4, 16, 16\) where \(2, 2, 16, 16\)"):
        generate_with(built, cache, built.inputs(2, 5, 1))


def test_max_cache_len_smaller_than_the_prompt() -> None:
    built = enabled("llama")
    cache = cachelife.prepare_static_cache(built.model, batch_size=2, max_cache_len=4)
    before = states(cache)
    with pytest.raises(CacheShapeError, match="the call writes 9 positions but it holds 4"):
        generate_with(built, cache, built.inputs(2, 9, 1))
    assert states(cache) == before


def test_pinning_inside_a_compiled_region(as_if_traced: Callable[[], None]) -> None:
    model = zoo.build("llama").model
    as_if_traced()
    with pytest.raises(CompiledRegionError, match=r"cannot pin layer 0 \(self-attention\) while dynamo traces"):
        cachelife.prepare_static_cache(model, batch_size=1, max_cache_len=4)


def test_using_a_released_cache() -> None:
    model = zoo.build("llama").model
    cache = cachelife.prepare_static_cache(model, batch_size=1, max_cache_len=4)
    state = cachelife.lifecycle(cache)
    state.release()
    with pytest.raises(IllegalTransitionError, match=r"cannot reset layer 0 \(self-attention\): it is Unallocated"):
        state.layers[0].reset()
    with pytest.raises(UnpinnedCacheError, match="2 of 2 cache layers are not pinned"):
        state.require_pinned()


def test_a_released_cache_in_a_strict_model() -> None:
    built = zoo.build("llama")
    cachelife.enable(built.model, on_unpinned="raise")
    cache = cachelife.prepare_static_cache(built.model, batch_size=2, max_cache_len=16)
    cachelife.lifecycle(cache).release()
    before = states(cache)
    with pytest.raises(UnpinnedCacheError):
        built.model(**built.inputs(2, 5, 1), **{cache_argument_name(built.model): cache})
    assert states(cache) == before


def test_a_cache_whose_buffers_were_born_in_a_compiled_region() -> None:
    cache = StaticCache(config=zoo.llama_tiny(), max_cache_len=4)
    layer = cache.layers[0]
    layer.keys, layer.values, layer.is_initialized = torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16), True
    with pytest.raises(UnmarkedBuffersError, match=r"layer 0 \(self-attention\) holds buffers that were never marked"):
        cachelife.lifecycle(cache)


def test_a_dynamic_cache_where_a_static_one_is_needed() -> None:
    with pytest.raises(UnsupportedCacheError, match="got a DynamicCache") as raised:
        cachelife.lifecycle(DynamicCache())
    assert isinstance(raised.value, TypeError)


def test_pin_spec_mismatch_on_an_already_pinned_cache() -> None:
    model = zoo.build("llama").model
    cache = cachelife.prepare_static_cache(model, batch_size=1, max_cache_len=4)
    state = cachelife.lifecycle(cache)
    before = states(cache)
    with pytest.raises(CacheShapeError, match=r"already Pinned and holds dtype torch\.float32 where torch\.float16"):
        state.pin_specs(
            [
                PinSpec(
                    batch_size=1,
                    num_kv_heads=2,
                    key_head_dim=16,
                    value_head_dim=16,
                    dtype=torch.float16,
                    device=torch.device("cpu"),
                )
            ]
            * 2
        )
    assert states(cache) == before
