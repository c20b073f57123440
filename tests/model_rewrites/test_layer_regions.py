"""`cachelife.Options(compile_regions=True)`: the layers of a model's stacks of identical layers as nested
compile regions (`cachelife.model_rewrites.layer_regions`): one compiled region per layer class, eager tokens from the
compiled step, and every layer's `forward` restored by `disable` and in a deep copy.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

import cachelife
from cachelife.integration.runtime import runtime_of
from cachelife.model_rewrites.layer_regions import UNMARKED, mark_layer_regions, stacks
from cachelife.tools import zoo

NEW = 6
SETTINGS: dict[str, Any] = {"do_sample": False, "max_new_tokens": NEW, "min_new_tokens": NEW}
INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    layers = model.get_decoder().layers
    if not isinstance(layers, torch.nn.ModuleList):
        pytest.fail(f"expected the decoder's layers as a ModuleList, got a {type(layers).__name__}")
    return layers


def bound_to(method: object) -> object:
    if not isinstance(method, types.MethodType):
        pytest.fail(f"expected a bound method, got {method!r}")
    return method.__self__


def traced_regions(model: PreTrainedModel, **inputs: Any) -> tuple[int, set[str]]:
    """Calls of a compile region in dynamo's graph of a forward, and the regions called."""
    graphs: list[torch.fx.GraphModule] = []

    def keep(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=keep, fullgraph=True)(**inputs, use_cache=False)
    (graph,) = graphs
    calls = [node for node in graph.graph.nodes if node.target is INVOKE_SUBGRAPH]
    return len(calls), {str(node.args[0].target) for node in calls}


def test_the_layers_of_a_stack_share_one_region() -> None:
    built = zoo.build("llama-small")
    model = cachelife.enable(built.model, options=cachelife.Options(compile_regions=True))
    calls, regions = traced_regions(model, **built.inputs(1, 5, 1))
    assert calls == len(decoder_layers(model)) == 4
    assert len(regions) == 1


def test_without_the_option_nothing_is_a_region() -> None:
    built = zoo.build("llama-small")
    assert traced_regions(cachelife.enable(built.model), **built.inputs(1, 5, 1)) == (0, set())


def test_stacks_are_the_lists_of_layers_of_one_class() -> None:
    model = zoo.build("t5").model
    found = dict(stacks(model))
    assert set(found) == {"encoder.block", "decoder.block"}  # not each block's list of its three sublayers
    assert all(len(stack) == 2 for stack in found.values())


@pytest.mark.slow
@pytest.mark.ci_families("t5")
@pytest.mark.parametrize("name", ["llama", "whisper", "t5"])
def test_the_compiled_step_with_regions_has_eager_tokens(name: str) -> None:
    """t5's blocks return their position bias input, which a region may not: it comes back as a copy."""
    built = zoo.build(name)
    model, inputs = built.model, built.inputs(2, 7, 1)
    expected = zoo.generate_tokens(model, inputs, **SETTINGS)
    cachelife.enable(model, options=cachelife.Options(compile_regions=True))
    for _ in range(2):
        tokens = cachelife.generate(model, fallback=False, **inputs, **SETTINGS)
        assert isinstance(tokens, torch.Tensor)
        assert torch.equal(tokens, expected)


def test_disable_gives_each_layer_its_forward_back() -> None:
    model = zoo.build("whisper").model
    layers = [layer for _, stack in stacks(model) for layer in stack]
    assert len(layers) == 4  # the encoder's two and the decoder's two
    kept = layers[0].forward
    layers[0].forward = kept  # an instance attribute before enable (as accelerate's hooks set one)
    before = {id(layer): dict(layer.__dict__) for layer in layers}
    cachelife.enable(model, options=cachelife.Options(compile_regions=True))
    assert all("forward" in layer.__dict__ and UNMARKED in layer.__dict__ for layer in layers)
    cachelife.disable(model)
    for layer in layers:
        assert layer.__dict__.keys() == before[id(layer)].keys()
    assert layers[0].__dict__["forward"] is kept


def test_turning_it_off_restores_the_layers_and_releases_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    built = zoo.build("llama")
    model, inputs = built.model, built.inputs(1, 5, 2)
    cachelife.enable(model, options=cachelife.Options(compile_regions=True))
    first = cachelife.generate(model, fallback=False, compile_step=False, **inputs, **SETTINGS)
    runtime = runtime_of(model)
    release = type(runtime).release
    released: list[object] = []

    def counted(self: Any) -> Any:
        released.append(self)
        return release(self)

    monkeypatch.setattr(type(runtime), "release", counted)
    cachelife.enable(model)
    assert released == [runtime]
    assert not any(UNMARKED in layer.__dict__ for layer in decoder_layers(model))
    second = cachelife.generate(model, fallback=False, compile_step=False, **inputs, **SETTINGS)
    assert isinstance(first, torch.Tensor)
    assert isinstance(second, torch.Tensor)
    assert torch.equal(first, second)
    cachelife.enable(model)
    assert released == [runtime]  # no change, nothing released


def test_a_deep_copy_has_regions_of_its_own_layers() -> None:
    model = cachelife.enable(zoo.build("llama").model, options=cachelife.Options(compile_regions=True))
    twin = copy.deepcopy(model)
    for original, copied in zip(decoder_layers(model), decoder_layers(twin), strict=True):
        assert bound_to(copied.forward) is copied
        assert bound_to(copied.__dict__[UNMARKED]) is copied
        assert bound_to(original.forward) is original
    cachelife.disable(twin)
    assert not any("forward" in layer.__dict__ for layer in decoder_layers(twin))
    assert all(UNMARKED in layer.__dict__ for layer in decoder_layers(model))


def test_a_model_without_stacks_marks_nothing() -> None:
    regions = mark_layer_regions(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    assert regions.layers == ()
    regions.restore()
    assert regions.restored


# -- on a GPU --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
@pytest.mark.parametrize("name", ["llama-small", "whisper-small", "t5-small"])
def test_graphs_with_regions_have_eager_tokens_on_cuda(name: str) -> None:
    """fp32, cachelife's CUDA graphs: the tokens of `generate`, twice, from one capture."""
    built = zoo.build(name, device="cuda")
    inputs = built.inputs(2, 9, 1)
    expected = zoo.generate_tokens(built.model, inputs, max_new_tokens=24, min_new_tokens=24)
    model = cachelife.enable(built.model, options=cachelife.Options(compile_regions=True))
    for _ in range(2):
        tokens = cachelife.generate(model, fallback=False, max_new_tokens=24, min_new_tokens=24, **inputs)
        assert isinstance(tokens, torch.Tensor)
        assert torch.equal(tokens, expected)
    assert runtime_of(model).captures == 1
