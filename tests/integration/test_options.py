"""`cachelife.Options`: what `enable` installs, as one frozen, keyword-only value checked when it is made; its
presets; the deprecated boolean keywords of `enable`; and the guard applying a new value as reversible rewrites.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
import pytest
import torch
from transformers import PreTrainedModel

import cachelife
from cachelife.errors import InvalidArgumentError
from cachelife.integration.enabling import options_of
from cachelife.integration.rewrites import REWRITES
from cachelife.integration.runtime import runtime_of
from cachelife.model_rewrites.layer_regions import UNMARKED
from cachelife.tools import zoo

LEVERS = ("fuse_projections", "decode_attention", "small_linear", "fused_layers", "compile_regions")
SETTINGS: dict[str, Any] = {"max_new_tokens": 4, "min_new_tokens": 4}


def test_the_default_fuses_projections_and_exact_turns_every_lever_off() -> None:
    assert [getattr(cachelife.Options(), lever) for lever in LEVERS] == [True] + [False] * (len(LEVERS) - 1)
    assert attrs.evolve(cachelife.Options(), fuse_projections=False) == cachelife.EXACT
    assert [getattr(cachelife.EXACT, lever) for lever in LEVERS] == [False] * len(LEVERS)
    assert dict(cachelife.EXACT.compile_options) == dict(cachelife.Options().compile_options) == {}


def test_fast_is_fused_projections_decode_attention_and_fast_kernels() -> None:
    expected = cachelife.Options(fuse_projections=True, decode_attention=True, compile_options=cachelife.FAST_KERNELS)
    assert expected == cachelife.FAST
    assert (cachelife.FAST.small_linear, cachelife.FAST.fused_layers, cachelife.FAST.compile_regions) == (False,) * 3
    assert dict(cachelife.FAST.compile_options) == dict(cachelife.FAST_KERNELS)


@pytest.mark.parametrize("lever", LEVERS)
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_each_lever_takes_only_a_bool(lever: str, value: object) -> None:
    given: dict[str, Any] = {lever: value}
    with pytest.raises(InvalidArgumentError) as raised:
        cachelife.Options(**given)
    assert str(raised.value) == f"{lever} must be True or False, got {value!r}"
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("max-autotune", "compile_options: expected a mapping of inductor option names to values, got str"),
        ({"no_such_option": True}, "compile_options: 'no_such_option' is not an inductor option"),
        ({"triton.cudagraphs": True}, "compile_options: 'triton.cudagraphs' is set by cachelife (CUDA graphs"),
        ({"emulate_precision_casts": False}, "compile_options: 'emulate_precision_casts' is set by cachelife"),
        ({"combo_kernels": [True]}, "compile_options: 'combo_kernels' takes a str, int or bool here, got list [True]"),
    ],
)
def test_compile_options_are_checked(options: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        cachelife.Options(compile_options=options)  # type: ignore[arg-type]  # some are the mistake under test
    assert str(raised.value).startswith(message)


def test_compile_options_are_a_read_only_copy() -> None:
    given = {"combo_kernels": True}
    options = cachelife.Options(compile_options=given)
    given["combo_kernels"] = False
    assert dict(options.compile_options) == {"combo_kernels": True}
    with pytest.raises(TypeError):
        options.compile_options["combo_kernels"] = False  # type: ignore[index]  # what the test is about


def test_options_are_keyword_only_frozen_and_hashable() -> None:
    with pytest.raises(TypeError, match="positional"):
        cachelife.Options(True)  # type: ignore[call-arg]  # what the test is about
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cachelife.FAST.fuse_projections = False  # type: ignore[misc]  # what the test is about
    same = cachelife.Options(fuse_projections=True, decode_attention=True, compile_options=cachelife.FAST_KERNELS)
    assert hash(same) == hash(cachelife.FAST)
    assert attrs.evolve(cachelife.FAST, small_linear=True).small_linear


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        (cachelife.Options(), "Options()"),
        (cachelife.EXACT, "Options(fuse_projections=False)"),
        (cachelife.Options(small_linear=True), "Options(small_linear=True)"),
        (cachelife.FAST, "Options(decode_attention=True, compile_options={"),
    ],
)
def test_the_repr_is_a_call_that_makes_the_value(options: cachelife.Options, shown: str) -> None:
    assert repr(options).startswith(shown)
    assert eval(f"cachelife.{options!r}") == options  # the repr of a value, written above


def test_every_lever_is_one_rewrite_in_field_order() -> None:
    fields = [field.name for field in attrs.fields(cachelife.Options)]
    assert [rewrite.option for rewrite in REWRITES] == list(LEVERS)
    assert fields == [*LEVERS, "compile_options"]


# -- enable --------------------------------------------------------------------------------------------------


def test_enable_replaces_the_options_value() -> None:
    model = zoo.build("llama").model
    first = cachelife.Options(small_linear=True)
    second = cachelife.Options(compile_regions=True)
    cachelife.enable(model, options=first)
    assert options_of(model) is first
    cachelife.enable(model, options=second)
    assert options_of(model) is second
    cachelife.enable(model)
    assert options_of(model) == cachelife.Options()
    cachelife.disable(model)
    assert options_of(model) is cachelife.EXACT


def test_enable_refuses_options_that_are_not_an_options_value() -> None:
    model = zoo.build("llama").model
    with pytest.raises(InvalidArgumentError, match=r"options must be a cachelife.Options .* got \{'small_linear'"):
        cachelife.enable(model, options={"small_linear": True})  # type: ignore[arg-type]  # the mistake under test
    assert not cachelife.is_enabled(model)


def decoded(model: PreTrainedModel, inputs: dict[str, Any]) -> int:
    """Decode once, eagerly; the runtime's state buffer sets after it."""
    cachelife.generate(model, fallback=False, compile_step=False, **inputs, **SETTINGS)
    return len(runtime_of(model).states)


