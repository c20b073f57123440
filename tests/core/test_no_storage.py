"""Layers without storage (transformers' `DummyLayer`, 5.24+): state `NoStorage`, listed, skipped, never blocking.

The model is a tiny NemotronH built in code (random weights, no download) whose layer types mix attention
with "mlp" and "moe" layers; transformers 5.24 gives those layers a `DummyLayer` in its `StaticCache`.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
from transformers import PreTrainedModel, StaticCache, cache_utils

import cachelife
from cachelife.core import buffers
from cachelife.core.buffers import PinSpec
from cachelife.core.layer_lifecycle import TRANSITIONS, Event, FillRecord, LayerLifecycle, NoStorage
from cachelife.core.pinning import pin_for_model
from cachelife.core.shapes import decoder_only_shapes, storage_less_layers
from cachelife.errors import CacheShapeError, IllegalTransitionError, UnpinnedCacheError, UnsupportedCacheError
from cachelife.tools.recipe import lifecycle_table

DUMMY = getattr(cache_utils, "DummyLayer", None)
needs_dummy_layer = pytest.mark.skipif(
    DUMMY is None, reason="transformers.cache_utils.DummyLayer exists from transformers 5.24 on"
)
LAYER_TYPES = ["full_attention", "mlp", "full_attention", "moe"]
STORAGE, NO_STORAGE = (0, 2), (1, 3)
EVENTS: tuple[Event, ...] = ("pin", "fill", "reset", "release")
SPEC = PinSpec(
    batch_size=1, num_kv_heads=2, key_head_dim=8, value_head_dim=8, dtype=torch.float32, device=torch.device("cpu")
)


def nemotron_h() -> PreTrainedModel:
    # Looked up at run time: NemotronH is not in typings/, which describe only what cachelife itself touches.
    family = importlib.import_module("transformers.models.nemotron_h")
    config = family.NemotronHConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        layer_types=LAYER_TYPES,
        n_routed_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16,
        n_groups=1,
        topk_group=1,
    )
    torch.manual_seed(0)
    model = family.NemotronHForCausalLM(config).eval()
    assert isinstance(model, PreTrainedModel)
    return model


def states(cache: StaticCache) -> list[str]:
    return [type(layer.state).__name__ for layer in cachelife.lifecycle(cache).layers]


@needs_dummy_layer
def test_a_dummy_layer_is_adopted_as_no_storage_and_every_transition_is_illegal() -> None:
    assert DUMMY is not None
    layer = DUMMY()
    tracked = LayerLifecycle.adopt(layer, index=1, role="self")
    assert tracked.state == NoStorage()
    assert not tracked.holds_storage
    assert not tracked.is_pinned
    assert tracked.capacity is None
    assert tracked.describe() == "layer 1 (self-attention, no storage)"
    assert not any(state is NoStorage for state, _ in TRANSITIONS)
    asks = {
        "pin": lambda: tracked.pin(SPEC),
        "fill": lambda: tracked.fill(FillRecord("test")),
        "reset": tracked.reset,
        "release": tracked.release,
    }
    for event in EVENTS:
        with pytest.raises(IllegalTransitionError, match=rf"cannot {event} layer 1 .*: it is NoStorage; .*DummyLayer"):
            asks[event]()
        assert tracked.state == NoStorage()  # nothing changed
    assert layer.keys is None
    assert layer.values is None
    with pytest.raises(UnsupportedCacheError, match=r"is a DummyLayer, not a StaticLayer"):
        _ = tracked.layer
    with pytest.raises(UnpinnedCacheError, match=r"layer 1 \(self-attention, no storage\) is NoStorage .*DummyLayer"):
        _ = tracked.buffers


@needs_dummy_layer
def test_walk_through_a_cache_with_layers_without_storage() -> None:
    model = nemotron_h()
    assert storage_less_layers(model.config) == frozenset(NO_STORAGE)
    assert len(decoder_only_shapes(model.config).self_attention) == len(LAYER_TYPES)
    cache = StaticCache(config=model.config, max_cache_len=12)
    assert [buffers.is_storage_less_layer(layer) for layer in cache.layers] == [False, True, False, True]
    state = cachelife.lifecycle(cache)
    assert states(cache) == ["Unallocated", "NoStorage", "Unallocated", "NoStorage"]
    assert [layer.index for layer in state.storage_layers] == list(STORAGE)
    assert [layer.index for layer in state.unpinned()] == list(STORAGE)
    assert not state.is_pinned

    pin_for_model(cache, model, batch_size=1)
    assert states(cache) == ["Pinned", "NoStorage", "Pinned", "NoStorage"]
    assert state.is_pinned
    assert not state.is_filled
    assert state.unpinned() == ()
    state.require_pinned()

    state.fill(FillRecord("test", positions=3))
    assert states(cache) == ["Filled", "NoStorage", "Filled", "NoStorage"]
    assert state.is_filled

    state.reset()
    assert states(cache) == ["Pinned", "NoStorage", "Pinned", "NoStorage"]
    before = [layer.state for layer in state.layers]
    with pytest.raises(
        IllegalTransitionError, match=r"cannot pin layer 3 \(self-attention, no storage\): it is NoStorage"
    ):
        state.layers[3].pin(SPEC)
    assert [layer.state for layer in state.layers] == before

    state.release()
    assert states(cache) == ["Unallocated", "NoStorage", "Unallocated", "NoStorage"]
    assert not state.is_pinned


@needs_dummy_layer
def test_specs_skip_layers_without_storage_and_must_line_up() -> None:
    model = nemotron_h()
    cache = StaticCache(config=model.config, max_cache_len=12)
    state = cachelife.lifecycle(cache)
    shapes = cachelife.model_cache_shapes(model)
    specs = state.specs_for(batch_size=1, shapes=shapes, dtype=torch.float32, device="cpu")
    assert [spec is None for spec in specs] == [False, True, False, True]
    with pytest.raises(CacheShapeError, match=r"layer 1 \(self-attention, no storage\) is NoStorage but its pin spec"):
        state.pin_specs([SPEC] * 4)
    with pytest.raises(CacheShapeError, match=r"layer 0 \(self-attention\) is Unallocated but its pin spec is None"):
        state.pin_specs([None] * 4)
    assert states(cache) == ["Unallocated", "NoStorage", "Unallocated", "NoStorage"]


@needs_dummy_layer
def test_the_lifecycle_table_and_debug_log_list_layers_without_storage(caplog: pytest.LogCaptureFixture) -> None:
    model = nemotron_h()
    with caplog.at_level(logging.DEBUG, logger="cachelife"):
        cache = cachelife.prepare_static_cache(model, batch_size=1, max_cache_len=12)
    logged = [record.getMessage() for record in caplog.records]
    assert "layer=1 role=self adopt: NoStorage (DummyLayer stores no keys or values)" in logged
    assert any(line.startswith("layer=0 role=self pin: Unallocated -> Pinned") for line in logged)
    rows = lifecycle_table(cachelife.lifecycle(cache)).splitlines()
    assert rows[2].split() == ["1", "self", "NoStorage", "-", "-", "-", "-"]
    assert rows[1].split()[:3] == ["0", "self", "Pinned"]


@needs_dummy_layer
def test_generate_with_cachelife_equals_eager_dynamic_generate() -> None:
    model = nemotron_h()
    inputs = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    eager = model.generate(inputs, max_new_tokens=6, do_sample=False)
    seen: list[list[str]] = []

    def record(module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if isinstance(cache, StaticCache) and not seen:
            seen.append(states(cache))

    cachelife.enable(model, on_unpinned="raise")
    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        static = model.generate(inputs, max_new_tokens=6, do_sample=False, cache_implementation="static")
    finally:
        handle.remove()
        cachelife.disable(model)
    assert seen == [["Pinned", "NoStorage", "Pinned", "NoStorage"]]  # storage pinned before the first forward
    assert isinstance(static, torch.Tensor)
    assert isinstance(eager, torch.Tensor)
    assert eager.shape == (2, 11)
    assert torch.equal(static, eager)


@needs_dummy_layer
def test_other_unsupported_layers_are_still_refused_whole() -> None:
    cache = StaticCache(config=nemotron_h().config, max_cache_len=12)
    cache.layers[2] = cache_utils.DynamicLayer()
    with pytest.raises(UnsupportedCacheError, match=r"layer 2 \(self-attention\) is a DynamicLayer"):
        cachelife.lifecycle(cache)
    assert all(not getattr(layer, "keys", None) for layer in cache.layers)
