"""`cachelife.Options(small_linear=True)`: the decoding steps' linear products of one row and few output
features through `cachelife.kernels.linear`, with eager tokens; turning it off; and `SmallLinearProducts`, which
routes them.

Every token test also counts the op's calls, so that equality tests the kernel and not its absence. Without
Triton (or without `TRITON_INTERPRET=1`) the op runs torch's product; with both, Triton's interpreter.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

import cachelife
from cachelife.integration.enabling import options_of
from cachelife.integration.runtime import runtime_of
from cachelife.kernels.linear import TAKEN_FEATURES, SmallLinearProducts
from cachelife.tools import zoo

OP = "cachelife::small_linear"
NEW = 6
SETTINGS: dict[str, Any] = {"do_sample": False, "max_new_tokens": NEW, "min_new_tokens": NEW}


def op_calls(profile: torch.profiler.profile) -> int:
    return sum(event.count for event in profile.key_averages() if event.key == OP)


def profiled() -> torch.profiler.profile:
    """A CPU profile whose events survive its cycle (torch warns that they do not, otherwise)."""
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True)


def calls_and_tokens(model: PreTrainedModel, inputs: zoo.Inputs, **options: Any) -> tuple[int, torch.Tensor]:
    with profiled() as profile:
        output = cachelife.generate(model, fallback=False, **inputs, **SETTINGS, **options)
    if not isinstance(output, torch.Tensor):
        pytest.fail(f"cachelife.generate returned a {type(output).__name__}")
    return op_calls(profile), output


def check_steps_took_the_op(calls: int) -> None:
    """Every decoding step after the prefill (NEW - 1 of them) made the same number of calls, at least one."""
    assert calls > 0
    assert calls % (NEW - 1) == 0, calls


@pytest.mark.parametrize("name", ["llama", "whisper", "t5"])
def test_cachelife_generate_takes_the_kernel_with_eager_tokens(name: str) -> None:
    built = zoo.build(name)
    model, inputs = built.model, built.inputs(1, 7, 1)  # one row: the products the mode takes
    expected = zoo.generate_tokens(model, inputs, **SETTINGS)
    cachelife.enable(model, options=cachelife.Options(small_linear=True))
    calls, tokens = calls_and_tokens(model, inputs, compile_step=False)
    check_steps_took_the_op(calls)
    assert torch.equal(tokens, expected)


@pytest.mark.slow
@pytest.mark.ci_families("llama")
@pytest.mark.parametrize("name", ["llama", "whisper"])
def test_the_compiled_step_takes_the_kernel_with_eager_tokens(name: str) -> None:
    built = zoo.build(name)
    model, inputs = built.model, built.inputs(1, 7, 1)  # one row: the products the mode takes
    expected = zoo.generate_tokens(model, inputs, **SETTINGS)
    cachelife.enable(model, options=cachelife.Options(small_linear=True))
    compiling = cachelife.generate(model, fallback=False, **inputs, **SETTINGS)  # a profile of it counts tracing
    calls, tokens = calls_and_tokens(model, inputs)
    check_steps_took_the_op(calls)
    assert isinstance(compiling, torch.Tensor)
    assert torch.equal(compiling, expected)
    assert torch.equal(tokens, expected)


def test_turning_it_off_releases_the_steps_that_took_it() -> None:
    built = zoo.build("llama")
    model, inputs = built.model, built.inputs(1, 5, 2)
    cachelife.enable(model, options=cachelife.Options(small_linear=True))
    on, first = calls_and_tokens(model, inputs, compile_step=False)
    check_steps_took_the_op(on)
    cachelife.enable(model)
    off, second = calls_and_tokens(model, inputs, compile_step=False)
    assert off == 0
    assert torch.equal(first, second)
    cachelife.enable(model, options=cachelife.Options(small_linear=True))
    assert calls_and_tokens(model, inputs, compile_step=False)[0] == on


def test_a_deep_copy_keeps_the_setting_and_drops_it_on_its_own() -> None:
    model = cachelife.enable(zoo.build("llama").model, options=cachelife.Options(small_linear=True))
    twin = copy.deepcopy(model)
    assert options_of(twin).small_linear
    cachelife.disable(twin)
    assert not options_of(twin).small_linear
    assert options_of(model).small_linear


@pytest.mark.parametrize(("rows", "features", "taken"), [(1, 12, True), (1, TAKEN_FEATURES, True),
                                                     (2, 12, False), (1, TAKEN_FEATURES + 1, False)])  # fmt: skip
def test_the_mode_takes_products_of_one_row_and_few_features(rows: int, features: int, taken: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    x, weight, bias = (
        torch.randn(shape, generator=generator) for shape in ((rows, 1, 24), (features, 24), (features,))
    )
    with profiled() as profile, SmallLinearProducts():
        positional = F.linear(x, weight, bias)
        keyword = F.linear(x, weight, bias=bias)
        module = torch.nn.Linear(24, 12).eval()(x)
    module_taken = rows == 1  # its 12 output features are few
    assert op_calls(profile) == 2 * taken + module_taken
    expected = F.linear(x.double(), weight.double(), bias.double())
    for output in (positional, keyword):
        torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)
    assert module.shape == (rows, 1, 12)


def test_the_mode_leaves_products_the_kernel_does_not_take() -> None:
    """Integer products, and inputs of other dtypes than the weight's, run as torch runs them (and fail as
    torch fails)."""
    with profiled() as profile, SmallLinearProducts():
        with pytest.raises(RuntimeError):
            F.linear(torch.ones(2, 4), torch.ones(3, 4, dtype=torch.float64))
        assert torch.equal(F.linear(torch.ones(2, 4, dtype=torch.long), torch.ones(3, 4, dtype=torch.long)),
                           torch.full((2, 3), 4))  # fmt: skip
    assert op_calls(profile) == 0


# -- on a GPU --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
@pytest.mark.parametrize("name", ["llama-small", "whisper-small"])
def test_graphs_take_the_kernel_with_eager_tokens_on_cuda(name: str) -> None:
    """fp32, cachelife's CUDA graphs: the tokens of `generate`, one capture, and the op ran while captured."""
    built = zoo.build(name, device="cuda")
    inputs = built.inputs(1, 9, 1)
    expected = zoo.generate_tokens(built.model, inputs, max_new_tokens=24, min_new_tokens=24)
    model = cachelife.enable(built.model, options=cachelife.Options(small_linear=True))
    with profiled() as profile:
        first = cachelife.generate(model, fallback=False, max_new_tokens=24, min_new_tokens=24, **inputs)
    again = cachelife.generate(model, fallback=False, max_new_tokens=24, min_new_tokens=24, **inputs)
    assert op_calls(profile) > 0
    assert isinstance(first, torch.Tensor)
    assert isinstance(again, torch.Tensor)
    assert torch.equal(first, expected)
    assert torch.equal(again, expected)
    assert runtime_of(model).captures == 1
