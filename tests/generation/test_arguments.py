"""Arguments of `cachelife.generate`, checked before any work; prompts checked as the decoding method sees them."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import cachelife
from cachelife.errors import InvalidArgumentError, UnsupportedGenerationError
from cachelife.integration.runtime import runtime_of
from cachelife.tools import zoo


class Forwards:
    """Counts the model's forward calls."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        model.register_forward_pre_hook(self.count)

    def count(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self.calls += 1


@pytest.mark.parametrize(
    ("argument", "value", "expected"),
    [
        ("steps_per_call", 2.0, "steps_per_call must be a positive int, got 2.0"),
        ("steps_per_call", "4", "steps_per_call must be a positive int, got '4'"),
        ("steps_per_call", 0, "steps_per_call must be a positive int, got 0"),
        ("steps_per_call", True, "steps_per_call must be a positive int, got True"),
        ("stop_check_every", None, "stop_check_every must be a positive int, got None"),
        ("stop_check_every", 1.5, "stop_check_every must be a positive int, got 1.5"),
        ("fallback", "no", "fallback must be True or False, got 'no'"),
        ("compile_step", 1, "compile_step must be True or False, got 1"),
        ("cuda_graphs", "trees", "cuda_graphs must be one of 'cachelife', 'torch', got 'trees'"),
        ("generator", 7, "generator must be a torch.Generator or None, got int 7"),
        ("compile_options", ["max_autotune"], "compile_options: expected a mapping"),
    ],
)
def test_each_own_argument_is_checked_before_any_work(argument: str, value: object, expected: str) -> None:
    built = zoo.build("t5")
    model = cachelife.enable(built.model)
    forwards = Forwards(model)
    bad: dict[str, Any] = {argument: value}
    with pytest.raises(InvalidArgumentError, match="^" + re.escape(expected)):
        cachelife.generate(model, **built.inputs(2, 9, 1), max_new_tokens=4, **bad)
    assert forwards.calls == 0
    runtime = runtime_of(model)
    assert (len(runtime.states), len(runtime.compiled)) == (0, 0)


def test_argument_errors_are_also_the_builtins_a_caller_catches() -> None:
    built = zoo.build("t5")
    with pytest.raises(TypeError):
        cachelife.generate(built.model, **built.inputs(2, 9, 1), steps_per_call="4")  # type: ignore[arg-type]  # the misuse
    with pytest.raises(ValueError, match="steps_per_call"):
        cachelife.generate(built.model, **built.inputs(2, 9, 1), steps_per_call=0)


def test_a_model_that_is_not_a_transformers_model_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgumentError, match="needs a transformers generation model"):
        cachelife.generate(object(), max_new_tokens=4)  # type: ignore[arg-type]  # the misuse under test


def test_prepare_static_cache_refuses_a_pool_that_is_no_pool() -> None:
    model = zoo.build("llama").model
    with pytest.raises(InvalidArgumentError, match=r"pool must be a CachePool .* got str 'x'"):
        cachelife.prepare_static_cache(model, batch_size=2, max_cache_len=8, pool="x")  # type: ignore[arg-type]  # the misuse
    with pytest.raises(InvalidArgumentError, match="model must be a transformers PreTrainedModel, got a int"):
        cachelife.prepare_static_cache(3, batch_size=2, max_cache_len=8)  # type: ignore[arg-type]  # the misuse


def _padded_llama(side: str) -> tuple[Any, dict[str, Any]]:
    built = zoo.build("llama")
    model = built.model
    model.generation_config.pad_token_id = 0
    ids = built.inputs(3, 10, 1)["input_ids"]
    if side == "left":
        ids[0, :4] = 0
        ids[2, :2] = 0
    else:
        ids[0, -4:] = 0
    return model, {"input_ids": ids}


def test_right_padded_prompts_without_a_mask_are_refused_as_transformers_infers_their_mask() -> None:
    model, inputs = _padded_llama("right")
    with pytest.raises(UnsupportedGenerationError, match="right-padded prompts"):
        cachelife.generate(model, fallback=False, compile_step=False, **inputs, max_new_tokens=30)


def test_left_padded_prompts_without_a_mask_decode_as_with_the_inferred_mask() -> None:
    model, inputs = _padded_llama("left")
    expected = zoo.generate_tokens(model, inputs, max_new_tokens=30)
    got = cachelife.generate(model, fallback=False, compile_step=False, **inputs, max_new_tokens=30)
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got, expected)
    mask = (inputs["input_ids"] != 0).long()
    assert torch.equal(zoo.generate_tokens(model, {**inputs, "attention_mask": mask}, max_new_tokens=30), expected)
