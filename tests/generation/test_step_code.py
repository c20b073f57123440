"""Compiled steps and dynamo's recompile limit: each model and each kind of generation settings compiles its
step with a code object of its own (`cachelife.generation.step_code`), so a process that meets more settings and
models than `torch._dynamo.config.recompile_limit` still decodes every call, with `model.generate`'s tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import cachelife
from cachelife.generation.step_code import own_code, specialization
from cachelife.tools import zoo

# Deterministic settings that each trace another step: processors of other kinds, or none.
SETTINGS: list[dict[str, Any]] = [{}, {"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}]


@pytest.mark.slow
@pytest.mark.exhaustive
def test_more_settings_and_models_than_the_recompile_limit_decode_as_generate() -> None:
    models = [zoo.build("t5"), zoo.build("llama")]
    # Two entries per code object: without code objects of their own, the third step traced raises
    # FailOnRecompileLimitHit (under fullgraph=True), as the ninth did at dynamo's default of 8.
    with torch._dynamo.config.patch(recompile_limit=2):
        for built in models:
            for index, settings in enumerate(SETTINGS):
                inputs = built.inputs(1, 5 + index, index)
                expected = zoo.generate_tokens(built.model, inputs, max_new_tokens=6, **settings)
                got = cachelife.generate(built.model, fallback=False, **inputs, max_new_tokens=6, **settings)
                assert isinstance(got, torch.Tensor)
                assert torch.equal(got, expected), (type(built.model).__name__, settings)


def test_own_code_is_the_same_function_with_another_code_object() -> None:
    def scaled(x: int, *, by: int = 3) -> int:
        return x * by

    copy = own_code(scaled)
    assert copy.__code__ is not scaled.__code__
    assert (copy(2), copy(2, by=5), copy.__name__, copy.__qualname__) == (6, 10, "scaled", scaled.__qualname__)


@pytest.mark.parametrize(
    ("one", "other", "same"),
    [
        ({"x": torch.zeros(2, 3)}, {"x": torch.ones(5, 7)}, True),  # shapes are left to dynamo
        ({"x": torch.zeros(2, 3)}, {"x": torch.zeros(2)}, False),
        ({"x": torch.zeros(2)}, {"x": torch.zeros(2, dtype=torch.int64)}, False),
        ({"flag": True, "n": 1}, {"flag": True, "n": 9}, True),
        ({"flag": True}, {"flag": False}, False),
        ({"record": None}, {"record": torch.zeros(1)}, False),
        ({"items": (1, None)}, {"items": (1, None, None)}, False),
    ],
)
def test_specialization_tells_what_dynamo_specializes_on(one: object, other: object, same: bool) -> None:
    assert (specialization(one) == specialization(other)) is same
    hash(specialization(one))
