"""Stateful property tests: random sequences of lifecycle operations, the whole state checked after each step.

Two machines. `CacheMachine` drives the layers of an `EncoderDecoderCache` directly (pin, fill with real
writes, reset, release, whole-cache operations, a model replacing the cross-attention cache).
`ModelMachine` drives a tiny Llama through the public API (prepare_static_cache, enable, disable, forward
calls, reset, release). After every step: each layer's recorded state matches its real buffers (allocated
or not, shape, dtype, device, static marks, data pointers kept from pin to release), and a step the table
forbids raised the documented error and changed nothing. Example counts: the `ci` profile (default,
tests/conftest.py) and the `fuzz` profile of `nox -s fuzz`.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from transformers.cache_utils import EncoderDecoderCache, StaticCache

import cachelife
from cachelife.core import buffers
from cachelife.core.buffers import PinSpec
from cachelife.core.cache_lifecycle import CacheLifecycle, static_parts
from cachelife.core.layer_lifecycle import (
    TRANSITIONS,
    Event,
    Filled,
    FillRecord,
    LayerLifecycle,
    Pinned,
    Unallocated,
)
from cachelife.errors import CacheShapeError, IllegalTransitionError, UnpinnedCacheError
from cachelife.integration.call_arguments import cache_argument_name
from cachelife.tools import zoo

CPU = torch.device("cpu")
SELF_LEN, CROSS_LEN, HEADS, DIM = 6, 4, 2, 8
SPEC = PinSpec(batch_size=2, num_kv_heads=HEADS, key_head_dim=DIM, value_head_dim=DIM, dtype=torch.float32, device=CPU)


def check_layer(layer: LayerLifecycle, pinned_at: dict[int, tuple[tuple[str, int], ...]]) -> None:
    """The recorded state matches the real buffers; pointers are the ones recorded at pin time."""
    state = layer.state
    real = layer.layer
    if isinstance(state, Unallocated):
        assert not real.is_initialized
        assert real.keys is None
        assert real.values is None
        assert id(layer) not in pinned_at
        return
    assert isinstance(state, Pinned | Filled)
    assert real.is_initialized
    assert real.keys is not None
    assert real.values is not None
    assert tuple(real.keys.shape) == state.buffers.key_shape
    assert tuple(real.values.shape) == state.buffers.value_shape
    assert real.keys.dtype == state.buffers.dtype
    assert real.keys.device == state.buffers.device
    assert all(buffers.is_marked_static(t) for _, t in buffers.static_tensors(real))
    assert tuple((name, t.data_ptr()) for name, t in buffers.static_tensors(real)) == state.buffers.data_ptrs
    assert pinned_at[id(layer)] == state.buffers.data_ptrs  # unchanged since pin, resets included
    if isinstance(state, Pinned):
        assert int(real.cumulative_length) == 0
        assert not bool(real.keys.any())
        assert not layer.cross_content_written


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        config = zoo.llama_tiny()
        self.cache = EncoderDecoderCache(
            StaticCache(config=config, max_cache_len=SELF_LEN), StaticCache(config=config, max_cache_len=CROSS_LEN)
        )
        self.pinned_at: dict[int, tuple[tuple[str, int], ...]] = {}

    @property
    def state(self) -> CacheLifecycle:
        return cachelife.lifecycle(self.cache)

    def apply(self, layer: LayerLifecycle, event: Event, step: Any) -> None:
        """Run a layer transition; if the table forbids it, it must raise and change nothing."""
        before = layer.state
        legal = (type(before), event) in TRANSITIONS
        refused: IllegalTransitionError | None = None
        try:
            step()
        except IllegalTransitionError as error:
            refused = error
        if refused is not None:
            assert not legal, f"{event} from {type(before).__name__} is legal but raised {refused}"
            assert layer.state is before
            return
        assert legal, f"{event} from {type(before).__name__} should have raised"
        if event == "pin":
            self.pinned_at[id(layer)] = layer.buffers.data_ptrs
        if event == "release":
            self.pinned_at.pop(id(layer), None)

    @rule(index=st.integers(0, 3))
    def pin(self, index: int) -> None:
        layer = self.state.layers[index]
        self.apply(layer, "pin", lambda: layer.pin(SPEC))

    @rule(index=st.integers(0, 3), positions=st.integers(1, 3))
    def write_and_record(self, index: int, positions: int) -> None:
        """What a forward call does: write the layer (only a pinned one: never allocate lazily), then record."""
        layer = self.state.layers[index]
        if layer.is_pinned and isinstance(layer.state, Pinned):
            if layer.role == "cross":
                layer.layer.update(torch.ones(2, HEADS, CROSS_LEN, DIM), torch.ones(2, HEADS, CROSS_LEN, DIM))
                self.cache.is_updated[layer.index] = True
            else:
                layer.layer.update(torch.ones(2, HEADS, positions, DIM), torch.ones(2, HEADS, positions, DIM))
        self.apply(layer, "fill", lambda: layer.fill(FillRecord("machine", positions)))

    @rule(index=st.integers(0, 3))
    def reset(self, index: int) -> None:
        layer = self.state.layers[index]
        self.apply(layer, "reset", layer.reset)

    @rule(index=st.integers(0, 3))
    def release(self, index: int) -> None:
        layer = self.state.layers[index]
        self.apply(layer, "release", layer.release)

    @rule()
    def pin_all(self) -> None:
        shapes = cachelife.CacheShapes.uniform(
            2, cachelife.LayerShape(HEADS, DIM, DIM), cachelife.LayerShape(HEADS, DIM, DIM)
        )
        unallocated = [layer for layer in self.state.layers if isinstance(layer.state, Unallocated)]
        self.state.pin(batch_size=2, shapes=shapes, dtype=torch.float32, device=CPU)
        for layer in unallocated:
            self.pinned_at[id(layer)] = layer.buffers.data_ptrs
        self.state.require_pinned()

    @rule(batch=st.sampled_from([1, 3]))
    def pin_all_with_another_batch(self, batch: int) -> None:
        before = [layer.state for layer in self.state.layers]
        shapes = cachelife.CacheShapes.uniform(
            2, cachelife.LayerShape(HEADS, DIM, DIM), cachelife.LayerShape(HEADS, DIM, DIM)
        )
        try:
            self.state.pin(batch_size=batch, shapes=shapes, dtype=torch.float32, device=CPU)
        except CacheShapeError:
            assert any(layer.is_pinned for layer in self.state.layers)
            assert [layer.state for layer in self.state.layers] == before
        else:
            # Nothing was pinned before: every layer is now pinned at the new batch.
            assert not any(state_is_pinned for state_is_pinned in (isinstance(s, Pinned | Filled) for s in before))
            for layer in self.state.layers:
                self.pinned_at[id(layer)] = layer.buffers.data_ptrs
            self.state.release()
            self.pinned_at.clear()

    @rule()
    def reset_all(self) -> None:
        self.state.reset()

    @rule()
    def release_all(self) -> None:
        self.state.release()
        self.pinned_at.clear()

    @rule()
    def require_pinned(self) -> None:
        try:
            self.state.require_pinned()
        except UnpinnedCacheError:
            assert not all(layer.is_pinned for layer in self.state.layers)
        else:
            assert all(layer.is_pinned for layer in self.state.layers)

    @rule()
    def model_replaces_the_cross_cache(self) -> None:
        old = self.state.cross_attention
        for layer in old:
            self.pinned_at.pop(id(layer), None)
        self.cache.cross_attention_cache = StaticCache(config=zoo.llama_tiny(), max_cache_len=CROSS_LEN)
        self.cache.is_updated = dict.fromkeys(self.cache.is_updated, False)
        assert all(isinstance(layer.state, Unallocated) for layer in self.state.cross_attention)

    @invariant()
    def recorded_state_matches_buffers(self) -> None:
        state = self.state
        for layer in state.layers:
            check_layer(layer, self.pinned_at)
        assert state.is_pinned == all(layer.is_pinned for layer in state.layers)
        assert state.is_filled == all(isinstance(layer.state, Filled) for layer in state.layers)


class ModelMachine(RuleBasedStateMachine):
    """The public API on a real model: enable, disable, prepare, forward calls, reset, release."""

    built = zoo.build("llama")

    def __init__(self) -> None:
        super().__init__()
        self.model = self.built.model
        cachelife.disable(self.model)
        self.cache: StaticCache | None = None
        self.pinned_at: dict[int, tuple[tuple[str, int], ...]] = {}
        self.attributes = dict(self.model.__dict__)

    def teardown(self) -> None:
        cachelife.disable(self.model)

    @rule()
    def prepare(self) -> None:
        cache = cachelife.prepare_static_cache(self.model, batch_size=2, max_cache_len=12)
        assert isinstance(cache, StaticCache)
        self.cache = cache
        self.pinned_at = {id(layer): layer.buffers.data_ptrs for layer in cachelife.lifecycle(cache).layers}

    @rule(on_unpinned=st.sampled_from(["pin", "raise"]))
    def enable(self, on_unpinned: Any) -> None:
        cachelife.enable(self.model, on_unpinned=on_unpinned, pool_bytes=0)
        assert cachelife.is_enabled(self.model)

    @rule()
    def disable(self) -> None:
        cachelife.disable(self.model)
        assert dict(self.model.__dict__) == self.attributes

    @precondition(lambda self: self.cache is not None)
    @rule(tokens=st.integers(1, 3))
    def forward(self, tokens: int) -> None:
        cache = self.cache
        assert cache is not None
        state = cachelife.lifecycle(cache)
        used = int(cache.layers[0].cumulative_length) if state.is_pinned else 0
        if used + tokens > 12:
            return
        before = [layer.state for layer in state.layers]
        ids = self.built.inputs(2, tokens, used)["input_ids"]
        enabled = cachelife.is_enabled(self.model)
        strict = enabled and self.model.__dict__["_cachelife_guard"].on_unpinned == "raise"
        if not state.is_pinned and (not enabled or strict):
            if strict:
                try:
                    self.model(input_ids=ids, **{cache_argument_name(self.model): cache})
                except UnpinnedCacheError:
                    assert [layer.state for layer in state.layers] == before
                    return
                raise AssertionError("an unpinned cache reached a strict model's forward")
            return  # without cachelife the layers would allocate lazily: not a lifecycle step
        with torch.no_grad():
            self.model(input_ids=ids, **{cache_argument_name(self.model): cache})
        if enabled:
            for layer in state.layers:
                self.pinned_at.setdefault(id(layer), layer.buffers.data_ptrs)
                assert isinstance(layer.state, Filled)
        else:
            # Unobserved writes: the lifecycle keeps its last state; reset makes it true again.
            state.reset()

    @precondition(lambda self: self.cache is not None)
    @rule()
    def reset(self) -> None:
        assert self.cache is not None
        cachelife.lifecycle(self.cache).reset()

    @precondition(lambda self: self.cache is not None)
    @rule()
    def release(self) -> None:
        assert self.cache is not None
        cachelife.lifecycle(self.cache).release()
        self.pinned_at.clear()

    @invariant()
    def recorded_state_matches_buffers(self) -> None:
        if self.cache is None:
            return
        for layer in cachelife.lifecycle(self.cache).layers:
            check_layer(layer, self.pinned_at)
        _, own, _ = static_parts(self.cache)
        assert len(own.layers) == 2


TestCacheMachine = CacheMachine.TestCase
TestModelMachine = ModelMachine.TestCase
