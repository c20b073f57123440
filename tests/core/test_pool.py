"""The pinned-buffer pool: same addresses across generate calls, kept caches never overwritten, budget."""

from __future__ import annotations

import gc
from typing import Any

import attrs
import pytest
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import EncoderDecoderCache, StaticCache, StaticLayer

import cachelife
from cachelife.core import buffers, reorder
from cachelife.core.buffers import PinSpec
from cachelife.core.layer_lifecycle import Pinned
from cachelife.core.pool import CachePool, pool_key
from cachelife.errors import InvalidArgumentError
from cachelife.integration.call_arguments import find_cache
from cachelife.integration.enabling import release_pool
from cachelife.tools import zoo

SETTINGS: dict[str, Any] = {"do_sample": False, "max_new_tokens": 5, "min_new_tokens": 5}


class Addresses:
    """Records the data pointers of every layer each time a cache reaches the model's forward call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: list[tuple[tuple[tuple[str, int], ...], ...]] = []
        self.cache_ids: list[int] = []
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = find_cache(kwargs)
        if cache is None or (self.cache_ids and self.cache_ids[-1] == id(cache)):
            return
        self.cache_ids.append(id(cache))
        state = cachelife.lifecycle(cache)
        pointers = []
        for layer in state.layers:
            assert isinstance(layer.state, Pinned)  # every call starts from empty, pinned buffers
            assert not any(bool(t.any()) for _, t in buffers.static_tensors(layer.layer))
            pointers.append(layer.buffers.data_ptrs)
        self.seen.append(tuple(pointers))


@pytest.mark.parametrize("name", ["t5", "llama"])
def test_generate_calls_of_one_shape_reuse_the_same_addresses(name: str) -> None:
    built = zoo.build(name)
    inputs = built.inputs(2, 9, 1)
    expected = zoo.generate_tokens(built.model, inputs, **SETTINGS, disable_compile=True)
    cachelife.enable(built.model)
    addresses = Addresses(built.model)
    for _ in range(4):
        tokens = zoo.generate_tokens(built.model, inputs, **SETTINGS, cache_implementation="static")
        assert torch.equal(tokens, expected)
    assert len(set(addresses.seen)) == 1
    pool = cachelife.pool_of(built.model)
    assert pool is not None
    assert (pool.hits, pool.misses) == (3, 1)


def test_a_cache_the_caller_keeps_is_never_overwritten() -> None:
    built = zoo.build("t5")
    model = built.model
    cachelife.enable(model)
    addresses = Addresses(model)
    first = model.generate(
        **built.inputs(2, 9, 1), **SETTINGS, cache_implementation="static", return_dict_in_generate=True
    )
    assert not isinstance(first, torch.Tensor)
    kept = first.get("cache", first.get("past_key_values"))
    assert isinstance(kept, EncoderDecoderCache)
    assert isinstance(kept.self_attention_cache, StaticCache)
    snapshot = [t.clone() for layer in kept.self_attention_cache.layers for _, t in buffers.static_tensors(layer)]
    zoo.generate_tokens(model, built.inputs(2, 9, 2), **SETTINGS, cache_implementation="static")
    after = [t for layer in kept.self_attention_cache.layers for _, t in buffers.static_tensors(layer)]
    assert all(torch.equal(a, b) for a, b in zip(snapshot, after, strict=True))
    assert addresses.seen[0] != addresses.seen[1]
    del first, kept, after
    gc.collect()
    zoo.generate_tokens(model, built.inputs(2, 9, 3), **SETTINGS, cache_implementation="static")
    assert addresses.seen[2] in addresses.seen[:2]  # once dropped, its buffers serve again


def test_budget_keeps_at_most_that_many_idle_bytes_least_recently_used_first() -> None:
    built = zoo.build("llama")
    model = built.model
    cachelife.enable(model, pool_bytes=1)  # smaller than any cache: nothing is kept
    for _ in range(2):
        zoo.generate_tokens(model, built.inputs(2, 9, 1), **SETTINGS, cache_implementation="static")
    pool = cachelife.pool_of(model)
    assert pool is not None
    assert (pool.hits, pool.misses, pool.idle_sets) == (0, 2, 0)

    cachelife.enable(model, pool_bytes=10**9)
    for batch in (1, 2, 1, 2):
        zoo.generate_tokens(model, built.inputs(batch, 9, 1), **SETTINGS, cache_implementation="static")
    assert pool.idle_sets == 2
    sizes = pool.idle_bytes
    cachelife.enable(model, pool_bytes=sizes - 1)  # only the budget for one set: the older is evicted next
    zoo.generate_tokens(model, built.inputs(1, 9, 1), **SETTINGS, cache_implementation="static")
    assert pool.idle_sets == 1
    release_pool(model)
    assert (pool.idle_sets, pool.idle_bytes) == (0, 0)


def test_pool_off() -> None:
    built = zoo.build("llama")
    cachelife.enable(built.model, pool_bytes=0)
    assert cachelife.pool_of(built.model) is None
    with pytest.raises(InvalidArgumentError, match=r"pool_bytes must be an int >= 0 \(0 turns the pool off\)"):
        cachelife.enable(built.model, pool_bytes=-1, on_unpinned="raise")
    guard = built.model.__dict__["_cachelife_guard"]
    assert guard.on_unpinned == "pin"  # the refused call changed nothing


def test_reused_buffers_leave_the_layer_as_a_fresh_pin_would() -> None:
    config = zoo.llama_tiny()
    spec = PinSpec(
        batch_size=2,
        num_kv_heads=2,
        key_head_dim=16,
        value_head_dim=16,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    fresh = StaticCache(config=config, max_cache_len=6)
    fresh_state = cachelife.lifecycle(fresh)
    fresh_state.pin_specs([spec, spec])
    fresh.layers[0].update(torch.ones(2, 2, 3, 16), torch.ones(2, 2, 3, 16))
    reused = StaticCache(config=config, max_cache_len=6)
    state = cachelife.lifecycle(reused)
    tensors = [dict(buffers.static_tensors(layer)) for layer in fresh.layers]
    state.pin_specs([spec, spec], tensors)
    for a, b in zip(fresh.layers, reused.layers, strict=True):
        assert set(vars(a)) == set(vars(b))
        for name, value in vars(a).items():
            other = vars(b)[name]
            if isinstance(value, torch.Tensor):
                assert value is other  # the very same tensors, now empty
                assert not bool(other.any())
            elif name == "reorder_cache":  # cachelife's in-place beam reorder, one per layer
                assert reorder.is_in_place(a)
                assert reorder.is_in_place(b)
            else:
                assert value == other, name


def test_pool_keys_distinguish_every_buffer_property() -> None:
    config = zoo.llama_tiny()
    cache = StaticCache(config=config, max_cache_len=6)
    state = cachelife.lifecycle(cache)
    base = PinSpec(
        batch_size=2,
        num_kv_heads=2,
        key_head_dim=16,
        value_head_dim=16,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    variants = [
        base,
        attrs.evolve(base, batch_size=3),
        attrs.evolve(base, num_kv_heads=1),
        attrs.evolve(base, key_head_dim=8),
        attrs.evolve(base, value_head_dim=8),
        attrs.evolve(base, dtype=torch.bfloat16),
    ]
    keys = {pool_key(state, [spec, spec]) for spec in variants}
    assert len(keys) == len(variants)
    assert CachePool().lease(pool_key(state, [base, base])) is None


def test_a_cache_kept_only_by_a_reference_cycle_comes_back_once_the_collector_ran_and_lease_runs_none() -> None:
    # torch.compile traces leave the traced cache in reference cycles until the collector runs; the pool does
    # not run it on a lease (cachelife collects once after a call that compiled, see cachelife.release's docs).
    built = zoo.build("llama")
    model = built.model
    cachelife.enable(model)
    gc.disable()
    try:
        out = model.generate(
            **built.inputs(2, 9, 1), **SETTINGS, cache_implementation="static", return_dict_in_generate=True
        )
        assert not isinstance(out, torch.Tensor)
        cycle: list[object] = [out.get("cache", out.get("past_key_values"))]
        cycle.append(cycle)
        del out, cycle
        zoo.generate_tokens(model, built.inputs(2, 9, 2), **SETTINGS, cache_implementation="static")
        pool = cachelife.pool_of(model)
        assert pool is not None
        assert (pool.hits, pool.misses) == (0, 2)  # the first cache is still reachable, through the cycle
        gc.collect()
        zoo.generate_tokens(model, built.inputs(2, 9, 3), **SETTINGS, cache_implementation="static")
    finally:
        gc.enable()
    assert (pool.hits, pool.misses) == (1, 2)


def _kept_cache_tensor(model: PreTrainedModel, inputs: dict[str, Any], how: str) -> torch.Tensor:
    """A tensor of the first layer of a returned cache, held the way `how` says, the cache itself dropped."""
    out = model.generate(**inputs, **SETTINGS, cache_implementation="static", return_dict_in_generate=True)
    assert not isinstance(out, torch.Tensor)
    cache = out.get("cache", out.get("past_key_values"))
    layer = cachelife.lifecycle(cache).self_attention[0].layer
    assert isinstance(layer, StaticLayer)
    assert layer.keys is not None
    held = {"tensor": layer.keys, "view": layer.keys[:, :, :4], "length": layer.cumulative_length}[how]
    del out, cache, layer
    return held


@pytest.mark.parametrize("how", ["tensor", "view", "length"])
def test_a_tensor_a_caller_keeps_from_a_dropped_cache_is_never_overwritten(how: str) -> None:
    built = zoo.build("llama")
    model = cachelife.enable(built.model)
    held = _kept_cache_tensor(model, built.inputs(2, 9, 1), how)
    content = held.clone()
    zoo.generate_tokens(model, built.inputs(2, 9, 2), **SETTINGS, cache_implementation="static")
    assert torch.equal(held, content)
    pool = cachelife.pool_of(model)
    assert pool is not None
    assert pool.hits == 0  # the set the caller still reaches was not lent again
    del held
    zoo.generate_tokens(model, built.inputs(2, 9, 3), **SETTINGS, cache_implementation="static")
    assert pool.hits == 1  # once nothing reaches it, it is reused


def test_lease_runs_no_garbage_collection_when_callers_keep_their_outputs() -> None:
    built = zoo.build("llama")
    model = cachelife.enable(built.model)
    collections = gc.get_stats()[2]["collections"]
    kept = [
        model.generate(
            **built.inputs(2, 9, seed), **SETTINGS, cache_implementation="static", return_dict_in_generate=True
        )
        for seed in range(4)
    ]
    assert gc.get_stats()[2]["collections"] == collections
    pool = cachelife.pool_of(model)
    assert pool is not None
    assert (pool.hits, pool.misses, len(kept)) == (0, 4, 4)
