"""A model's runtime state has one owner: `release` frees it, `disable` too; copies are independent and
pickling names the fix; many calls of changing shapes keep it bounded."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

import cachelife
from cachelife.errors import EnabledModelPickleError
from cachelife.integration.runtime import runtime_of
from cachelife.tools import zoo

SETTINGS: dict[str, Any] = {"max_new_tokens": 8, "min_new_tokens": 8}


def fast(model: PreTrainedModel, inputs: dict[str, Any], **settings: Any) -> torch.Tensor:
    out = cachelife.generate(model, fallback=False, compile_step=False, **inputs, **{**SETTINGS, **settings})
    assert isinstance(out, torch.Tensor)
    return out


def perturbed(model: PreTrainedModel) -> None:
    """Change every weight of `model` in place, so that its tokens are not the original's."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)


def test_release_frees_every_buffer_graph_and_compiled_step_and_reports_the_bytes() -> None:
    built = zoo.build("t5")
    model = cachelife.enable(built.model)
    inputs = built.inputs(2, 9, 1)
    expected = fast(model, inputs)
    runtime = runtime_of(model)
    assert len(runtime.states) > 0
    pool = cachelife.pool_of(model)
    assert pool is not None
    assert pool.idle_sets == 1
    freed = cachelife.release(model)
    assert freed.state_bytes > 0
    assert freed.pool_bytes > 0
    assert freed.nbytes == freed.state_bytes + freed.pool_bytes
    assert (len(runtime.states), len(runtime.graphs), len(runtime.compiled), pool.idle_sets) == (0, 0, 0, 0)
    assert cachelife.is_enabled(model)
    assert torch.equal(fast(model, inputs), expected)  # the next call builds what it needs again
    assert cachelife.release(model).nbytes > 0
    assert cachelife.release(model).nbytes == 0


def test_release_of_a_model_cachelife_never_saw_frees_nothing() -> None:
    assert cachelife.release(zoo.build("llama").model) == cachelife.Released(
        pool_bytes=0, state_bytes=0, graphs=0, compiled_steps=0
    )


def test_disable_releases_the_runtime() -> None:
    built = zoo.build("llama")
    model = cachelife.enable(built.model)
    fast(model, built.inputs(2, 9, 1))
    runtime = runtime_of(model)
    assert len(runtime.states) > 0
    cachelife.disable(model)
    assert (len(runtime.states), runtime.pool) == (0, runtime.pool)
    assert runtime.pool is None or runtime.pool.idle_sets == 0


@pytest.mark.parametrize("pool_bytes", [0, 4 * 1024**3])
def test_a_deep_copy_of_an_enabled_model_decodes_with_its_own_weights(pool_bytes: int) -> None:
    built = zoo.build("llama")
    model = cachelife.enable(built.model, pool_bytes=pool_bytes)
    inputs = built.inputs(2, 9, 1)
    original = zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static")
    twin = copy.deepcopy(model)
    perturbed(twin)
    plain = copy.deepcopy(twin)
    cachelife.disable(plain)
    expected = zoo.generate_tokens(plain, inputs, **SETTINGS)
    assert not torch.equal(expected, original)  # the perturbation matters
    assert cachelife.is_enabled(twin)
    assert torch.equal(zoo.generate_tokens(twin, inputs, **SETTINGS, cache_implementation="static"), expected)
    assert torch.equal(fast(twin, inputs), expected)
    assert torch.equal(zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static"), original)
    assert torch.equal(fast(model, inputs), original)
    assert runtime_of(twin) is not runtime_of(model)


def test_disabling_a_copy_leaves_the_original_enabled_and_guarded() -> None:
    built = zoo.build("llama")
    model = cachelife.enable(built.model)
    twin = copy.deepcopy(model)
    cachelife.disable(twin)
    assert (cachelife.is_enabled(model), cachelife.is_enabled(twin)) == (True, False)
    assert "generate" not in vars(twin)
    assert len(twin._forward_pre_hooks) == len(twin._forward_hooks) == 0
    assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1
    zoo.generate_tokens(model, built.inputs(2, 9, 1), **SETTINGS, cache_implementation="static")
    pool = cachelife.pool_of(model)
    assert pool is not None
    assert pool.misses == 1  # the original's guard still pins through its own pool


def test_pickling_an_enabled_model_raises_a_cachelife_error_that_names_the_fix() -> None:
    model = cachelife.enable(zoo.build("llama").model)
    with pytest.raises(EnabledModelPickleError, match=r"cachelife\.disable\(model\) first"):
        pickle.dumps(model)
    with pytest.raises(EnabledModelPickleError, match="state_dict"):
        torch.save(model, io.BytesIO())
    cachelife.disable(model)
    assert isinstance(pickle.loads(pickle.dumps(model)), type(model))


def test_two_hundred_calls_of_changing_shapes_keep_the_runtime_bounded() -> None:
    built = zoo.build("llama")
    model = cachelife.enable(built.model, pool_bytes=256 * 1024)
    runtime = runtime_of(model)
    pool = cachelife.pool_of(model)
    assert pool is not None
    for call in range(200):
        batch, length = 1 + call % 5, 3 + call % 7
        fast(model, built.inputs(batch, length, call), max_new_tokens=2 + call % 3, min_new_tokens=0)
        assert len(runtime.states) <= runtime.states.limit
        assert pool.idle_bytes <= pool.budget_bytes
    assert len(runtime.graphs) == 0  # no graphs on the CPU
    assert len(runtime.compiled) == 0  # eager steps compile nothing
    assert len(runtime.warned) <= 1
