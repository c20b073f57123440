"""Walk-through tests of one layer's state machine: every legal and illegal transition, whole state checked."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import pytest
import torch
from transformers.cache_utils import (
    DynamicLayer,
    EncoderDecoderCache,
    StaticCache,
    StaticLayer,
    StaticSlidingWindowLayer,
)

import cachelife
from cachelife.core import buffers
from cachelife.core.buffers import PinSpec
from cachelife.core.layer_lifecycle import (
    TRANSITIONS,
    Event,
    Filled,
    FillRecord,
    LayerLifecycle,
    LayerState,
    Pinned,
    Role,
    Unallocated,
)
from cachelife.errors import (
    CompiledRegionError,
    IllegalTransitionError,
    ReplacedBuffersError,
    UnmarkedBuffersError,
    UnpinnedCacheError,
    UnsupportedCacheError,
)
from cachelife.tools import zoo

SPEC = PinSpec(
    batch_size=2, num_kv_heads=3, key_head_dim=5, value_head_dim=7, dtype=torch.float32, device=torch.device("cpu")
)
MAX_LEN = 6
EVENTS: tuple[Event, ...] = ("pin", "fill", "reset", "release")


def check_whole_state(tracked: LayerLifecycle, layer: StaticLayer, expected: type[LayerState]) -> None:
    """The recorded state matches the real buffers: allocation, shape, dtype, device, marks, pointers."""
    state = tracked.state
    assert type(state) is expected
    if isinstance(state, Unallocated):
        assert not layer.is_initialized
        assert layer.keys is None
        assert layer.values is None
        assert layer.cumulative_length.device.type == "cpu"
        assert int(layer.cumulative_length) == 0
        assert not hasattr(layer, "batch_size")
        return
    assert isinstance(state, Pinned | Filled)
    assert layer.is_initialized
    assert layer.keys is not None
    assert layer.values is not None
    assert tuple(layer.keys.shape) == state.buffers.key_shape == (2, 3, MAX_LEN, 5)
    assert tuple(layer.values.shape) == state.buffers.value_shape == (2, 3, MAX_LEN, 7)
    assert layer.keys.dtype == state.buffers.dtype == torch.float32
    assert layer.keys.device == state.buffers.device == torch.device("cpu")
    assert all(buffers.is_marked_static(t) for _, t in buffers.static_tensors(layer))
    live = {name: t.data_ptr() for name, t in buffers.static_tensors(layer)}
    assert dict(state.buffers.data_ptrs) == live
    if isinstance(state, Pinned):
        assert int(layer.cumulative_length) == 0
        assert not bool(layer.keys.any())
        assert not bool(layer.values.any())


def write(layer: StaticLayer, positions: int = 2) -> None:
    """What a forward call does to a pinned layer: transformers' own update."""
    layer.update(torch.ones(2, 3, positions, 5), torch.ones(2, 3, positions, 7))


def fresh(role: Role = "self") -> tuple[LayerLifecycle, StaticLayer]:
    layer = StaticLayer(max_cache_len=MAX_LEN)
    return LayerLifecycle.adopt(layer, index=4, role=role), layer


def test_documented_path_walk_through() -> None:
    tracked, layer = fresh()
    check_whole_state(tracked, layer, Unallocated)

    tracked.pin(SPEC)
    check_whole_state(tracked, layer, Pinned)
    pinned_ptrs = tracked.buffers.data_ptrs

    write(layer)
    tracked.fill(FillRecord("test", positions=2, compiled=False))
    check_whole_state(tracked, layer, Filled)
    assert int(layer.cumulative_length) == 2

    tracked.reset()
    check_whole_state(tracked, layer, Pinned)
    assert tracked.buffers.data_ptrs == pinned_ptrs

    write(layer, 3)
    tracked.fill(FillRecord("test"))
    check_whole_state(tracked, layer, Filled)

    tracked.release()
    check_whole_state(tracked, layer, Unallocated)

    tracked.pin(SPEC)
    check_whole_state(tracked, layer, Pinned)


def test_transition_table_is_the_documented_one() -> None:
    assert dict(TRANSITIONS) == {
        (Unallocated, "pin"): Pinned,
        (Pinned, "fill"): Filled,
        (Filled, "reset"): Pinned,
        (Pinned, "reset"): Pinned,
        (Pinned, "release"): Unallocated,
        (Filled, "release"): Unallocated,
    }


def reach(target: type[LayerState]) -> tuple[LayerLifecycle, StaticLayer]:
    tracked, layer = fresh()
    if target is not Unallocated:
        tracked.pin(SPEC)
    if target is Filled:
        write(layer)
        tracked.fill(FillRecord("test", 2))
    return tracked, layer


