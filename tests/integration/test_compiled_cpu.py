"""Compiled (CPU inductor) static-cache generation with cachelife equals eager dynamic-cache generation.

Slow: each test compiles a model (tens of seconds on a CPU). On a GPU the same recipe runs with CUDA
graphs in tests/test_gpu.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

import cachelife
from cachelife.integration.call_arguments import find_cache
from cachelife.tools import zoo

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
SETTINGS: dict[str, Any] = {"do_sample": False, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}


class FirstForwardStates:
    """Records every layer's state each time a new cache reaches the model's forward call.

    Registered on the model after `enable`, so it runs eagerly, after cachelife's boundary hook and just
    before the compiled `forward` (a hook on the decoder would run inside the compiled region).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.seen: list[tuple[int, list[str]]] = []
        module.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = find_cache(kwargs)
        if cache is not None and (not self.seen or self.seen[-1][0] != id(cache)):
            self.seen.append((id(cache), [type(layer.state).__name__ for layer in cachelife.lifecycle(cache).layers]))


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


@pytest.mark.ci_families("t5", "bart", "whisper")
@pytest.mark.parametrize("name", ["t5", "bart", "whisper", "llama"])
def test_compiled_forward_generation_equals_eager(name: str) -> None:
    built = zoo.build(name)
    model = built.model
    inputs = built.inputs(2, 9, 1)
    expected = zoo.generate_tokens(model, inputs, **SETTINGS, disable_compile=True)
    cachelife.enable(model)
    states = FirstForwardStates(model)
    cachelife.compile_forward(model, fullgraph=True)
    for _ in range(2):
        tokens = zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static")
        assert torch.equal(tokens, expected)
    assert len(states.seen) == 2
    for _, layer_states in states.seen:
        assert layer_states == ["Pinned"] * len(layer_states)
    # The second call reuses the graphs of the first (no recompilation) and the first call's buffers.
    assert counters["stats"]["unique_graphs"] <= 2
    pool = cachelife.pool_of(model)
    assert pool is not None
    assert (pool.hits, pool.misses) == (1, 1)


def test_transformers_auto_compile_generation_equals_eager() -> None:
    built = zoo.build("t5")
    model = built.model
    inputs = built.inputs(2, 9, 1)
    expected = zoo.generate_tokens(model, inputs, **SETTINGS, disable_compile=True)
    cachelife.enable(model)
    states = FirstForwardStates(model)
    # transformers auto-compiles decoding (not prefill) on GPUs; this flag lets it do so on a CPU too.
    compile_config = CompileConfig(fullgraph=True, mode="default")
    compile_config._compile_all_devices = True
    graphs = []
    for _ in range(3):
        tokens = zoo.generate_tokens(
            model, inputs, **SETTINGS, cache_implementation="static", compile_config=compile_config
        )
        assert torch.equal(tokens, expected)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1  # decoding really ran compiled, with cachelife's hooks inside the traced call
    assert graphs[1] == graphs[2]  # and tracking adds no recompilation from call to call
    assert all(layer_states == ["Pinned"] * 4 for _, layer_states in states.seen)


@pytest.mark.ci_families("t5")
@pytest.mark.parametrize("name", ["t5", "whisper"])
def test_compiled_forward_beam_search_equals_eager_and_keeps_its_graphs(name: str) -> None:
    """The in-place reorder is eager code between compiled calls: no recompilation, the same pinned tensors."""
    built = zoo.build(name)
    model = built.model
    inputs = built.inputs(2, 9, 1)
    settings = {**SETTINGS, "num_beams": 3, "num_return_sequences": 2}
    expected = zoo.generate_tokens(model, inputs, **settings, disable_compile=True)
    cachelife.enable(model, on_unpinned="raise")  # a replaced cache tensor would raise
    cachelife.compile_forward(model, fullgraph=True)
    for _ in range(2):
        tokens = zoo.generate_tokens(model, inputs, **settings, cache_implementation="static")
        assert torch.equal(tokens, expected)
    assert counters["stats"]["unique_graphs"] <= 2  # prefill and one decoding step, reused by the second call
