"""`LoopSettings`: the settings of cachelife's decoding loop as one frozen, keyword-only value, checked when it is
made with the messages `cachelife.generate` gives, and with `generate`'s defaults."""

from __future__ import annotations

import inspect
from typing import Any

import attrs
import pytest
import torch

import cachelife
from cachelife.errors import InvalidArgumentError, InvalidBucketsError
from cachelife.generation.loop_settings import LoopSettings


def test_the_defaults_are_generates() -> None:
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(cachelife.generate).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    settings = LoopSettings()
    for field in attrs.fields(LoopSettings):
        given = defaults[field.name]
        assert getattr(settings, field.name) == ({} if field.name == "compile_options" else given), field.name


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("steps_per_call", 0, "steps_per_call must be a positive int, got 0"),
        ("steps_per_call", True, "steps_per_call must be a positive int, got True"),
        ("stop_check_every", 2.0, "stop_check_every must be a positive int, got 2.0"),
        ("compile_step", 1, "compile_step must be True or False, got 1"),
        ("fallback", "no", "fallback must be True or False, got 'no'"),
        ("generator", 7, "generator must be a torch.Generator or None, got int 7"),
        ("cuda_graphs", "trees", "cuda_graphs must be one of 'cachelife', 'torch', got 'trees'"),
        ("compile_options", ["max_autotune"], "compile_options: expected a mapping of inductor option names"),
    ],
)
def test_each_setting_is_checked_when_made(name: str, value: object, message: str) -> None:
    given: dict[str, Any] = {name: value}
    with pytest.raises(InvalidArgumentError) as raised:
        LoopSettings(**given)
    assert str(raised.value).startswith(message)


def test_buckets_are_checked_and_kept_as_a_tuple() -> None:
    assert LoopSettings(encoder_buckets=[16, 32]).encoder_buckets == (16, 32)
    with pytest.raises(InvalidBucketsError, match="strictly increasing"):
        LoopSettings(encoder_buckets=[32, 16])


def test_compile_options_need_a_compiled_step() -> None:
    assert dict(LoopSettings(compile_options={"combo_kernels": True}).compile_options) == {"combo_kernels": True}
    with pytest.raises(InvalidArgumentError, match=r"need compile_step=True: the step runs eagerly without it"):
        LoopSettings(compile_step=False, compile_options={"combo_kernels": True})
    assert LoopSettings(compile_step=False, compile_options={}).compile_step is False


def test_settings_are_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError, match="positional"):
        LoopSettings(1, 8)  # type: ignore[call-arg]  # what the test is about
    settings = LoopSettings(generator=torch.Generator().manual_seed(0))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        settings.steps_per_call = 4  # type: ignore[misc]  # what the test is about