def test_a_change_of_options_releases_the_runtime_and_the_same_options_do_not() -> None:
    built = zoo.build("llama")
    model, inputs = built.model, built.inputs(1, 5, 1)
    cachelife.enable(model, options=cachelife.Options(small_linear=True))
    assert decoded(model, inputs) > 0
    cachelife.enable(model, options=cachelife.Options(small_linear=True))  # equal: nothing to release
    assert len(runtime_of(model).states) > 0
    cachelife.enable(model, options=cachelife.Options(small_linear=True, compile_options={"combo_kernels": True}))
    assert len(runtime_of(model).states) == 0  # the compiled steps had other inductor options
    assert decoded(model, inputs) > 0
    cachelife.enable(model)
    assert len(runtime_of(model).states) == 0


def model_state(model: PreTrainedModel) -> dict[str, Any]:
    """What the rewrites touch: every module's instance attributes, the state dict's bytes, each config's
    attention implementation."""
    return {
        "attributes": {name: sorted(vars(module)) for name, module in model.named_modules()},
        "state": {name: tensor.detach().clone().view(torch.uint8) for name, tensor in model.state_dict().items()},
        "attention": [config._attn_implementation for config in configs(model)],
    }


def configs(model: PreTrainedModel) -> list[Any]:
    return [module.config for module in model.modules() if isinstance(module, PreTrainedModel)]


def assert_same_state(after: dict[str, Any], before: dict[str, Any]) -> None:
    assert after["attributes"] == before["attributes"]
    assert after["attention"] == before["attention"]
    assert after["state"].keys() == before["state"].keys()
    for key, data in before["state"].items():
        assert torch.equal(after["state"][key], data), key


def test_switching_between_options_applies_and_restores_each_rewrite_exactly() -> None:
    built = zoo.build("llama")
    model, inputs = built.model, built.inputs(1, 5, 1)
    before = model_state(model)
    expected = zoo.generate_tokens(model, inputs, do_sample=False, **SETTINGS)
    every = cachelife.Options(
        fuse_projections=True, decode_attention=True, small_linear=True, fused_layers=True, compile_regions=True
    )
    cachelife.enable(model, options=every)
    assert model_state(model)["attributes"] != before["attributes"]  # fused and marked
    cachelife.enable(model, options=cachelife.Options(decode_attention=True, fuse_projections=False))
    assert not any(UNMARKED in vars(module) for module in model.modules())
    assert not any("cachelife_fused" in name for name, _ in model.named_buffers())
    assert model_state(model)["attention"] != before["attention"]
    cachelife.enable(model, options=every)
    cachelife.disable(model)
    assert_same_state(model_state(model), before)
    assert torch.equal(zoo.generate_tokens(model, inputs, do_sample=False, **SETTINGS), expected)


# -- the deprecated keywords -------------------------------------------------------------------------------


def test_the_boolean_keywords_warn_and_name_the_options_to_pass() -> None:
    model = zoo.build("llama").model
    replacement = "pass options=cachelife.Options(small_linear=True)"
    with pytest.warns(DeprecationWarning, match=re.escape(replacement)) as warned:
        cachelife.enable(model, fuse_projections=True, small_linear=True)
    assert [warning.filename for warning in warned] == [__file__]  # at the caller's line
    assert options_of(model) == cachelife.Options(fuse_projections=True, small_linear=True)
    with pytest.warns(DeprecationWarning, match=re.escape("cachelife.enable(model, fuse_projections=False)")):
        cachelife.enable(model, fuse_projections=False)
    assert options_of(model) == cachelife.EXACT
    assert not any("cachelife_fused" in name for name, _ in model.named_buffers())


def test_the_boolean_keywords_set_their_fields_on_the_options_given() -> None:
    model = zoo.build("llama").model
    with pytest.warns(DeprecationWarning, match=re.escape("cachelife.Options(small_linear=True, compile_options={")):
        cachelife.enable(model, options=cachelife.Options(compile_options=cachelife.FAST_KERNELS), small_linear=True)
    assert options_of(model) == cachelife.Options(small_linear=True, compile_options=cachelife.FAST_KERNELS)


def test_a_bad_boolean_keyword_is_refused_before_anything_changes() -> None:
    model = zoo.build("llama").model
    cachelife.enable(model, options=cachelife.Options(small_linear=True))
    with pytest.raises(InvalidArgumentError) as raised:
        cachelife.enable(model, small_linear="yes")  # type: ignore[arg-type]  # the mistake under test
    assert str(raised.value) == "small_linear must be True or False, got 'yes'"
    assert options_of(model) == cachelife.Options(small_linear=True)
