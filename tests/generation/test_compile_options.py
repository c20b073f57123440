"""`cachelife.generate(compile_options=...)`: inductor options reach the compiled step (its own compilation,
tokens unchanged), an enabled model's `cachelife.Options` give them unless the call does, and bad options are
refused before anything runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import cachelife
from cachelife.errors import InvalidArgumentError
from cachelife.integration.compiled import checked_options
from cachelife.tools import zoo


def recorded_compilations(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The inductor options of every `torch.compile` call from now on."""
    compiled_with: list[dict[str, Any]] = []
    real_compile = torch.compile

    def recording_compile(function: Any, **kwargs: Any) -> Any:
        compiled_with.append(kwargs["options"])
        return real_compile(function, **kwargs)

    monkeypatch.setattr(torch, "compile", recording_compile)
    return compiled_with


@pytest.mark.slow
@pytest.mark.exhaustive
def test_options_compile_their_own_step_with_equal_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    built = zoo.build("t5")
    inputs = built.inputs(2, 9, 1)
    expected = zoo.generate_tokens(built.model, inputs, max_new_tokens=10)
    compiled_with = recorded_compilations(monkeypatch)
    plain = cachelife.generate(built.model, fallback=False, **inputs, max_new_tokens=10)
    tuned = cachelife.generate(
        built.model, fallback=False, compile_options={"epilogue_fusion": False}, **inputs, max_new_tokens=10
    )
    again = cachelife.generate(
        built.model, fallback=False, compile_options={"epilogue_fusion": False}, **inputs, max_new_tokens=10
    )
    for out in (plain, tuned, again):
        assert isinstance(out, torch.Tensor)
        assert torch.equal(out, expected)
    assert len(compiled_with) == 2, "one step per set of options, compiled once each"
    assert "epilogue_fusion" not in compiled_with[0] or compiled_with[0]["epilogue_fusion"] is True
    assert compiled_with[1]["epilogue_fusion"] is False
    assert all(options["emulate_precision_casts"] is True for options in compiled_with)


@pytest.mark.slow
def test_an_enabled_models_options_compile_its_steps_unless_the_call_passes_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built = zoo.build("t5")
    inputs = built.inputs(2, 9, 1)
    expected = zoo.generate_tokens(built.model, inputs, max_new_tokens=6)
    model = cachelife.enable(built.model, options=cachelife.Options(compile_options={"epilogue_fusion": False}))
    compiled_with = recorded_compilations(monkeypatch)
    enabled = cachelife.generate(model, fallback=False, **inputs, max_new_tokens=6)
    overridden = cachelife.generate(model, fallback=False, compile_options={}, **inputs, max_new_tokens=6)
    eager = cachelife.generate(model, fallback=False, compile_step=False, **inputs, max_new_tokens=6)
    for out in (enabled, overridden, eager):
        assert isinstance(out, torch.Tensor)
        assert torch.equal(out, expected)
    assert len(compiled_with) == 2, "the enabled options' step, then the call's own"
    assert compiled_with[0]["epilogue_fusion"] is False
    assert "epilogue_fusion" not in compiled_with[1] or compiled_with[1]["epilogue_fusion"] is True


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_autotune_gemms": True}, "'max_autotune_gemms' is not an inductor option"),
        ({"triton.cudagraphs": True}, "'triton.cudagraphs' is set by cachelife (CUDA graphs are chosen with"),
        ({"emulate_precision_casts": False}, "'emulate_precision_casts' is set by cachelife"),
        ({"max_autotune_gemm": [True]}, "'max_autotune_gemm' takes a str, int or bool here, got list [True]"),
        ("max-autotune", "expected a mapping of inductor option names to values, got str"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(
    options: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = zoo.build("t5")
    calls: list[object] = []
    monkeypatch.setattr(type(built.model), "generate", lambda *args, **kwargs: calls.append(args))
    with pytest.raises(InvalidArgumentError) as raised:
        cachelife.generate(built.model, compile_options=options, **built.inputs(2, 9, 1), max_new_tokens=4)
    assert message in str(raised.value)
    assert calls == [], "generate ran although the options were refused"


def test_options_without_compiling_are_refused() -> None:
    built = zoo.build("t5")
    with pytest.raises(InvalidArgumentError, match="need compile_step=True"):
        cachelife.generate(
            built.model, compile_step=False, compile_options=cachelife.FAST_KERNELS, **built.inputs(2, 9, 1)
        )


def test_fast_kernels_are_valid_read_only_options() -> None:
    assert checked_options(cachelife.FAST_KERNELS) == dict(cachelife.FAST_KERNELS)
    with pytest.raises(TypeError):
        cachelife.FAST_KERNELS["max_autotune_gemm"] = True  # type: ignore[index]
