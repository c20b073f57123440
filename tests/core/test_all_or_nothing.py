"""Whole-cache reset and release check every layer before they change any: after a refused call every
layer's state, contents and addresses are exactly as before."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
from transformers.cache_utils import StaticCache, StaticLayer

import cachelife
from cachelife.errors import CompiledRegionError, ReplacedBuffersError, UnsupportedCacheError
from cachelife.tools import zoo

CONFIG = zoo.llama_small()  # 4 decoder layers
SHAPES = cachelife.CacheShapes.uniform(4, cachelife.LayerShape(num_kv_heads=2, key_head_dim=8, value_head_dim=8))
MAX_LEN = 6


def filled_cache() -> tuple[StaticCache, cachelife.CacheLifecycle]:
    """A cache of 4 layers, every one pinned, written with distinct content and recorded as Filled."""
    cache = StaticCache(config=CONFIG, max_cache_len=MAX_LEN)
    state = cachelife.lifecycle(cache)
    state.pin(batch_size=2, shapes=SHAPES, dtype=torch.float32, device="cpu")
    generator = torch.Generator().manual_seed(0)
    for layer in state.layers:
        live = layer.layer
        for tensor in (live.keys, live.values):
            if tensor is not None:
                tensor.copy_(torch.randn(tensor.shape, generator=generator))  # what attention writes, in place
    state.fill(cachelife.FillRecord("test", positions=MAX_LEN))
    return cache, state


Snapshot = list[tuple[cachelife.LayerState, torch.Tensor, torch.Tensor, int, int]]


def live_tensors(layer: cachelife.LayerLifecycle) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values the transformers layer holds now."""
    live = layer.layer
    if live.keys is None or live.values is None:
        pytest.fail(f"{layer.describe()} holds no tensors")
    return live.keys, live.values


def snapshot(state: cachelife.CacheLifecycle) -> Snapshot:
    """Per layer: its state, copies of its live keys and values, and their data pointers."""
    taken = []
    for layer in state.layers:
        keys, values = live_tensors(layer)
        taken.append((layer.state, keys.clone(), values.clone(), keys.data_ptr(), values.data_ptr()))
    return taken


def assert_unchanged(state: cachelife.CacheLifecycle, before: Snapshot) -> None:
    after = snapshot(state)
    assert [entry[0] for entry in after] == [entry[0] for entry in before]
    assert all(isinstance(layer.state, cachelife.Filled) for layer in state.layers)
    assert [entry[3:] for entry in after] == [entry[3:] for entry in before]
    for (_, keys, values, *_), (_, keys_before, values_before, *_) in zip(after, before, strict=True):
        assert torch.equal(keys, keys_before)
        assert torch.equal(values, values_before)


def replace_keys(cache: StaticCache, index: int) -> None:
    """What transformers' `reorder_cache` does during beam search: new, unmarked key tensors."""
    layer = cache.layers[index]
    if layer.keys is None:
        pytest.fail(f"layer {index} holds no keys")
    layer.keys = layer.keys.index_select(0, torch.tensor([1, 0]))


@pytest.mark.parametrize("replaced", [(1,), (3,), (1, 3)], ids=["middle", "last", "middle-then-last"])
def test_reset_with_replaced_buffers_changes_no_layer(replaced: tuple[int, ...]) -> None:
    cache, state = filled_cache()
    for index in replaced:
        replace_keys(cache, index)
    before = snapshot(state)
    with pytest.raises(
        ReplacedBuffersError, match=rf"layer {replaced[0]} \(self-attention\): its buffers were replaced"
    ):
        state.reset()
    assert_unchanged(state, before)
    with pytest.raises(ReplacedBuffersError):  # a second attempt is refused the same way
        state.reset()
    assert_unchanged(state, before)


@pytest.mark.parametrize("replaced", [(1,), (3,), (1, 3)], ids=["middle", "last", "middle-then-last"])
def test_release_drops_replaced_buffers_with_the_others(replaced: tuple[int, ...]) -> None:
    # Releasing is the way out of ReplacedBuffersError, so it refuses nothing for replaced tensors.
    cache, state = filled_cache()
    for index in replaced:
        replace_keys(cache, index)
    state.release()
    assert all(isinstance(layer.state, cachelife.Unallocated) for layer in state.layers)
    assert not any(layer.is_initialized for layer in cache.layers)
    state.pin(batch_size=2, shapes=SHAPES, dtype=torch.float32, device="cpu")
    state.reset()  # pinned afresh: nothing is replaced any more
    assert all(isinstance(layer.state, cachelife.Pinned) for layer in state.layers)


@pytest.mark.parametrize("gone", [1, 3], ids=["middle", "last"])
def test_release_and_reset_with_a_layer_gone_change_no_layer(gone: int) -> None:
    cache, state = filled_cache()
    cache.layers[gone] = StaticLayer(max_cache_len=MAX_LEN)  # the tracked layer object is dropped
    gc.collect()
    others = [layer for layer in state.layers if layer.index != gone]
    before = [(layer.state, *live_tensors(layer)) for layer in others]
    copies = [(keys.clone(), values.clone()) for _, keys, values in before]
    for operation in (state.release, state.reset):
        with pytest.raises(UnsupportedCacheError, match=rf"layer {gone} \(self-attention\) no longer exists"):
            operation()
        for layer, (old_state, keys, values), (keys_copy, values_copy) in zip(others, before, copies, strict=True):
            assert layer.state == old_state
            now_keys, now_values = live_tensors(layer)
            assert now_keys is keys  # the same tensors: not released, not replaced
            assert now_values is values
            assert torch.equal(now_keys, keys_copy)
            assert torch.equal(now_values, values_copy)


def test_reset_and_release_inside_a_compiled_region_change_no_layer(
    monkeypatch: pytest.MonkeyPatch, as_if_traced: Callable[[], None]
) -> None:
    _, state = filled_cache()
    before = snapshot(state)
    as_if_traced()
    for operation in (state.reset, state.release):
        with pytest.raises(CompiledRegionError, match=r"layer 0 \(self-attention\) while dynamo traces"):
            operation()
    monkeypatch.undo()
    assert_unchanged(state, before)