STEPS: dict[Event, Callable[[LayerLifecycle], object]] = {
    "pin": lambda tracked: tracked.pin(SPEC),
    "fill": lambda tracked: tracked.fill(FillRecord("test")),
    "reset": lambda tracked: tracked.reset(),
    "release": lambda tracked: tracked.release(),
}


@pytest.mark.parametrize(("start", "event"), list(itertools.product((Unallocated, Pinned, Filled), EVENTS)))
def test_every_transition(start: type[LayerState], event: Event) -> None:
    tracked, layer = reach(start)
    before = tracked.state
    before_ptrs = [t.data_ptr() for _, t in buffers.static_tensors(layer)]
    target = TRANSITIONS.get((start, event))
    if target is None:
        with pytest.raises(IllegalTransitionError) as raised:
            STEPS[event](tracked)
        message = str(raised.value)
        assert f"cannot {event} layer 4 (self-attention)" in message
        assert start.__name__ in message
        assert tracked.state is before  # nothing changed
        assert [t.data_ptr() for _, t in buffers.static_tensors(layer)] == before_ptrs
        check_whole_state(tracked, layer, start)
        assert isinstance(raised.value, RuntimeError)
    else:
        STEPS[event](tracked)
        check_whole_state(tracked, layer, target)


def test_reset_keeps_addresses_and_empties_content() -> None:
    tracked, layer = reach(Filled)
    assert layer.keys is not None
    keys = layer.keys
    assert bool(keys.any())
    tracked.reset()
    assert layer.keys is keys
    assert not bool(keys.any())
    assert int(layer.cumulative_length) == 0


def test_pin_refuses_while_dynamo_traces(monkeypatch: pytest.MonkeyPatch, as_if_traced: Callable[[], None]) -> None:
    tracked, layer = fresh()
    as_if_traced()
    with pytest.raises(CompiledRegionError, match="while dynamo traces"):
        tracked.pin(SPEC)
    monkeypatch.undo()
    check_whole_state(tracked, layer, Unallocated)


def test_release_and_reset_refuse_while_a_cuda_graph_is_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    tracked, layer = reach(Filled)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for event in ("reset", "release"):
        with pytest.raises(CompiledRegionError, match="CUDA graph is being captured"):
            STEPS[event](tracked)
    monkeypatch.undo()
    check_whole_state(tracked, layer, Filled)


def test_failed_allocation_leaves_the_layer_unallocated(monkeypatch: pytest.MonkeyPatch) -> None:
    tracked, layer = fresh()
    calls = {"n": 0}
    real = torch._dynamo.mark_static_address

    def fail_second(tensor: torch.Tensor, guard: bool = False) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("injected")
        real(tensor, guard=guard)

    monkeypatch.setattr(torch._dynamo, "mark_static_address", fail_second)
    monkeypatch.setattr(layer, "lazy_initialization", _lazy_without_marks(layer))
    with pytest.raises(torch.OutOfMemoryError):
        tracked.pin(SPEC)
    check_whole_state(tracked, layer, Unallocated)


def _lazy_without_marks(layer: StaticLayer) -> Callable[[torch.Tensor, torch.Tensor], None]:
    # Allocate as transformers does but leave marking to cachelife, as under a version that skipped it.
    def allocate(keys: torch.Tensor, values: torch.Tensor) -> None:
        layer.keys = torch.zeros(2, 3, MAX_LEN, 5)
        layer.values = torch.zeros(2, 3, MAX_LEN, 7)
        layer.is_initialized = True

    return allocate


def test_replaced_buffers_are_detected_on_reset() -> None:
    tracked, layer = reach(Filled)
    layer.keys = torch.zeros(2, 3, MAX_LEN, 5)  # what Cache.reorder_cache does during beam search
    with pytest.raises(ReplacedBuffersError, match="replaced outside cachelife"):
        tracked.reset()
    assert isinstance(tracked.state, Filled)


def test_buffers_of_a_pinned_layer_and_refusal_for_an_unpinned_one() -> None:
    tracked, layer = fresh()
    with pytest.raises(UnpinnedCacheError, match=r"layer 4 \(self-attention\) is Unallocated and holds no pinned"):
        _ = tracked.buffers
    pinned = tracked.pin(SPEC)
    assert tracked.buffers == pinned.buffers
    assert tracked.buffers.data_ptrs == tuple((name, t.data_ptr()) for name, t in buffers.static_tensors(layer))
    write(layer)
    filled = tracked.fill(FillRecord("test", 2))
    assert tracked.buffers == filled.buffers == pinned.buffers
    tracked.release()
    with pytest.raises(UnpinnedCacheError, match="is Unallocated"):
        _ = tracked.buffers


