"""Faults: an exception or KeyboardInterrupt inside generate leaves caches consistent and loses nothing;
two models in two threads keep separate, correct caches."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers.cache_utils import StaticCache

import cachelife
from cachelife.core import buffers
from cachelife.core.layer_lifecycle import Filled, Pinned
from cachelife.integration.call_arguments import cache_argument_name
from cachelife.tools import zoo

SETTINGS: dict[str, Any] = {"do_sample": False, "max_new_tokens": 6, "min_new_tokens": 6}


class Injected(RuntimeError):
    """The fault the tests inject."""


def fail_at_step(model: torch.nn.Module, step: int, fault: Callable[[], BaseException]) -> Callable[[], None]:
    """Make the model's forward raise at its `step`-th call (0 = prefill); returns the undo."""
    calls = {"n": 0}
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] - 1 == step:
            raise fault()
        return original(*args, **kwargs)

    model.forward = forward
    return lambda: setattr(model, "forward", original)


@pytest.mark.parametrize("name", ["t5", "llama"])
@pytest.mark.parametrize("step", [0, 3])
@pytest.mark.parametrize("fault", [lambda: Injected("at step"), KeyboardInterrupt])
def test_generate_after_a_failed_generate_equals_a_fresh_run(
    name: str, step: int, fault: Callable[[], BaseException]
) -> None:
    built = zoo.build(name)
    model = built.model
    inputs = built.inputs(2, 9, 1)
    expected = zoo.generate_tokens(model, inputs, **SETTINGS, disable_compile=True)
    cachelife.enable(model)
    undo = fail_at_step(model, step, fault)
    with pytest.raises((Injected, KeyboardInterrupt)):
        zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static")
    undo()
    for _ in range(2):
        assert torch.equal(zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static"), expected)
    pool = cachelife.pool_of(model)
    assert pool is not None
    assert pool.hits >= 1  # the failed call's buffers came back once its cache was dropped


def test_a_callers_cache_after_a_fault_is_filled_and_reset_makes_it_reusable() -> None:
    built = zoo.build("llama")
    model = built.model
    inputs = built.inputs(2, 9, 1)
    expected = zoo.generate_tokens(model, inputs, **SETTINGS, disable_compile=True)
    cachelife.enable(model)
    cache = cachelife.prepare_static_cache(model, batch_size=2, max_cache_len=32)
    assert isinstance(cache, StaticCache)
    pointers = [layer.buffers.data_ptrs for layer in cachelife.lifecycle(cache).layers]
    undo = fail_at_step(model, 3, lambda: Injected("at step 3"))
    with pytest.raises(Injected):
        zoo.generate_tokens(model, inputs, **SETTINGS, **{cache_argument_name(model): cache})
    undo()
    state = cachelife.lifecycle(cache)
    # Documented state: the cache holds the steps that ran (Filled), at its addresses; generate would
    # continue from that content, so a caller resets it before starting afresh.
    assert all(isinstance(layer.state, Filled) for layer in state.layers)
    assert int(cache.layers[0].cumulative_length) > 0
    state.reset()
    assert all(isinstance(layer.state, Pinned) for layer in state.layers)
    assert [layer.buffers.data_ptrs for layer in state.layers] == pointers
    assert torch.equal(zoo.generate_tokens(model, inputs, **SETTINGS, **{cache_argument_name(model): cache}), expected)


def test_a_fault_while_pinning_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    built = zoo.build("t5")
    model = built.model
    inputs = built.inputs(2, 9, 1)
    expected = zoo.generate_tokens(model, inputs, **SETTINGS, disable_compile=True)
    cachelife.enable(model)
    real = buffers.allocate
    calls = {"n": 0}

    def fail_third(*args: Any, **kwargs: Any) -> buffers.Buffers:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(buffers, "allocate", fail_third)
    with pytest.raises(KeyboardInterrupt):
        zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static")
    monkeypatch.setattr(buffers, "allocate", real)
    pool = cachelife.pool_of(model)
    assert pool is not None
    assert pool.idle_sets == 0  # nothing half-pinned was lent or kept
    assert torch.equal(zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static"), expected)


def test_two_models_in_two_threads_keep_separate_correct_caches() -> None:
    runs: dict[str, list[bool]] = {}
    errors: list[BaseException] = []
    models = {name: zoo.build(name) for name in ("t5", "llama")}
    references = {
        name: zoo.generate_tokens(built.model, built.inputs(2, 9, 1), **SETTINGS, disable_compile=True)
        for name, built in models.items()
    }
    for built in models.values():
        cachelife.enable(built.model)
    barrier = threading.Barrier(len(models))

    def work(name: str) -> None:
        built = models[name]
        try:
            barrier.wait()
            runs[name] = [
                torch.equal(
                    zoo.generate_tokens(built.model, built.inputs(2, 9, 1), **SETTINGS, cache_implementation="static"),
                    references[name],
                )
                for _ in range(4)
            ]
        except BaseException as error:  # reported to the main thread below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(name,)) for name in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert runs == {"t5": [True] * 4, "llama": [True] * 4}
    t5_pool, llama_pool = (cachelife.pool_of(built.model) for built in models.values())
    assert t5_pool is not None
    assert llama_pool is not None
    assert t5_pool is not llama_pool
    assert (t5_pool.hits, llama_pool.hits) == (3, 3)