def test_check_raises_what_the_transition_would_and_changes_nothing() -> None:
    tracked, layer = reach(Filled)
    layer.keys = torch.zeros(2, 3, MAX_LEN, 5)
    before = tracked.state
    with pytest.raises(ReplacedBuffersError):
        tracked.check("reset")
    with pytest.raises(IllegalTransitionError, match="cannot pin layer 4"):
        tracked.check("pin")
    tracked.check("release")  # releasing replaced buffers is allowed: it is the way out
    assert tracked.state == before
    assert layer.keys is not None
    assert layer.is_initialized


def test_adoption_reads_existing_buffers() -> None:
    layer = StaticLayer(max_cache_len=MAX_LEN)
    layer.lazy_initialization(torch.zeros(2, 3, 0, 5), torch.zeros(2, 3, 0, 7))
    assert isinstance(LayerLifecycle.adopt(layer, index=0, role="self").state, Pinned)
    write(layer)
    adopted = LayerLifecycle.adopt(layer, index=0, role="self")
    assert isinstance(adopted.state, Filled)
    assert adopted.state.filled_by.positions == 2


def test_adoption_refuses_buffers_born_unmarked() -> None:
    layer = StaticLayer(max_cache_len=MAX_LEN)
    layer.keys, layer.values, layer.is_initialized = torch.zeros(2, 3, MAX_LEN, 5), torch.zeros(2, 3, MAX_LEN, 7), True
    with pytest.raises(UnmarkedBuffersError, match="never marked static"):
        LayerLifecycle.adopt(layer, index=1, role="cross")


def test_adoption_refuses_layers_with_more_storage() -> None:
    class IndexedLayer(StaticLayer):
        pass

    with pytest.raises(UnsupportedCacheError, match="IndexedLayer"):
        LayerLifecycle.adopt(IndexedLayer(max_cache_len=4), index=0, role="self")
    with pytest.raises(UnsupportedCacheError, match="DynamicLayer"):
        LayerLifecycle.adopt(DynamicLayer(), index=0, role="self")


def test_sliding_layer_is_pinned_at_its_window() -> None:
    layer = StaticSlidingWindowLayer(max_cache_len=32, sliding_window=4)
    tracked = LayerLifecycle.adopt(layer, index=0, role="self")
    pinned = tracked.pin(SPEC)
    assert pinned.buffers.key_shape == (2, 3, 4, 5)
    layer.update(torch.ones(2, 3, 3, 5), torch.ones(2, 3, 3, 7))
    tracked.fill(FillRecord("test"))
    tracked.reset()
    assert layer.cumulative_length_int == 0
    tracked.release()
    assert layer.cumulative_length_int == 0
    assert not layer.is_initialized


def test_cross_layer_reset_clears_the_models_announcement() -> None:
    config = zoo.t5_tiny()
    cache = EncoderDecoderCache(
        StaticCache(config=config, max_cache_len=4), StaticCache(config=config, max_cache_len=3)
    )
    tracked = cachelife.lifecycle(cache).cross_attention[1]
    tracked.pin(SPEC)
    cache.is_updated[1] = True  # what the model does once it wrote the encoder's keys and values
    assert tracked.cross_content_written
    tracked.fill(FillRecord("test"))
    tracked.reset()
    assert cache.is_updated[1] is False
    assert not tracked.cross_content_written


def test_one_debug_line_per_transition(caplog: pytest.LogCaptureFixture) -> None:
    tracked, layer = fresh(role="cross")
    with caplog.at_level(logging.DEBUG, logger="cachelife"):
        tracked.pin(SPEC)
        write(layer)
        tracked.fill(FillRecord("forward", positions=2, compiled=True))
        tracked.reset()
        tracked.release()
    lines = [record.getMessage() for record in caplog.records if record.name == "cachelife.core.layer_lifecycle"]
    assert len(lines) == 4
    pin, fill, reset, release = lines
    assert pin.startswith("layer=4 role=cross pin: Unallocated -> Pinned keys=(2, 3, 6, 5) values=(2, 3, 6, 7)")
    assert "dtype=float32 device=cpu data_ptr=keys=0x" in pin
    assert "static=yes compiled=no" in pin
    assert "fill: Pinned -> Filled" in fill
    assert "compiled=yes by=forward positions=2" in fill
    assert "reset: Filled -> Pinned" in reset
    assert "release: Pinned -> Unallocated" in release
    assert "static=released" in release


def test_a_transition_enters_only_the_state_the_table_names(monkeypatch: pytest.MonkeyPatch) -> None:
    tracked, layer = fresh()
    tracked.pin(SPEC)
    monkeypatch.setitem(TRANSITIONS, (Pinned, "fill"), Pinned)  # a table that says otherwise
    with pytest.raises(IllegalTransitionError, match=r"fill of layer 4 .* leads to Pinned, not Filled"):
        tracked.fill(FillRecord("test"))
    check_whole_state(tracked, layer, Pinned)
