"""Fused projections (`cachelife.Options(fuse_projections=True)`,
`cachelife.model_rewrites.fused_projections`): one matrix product per group of projections that read one input,
the tokens of the unfused model, and `disable` giving the model back exactly.

Every test also checks that fusion took place (fewer products, parameters lying in the fused buffers), so that
equality tests the fused model and not its absence. The slow tests compile the decoding step with CPU inductor
and count the matrix products in the code it generates.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.overrides import TorchFunctionMode
from transformers import PreTrainedModel, T5Config, T5ForConditionalGeneration

import cachelife
from cachelife.integration.runtime import runtime_of
from cachelife.model_rewrites.fused_projections import FusedProjections, fuse_projections
from cachelife.tools import zoo

MODELS = ["llama", "t5", "t5-gated", "bart", "whisper"]
# Matrix products one fused decoder step saves: each decoder layer's groups of n projections save n - 1 each
# (self-attention's q/k/v: 2; a gated MLP's gate/up: 1; cross-attention is not fused).
SAVED_PER_STEP = {"llama": 2 * (2 + 1), "t5": 2 * 2, "t5-gated": 2 * (2 + 1), "bart": 2 * 2, "whisper": 2 * 2}
SETTINGS: dict[str, Any] = {"do_sample": False, "max_new_tokens": 8, "min_new_tokens": 8}
BEAMS: dict[str, Any] = {**SETTINGS, "num_beams": 3}
# The matrix products in the code CPU inductor generates (its wrapper calls them as extern kernels).
MATRIX_PRODUCT = re.compile(r"extern_kernels\.(?:mm|addmm|bmm|baddbmm)\(")


def t5_gated() -> zoo.ZooModel:
    """The zoo's tiny T5 with a gated-gelu MLP (DenseReluDense's wi_0 and wi_1), as T5 v1.1 and Flan-T5 have."""
    config = T5Config(
        vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, feed_forward_proj="gated-gelu",
    )  # fmt: skip
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config).eval()

    def inputs(batch_size: int, length: int, seed: int) -> zoo.Inputs:
        ids = torch.randint(5, 256, (batch_size, length), generator=torch.Generator().manual_seed(seed))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    return zoo.ZooModel(model, inputs)


def build(name: str) -> zoo.ZooModel:
    return t5_gated() if name == "t5-gated" else zoo.build(name)


def tokens(output: object) -> torch.Tensor:
    assert isinstance(output, torch.Tensor)
    return output


def fused_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: buffer for name, buffer in model.named_buffers() if "cachelife_fused" in name}


def assert_fused(model: torch.nn.Module) -> None:
    """The model holds fused buffers, and every self-attention projection's weight lies in one of them."""
    storages = {buffer.untyped_storage().data_ptr() for buffer in fused_buffers(model).values()}
    assert storages
    for name, parameter in model.named_parameters():
        if re.search(r"(self_attn|SelfAttention)\.(q_proj|k_proj|v_proj|q|k|v)\.weight$", name):
            assert parameter.untyped_storage().data_ptr() in storages, name


class LinearCalls(TorchFunctionMode):
    """Counts the calls of `torch.nn.functional.linear` (each one matrix product) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if func is torch.nn.functional.linear:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def linear_calls(run: Callable[[], object]) -> int:
    counted = LinearCalls()
    with counted:
        run()
    return counted.calls


def compiled_products(run: Callable[[], object]) -> tuple[object, int]:
    """What `run()` returns, and the matrix products in the code inductor generated while it ran (dynamo is
    reset first, so everything `run` compiles is compiled anew)."""
    result, codes = run_and_get_code(run)
    found = sum(len(MATRIX_PRODUCT.findall(code)) for code in codes)
    assert found > 0, "no compiled code seen"
    return result, found


def storage_bytes(model: torch.nn.Module, *extra: torch.Tensor) -> int:
    """Bytes of the distinct storages the model's parameters and buffers (and `extra`) lie in."""
    storages = {
        tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
        for tensor in (*model.parameters(), *model.buffers(), *extra)
    }
    return sum(storages.values())


# ---- eager: tokens, restoration, memory ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["whisper", "llama"])
def test_enable_fuses_by_default_and_cachelife_generate_keeps_the_tokens(name: str) -> None:
    """Fused projections are on unless the options turn them off: a plain `enable` fuses, and the compiled
    steps of `cachelife.generate` decode `model.generate`'s float32 tokens, greedy and with beams."""
    built = build(name)
    model, inputs = built.model, built.inputs(2, 7, 1)
    greedy = zoo.generate_tokens(model, inputs, **SETTINGS)
    beams = zoo.generate_tokens(model, inputs, **BEAMS)
    cachelife.enable(model)
    assert_fused(model)
    assert torch.equal(tokens(cachelife.generate(model, fallback=False, **inputs, **SETTINGS)), greedy)
    assert torch.equal(tokens(cachelife.generate(model, fallback=False, **inputs, **BEAMS)), beams)


@pytest.mark.parametrize("name", MODELS)
def test_eager_tokens_equal_unfused_with_fewer_products(name: str) -> None:
    built = build(name)
    model, inputs = built.model, built.inputs(2, 7, 1)
    greedy = zoo.generate_tokens(model, inputs, **SETTINGS)
    beams = zoo.generate_tokens(model, inputs, **BEAMS)
    unfused_calls = linear_calls(lambda: model.generate(**inputs, **SETTINGS))
    cachelife.enable(model, options=cachelife.Options(fuse_projections=True))
    assert_fused(model)
    assert linear_calls(lambda: model.generate(**inputs, **SETTINGS)) < unfused_calls
    assert torch.equal(zoo.generate_tokens(model, inputs, **SETTINGS), greedy)
    assert torch.equal(zoo.generate_tokens(model, inputs, **BEAMS), beams)
    assert torch.equal(
        tokens(cachelife.generate(model, compile_step=False, fallback=False, **inputs, **SETTINGS)), greedy
    )
    assert torch.equal(tokens(cachelife.generate(model, compile_step=False, fallback=False, **inputs, **BEAMS)), beams)


def snapshot(model: torch.nn.Module) -> dict[str, Any]:
    """Everything `disable` must give back: the parameter objects and their metadata, the state dict's bytes,
    the buffers' names, each module's instance attributes."""
    parameters = model.named_parameters()
    return {
        "parameters": [
            (name, id(p), p.dtype, p.device, p.requires_grad, p.shape, p.stride()) for name, p in parameters
        ],
        "state": {name: tensor.detach().clone().view(torch.uint8) for name, tensor in model.state_dict().items()},
        "buffers": [name for name, _ in model.named_buffers()],
        "attributes": {name: sorted(vars(module)) for name, module in model.named_modules()},
    }


@pytest.mark.parametrize("name", MODELS)
def test_disable_restores_the_model_exactly(name: str) -> None:
    built = build(name)
    model, inputs = built.model, built.inputs(2, 7, 1)
    before = snapshot(model)
    kept = list(model.parameters())  # the objects themselves: ids above stay unique while these live
    expected = zoo.generate_tokens(model, inputs, **SETTINGS)
    cachelife.enable(model, options=cachelife.Options(fuse_projections=True))
    assert_fused(model)
    assert snapshot(model)["state"].keys() == before["state"].keys()  # fused buffers are not persistent
    cachelife.disable(model)
    after = snapshot(model)
    assert after["parameters"] == before["parameters"]
    assert after["buffers"] == before["buffers"]
    assert after["attributes"] == before["attributes"]
    assert after["state"].keys() == before["state"].keys()
    for key, data in before["state"].items():
        assert torch.equal(after["state"][key], data), key
    for parameter in kept:  # each parameter in a storage of its own again
        assert parameter.untyped_storage().nbytes() == parameter.numel() * parameter.element_size()
    assert torch.equal(zoo.generate_tokens(model, inputs, **SETTINGS), expected)


def test_enable_again_without_fusion_restores_and_releases() -> None:
    built = build("llama")
    model, inputs = built.model, built.inputs(2, 7, 1)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    cachelife.enable(model, options=cachelife.EXACT)
    assert not fused_buffers(model)
    cachelife.generate(model, compile_step=False, **inputs, **SETTINGS)
    assert len(runtime_of(model).states) > 0
    cachelife.enable(model, options=cachelife.Options(fuse_projections=True))
    assert_fused(model)
    assert len(runtime_of(model).states) == 0  # released: graphs and steps read the old weights
    cachelife.enable(model, options=cachelife.Options(fuse_projections=True))  # unchanged: nothing happens
    assert_fused(model)
    cachelife.enable(model, options=cachelife.EXACT)
    assert cachelife.is_enabled(model)
    assert not fused_buffers(model)
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())


def bias_free_outputs(fused: FusedProjections) -> int:
    """Outputs of fused members without a bias of their own in groups where another member has one."""
    return sum(
        member.out_features
        for group in fused.groups
        if any(member.bias is not None for member in group.members)
        for member in group.members
        if member.bias is None
    )


@pytest.mark.parametrize("name", MODELS)
def test_fused_memory_is_the_formula(name: str) -> None:
    model = build(name).model
    before = storage_bytes(model)
    fused = fuse_projections(model)
    assert fused.groups
    # The weights stay where they were, in one tensor per group; only zeros for missing biases are added.
    assert fused.extra_bytes == bias_free_outputs(fused) * 4
    assert storage_bytes(model) == before + fused.extra_bytes
    for group in fused.groups:
        weight = group.parent.get_buffer(group.weight_name)
        assert weight.shape == (sum(m.out_features for m in group.members), group.members[0].in_features)
        for member in group.members:
            assert member.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    if name == "whisper":  # the key projection has no bias: d_model zeros per self-attention layer (2 + 2)
        assert fused.extra_bytes == 4 * 64 * 4
    fused.restore()
    assert storage_bytes(model) == before
    assert fused.extra_bytes == 0


# ---- what a fused group computes ------------------------------------------------------------------------------


def llama_attention() -> tuple[torch.nn.Module, list[torch.nn.Linear], list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """The first self-attention module of the tiny Llama, its q/k/v projections and copies of their parameters."""
    model = build("llama").model
    attention = model.get_submodule("model.layers.0.self_attn")
    members = [attention.get_submodule(name) for name in ("q_proj", "k_proj", "v_proj")]
    linears = [member for member in members if isinstance(member, torch.nn.Linear)]
    assert len(linears) == 3
    return (
        model,
        linears,
        [(m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone()) for m in linears],
    )


@torch.no_grad()
def test_members_called_in_any_order_and_with_other_inputs_compute_their_own_projection() -> None:
    model, members, parameters = llama_attention()
    fuse_projections(model)
    assert all("forward" in vars(member) for member in members)
    x, y = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    calls = [(2, x), (0, y), (1, x), (0, x), (0, x), (2, y), (1, y), (1, y), (2, x)]
    for index, hidden in calls:
        weight, bias = parameters[index]
        torch.testing.assert_close(members[index](hidden), torch.nn.functional.linear(hidden, weight, bias))


def test_gradients_reach_each_fused_parameter() -> None:
    built = build("llama")
    model, inputs = built.model, built.inputs(2, 7, 1)
    twin = copy.deepcopy(model)
    fuse_projections(model)
    assert_fused(model)
    for each in (model, twin):
        each.train()
        each(**inputs, labels=inputs["input_ids"]).loss.backward()
    for (name, fused), unfused in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert fused.grad is not None, name
        assert unfused.grad is not None, name
        torch.testing.assert_close(fused.grad, unfused.grad)


@torch.no_grad()
def test_parameters_given_new_storage_are_fused_again_at_the_next_eager_call() -> None:
    built = build("llama")
    model, inputs = built.model, built.inputs(2, 7, 1)
    twin = copy.deepcopy(model)
    fuse_projections(model)
    model.to(torch.float64)  # converted and fused again at once (the next test)
    twin.to(torch.float64)
    torch.testing.assert_close(model(**inputs).logits, twin(**inputs).logits)
    assert_fused(model)
    state = {name: torch.randn_like(tensor) for name, tensor in model.state_dict().items()}
    model.load_state_dict(state, assign=True)  # new parameter objects
    twin.load_state_dict(state)
    torch.testing.assert_close(model(**inputs).logits, twin(**inputs).logits)
    assert_fused(model)
    assert {tensor.dtype for tensor in fused_buffers(model).values()} == {torch.float64}


@torch.no_grad()
def test_a_conversion_fuses_the_converted_parameters_at_once_without_a_second_copy() -> None:
    """`model.to` converts each parent's parameters without the fused buffers and fuses them again: the model
    holds its projections once, converted, before any call; a conversion that changes nothing keeps the buffers."""
    built = build("llama")
    model, inputs = built.model, built.inputs(2, 7, 1)
    twin = copy.deepcopy(model)
    fused = fuse_projections(model)
    model.to(torch.float64)
    twin.to(torch.float64)
    assert_fused(model)
    assert {tensor.dtype for tensor in fused_buffers(model).values()} == {torch.float64}
    assert storage_bytes(model) == storage_bytes(twin)  # no projection held twice
    kept = {name: tensor.data_ptr() for name, tensor in fused_buffers(model).items()}
    model.to(torch.float64)
    assert {name: tensor.data_ptr() for name, tensor in fused_buffers(model).items()} == kept
    torch.testing.assert_close(model(**inputs).logits, twin(**inputs).logits)
    fused.restore()
    assert not fused_buffers(model)
    assert not any("_apply" in vars(module) for module in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True))


def test_a_deep_copy_of_a_fused_model_is_fused_and_restored_on_its_own() -> None:
    built = build("whisper")
    model, inputs = built.model, built.inputs(2, 7, 1)
    expected = zoo.generate_tokens(model, inputs, **SETTINGS)
    cachelife.enable(model, options=cachelife.Options(fuse_projections=True))
    twin = copy.deepcopy(model)
    assert torch.equal(zoo.generate_tokens(twin, inputs, **SETTINGS), expected)
    assert_fused(twin)
    cachelife.disable(twin)
    assert not fused_buffers(twin)
    assert_fused(model)
    assert torch.equal(zoo.generate_tokens(model, inputs, **SETTINGS), expected)


@pytest.mark.parametrize("name", ["llama", "whisper"])
def test_save_pretrained_of_a_fused_model_loads_back_as_the_unfused_model(name: str, tmp_path: Path) -> None:
    model = build(name).model
    expected = {key: tensor.clone() for key, tensor in model.state_dict().items()}
    cachelife.enable(model, options=cachelife.Options(fuse_projections=True))
    assert_fused(model)
    model.save_pretrained(tmp_path)
    # transformers 5.25 loads hub kernels by default, which needs the `kernels` package; the weights are asked here.
    loaded = type(model).from_pretrained(tmp_path, use_kernels=False).state_dict()
    assert loaded.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor), key
    assert not any("cachelife_fused" in key for key in loaded)  # the fused buffers are not persistent


def test_cross_attention_is_left_alone() -> None:
    model = build("bart").model
    fused = fuse_projections(model)
    paths = {group.path for group in fused.groups}
    assert "model.decoder.layers.0.self_attn" in paths
    assert "model.encoder.layers.0.self_attn" in paths
    assert not any("encoder_attn" in path for path in paths)
    assert set(fused.skipped) == {f"model.decoder.layers.{i}.encoder_attn.{{q_proj,k_proj,v_proj}}" for i in (0, 1)}
    assert all("cross-attention" in reason for reason in fused.skipped.values())
    assert "forward" not in vars(model.get_submodule("model.decoder.layers.0.encoder_attn.q_proj"))


# ---- traced and compiled --------------------------------------------------------------------------------------


class LinearNodes:
    """A dynamo backend that counts the `linear` calls in each graph it is given and runs the graph as it is."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        self.counts.append(sum(node.target is torch.nn.functional.linear for node in graph.graph.nodes))
        return graph.forward


def traced_linears(model: torch.nn.Module, inputs: zoo.Inputs) -> tuple[torch.Tensor, int]:
    backend = LinearNodes()
    with torch.no_grad():
        logits = torch.compile(model, backend=backend, fullgraph=True)(**inputs).logits
    assert len(backend.counts) == 1
    return logits, backend.counts[0]


def test_a_traced_forward_holds_one_product_per_group() -> None:
    built = build("llama")
    model, inputs = built.model, built.inputs(2, 7, 1)
    twin = copy.deepcopy(model)
    torch._dynamo.reset()
    expected, unfused = traced_linears(model, inputs)
    fuse_projections(model)
    logits, fused = traced_linears(model, inputs)
    assert unfused - fused == SAVED_PER_STEP["llama"]
    torch.testing.assert_close(logits, expected)
    # A parameter replaced while fused: the next trace computes its group's products separately.
    new_weight = torch.randn(64, 64)
    for each in (model, twin):
        each.get_submodule("model.layers.1.self_attn.q_proj").weight = torch.nn.Parameter(new_weight.clone())
    logits, fused = traced_linears(model, inputs)
    assert unfused - fused == SAVED_PER_STEP["llama"] - 2
    with torch.no_grad():
        torch.testing.assert_close(logits, twin(**inputs).logits)


def generate_compiled(
    model: PreTrainedModel, inputs: zoo.Inputs, settings: Mapping[str, Any]
) -> tuple[torch.Tensor, int]:
    output, products = compiled_products(lambda: cachelife.generate(model, fallback=False, **inputs, **settings))
    return tokens(output), products


@pytest.fixture
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.usefixtures("_fresh_dynamo")
@pytest.mark.ci_families("whisper")
@pytest.mark.parametrize("name", MODELS)
def test_compiled_step_has_fewer_matrix_products_and_the_same_tokens(name: str) -> None:
    built = build(name)
    model, inputs = built.model, built.inputs(2, 7, 1)
    expected = zoo.generate_tokens(model, inputs, **SETTINGS)
    unfused_tokens, unfused = generate_compiled(model, inputs, SETTINGS)
    assert torch.equal(unfused_tokens, expected)
    cachelife.enable(model, options=cachelife.Options(fuse_projections=True))
    fused_tokens, fused = generate_compiled(model, inputs, SETTINGS)
    assert torch.equal(fused_tokens, expected)
    assert unfused - fused == SAVED_PER_STEP[name], (unfused, fused)


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.usefixtures("_fresh_dynamo")
@pytest.mark.parametrize("name", ["llama", "t5", "bart", "whisper"])
def test_compiled_beam_search_equals_unfused(name: str) -> None:
    built = build(name)
    model, inputs = built.model, built.inputs(2, 7, 1)
    expected = zoo.generate_tokens(model, inputs, **BEAMS)
    cachelife.enable(model, options=cachelife.Options(fuse_projections=True))
    assert_fused(model)
    fused_tokens, _ = generate_compiled(model, inputs, BEAMS)
    assert torch.equal(fused_tokens, expected)


def test_a_fusion_that_fails_midway_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build("llama").model
    before = snapshot(model)
    concatenations = 0
    concatenate = torch.cat

    def failing_third(tensors: list[torch.Tensor]) -> torch.Tensor:  # the third group's weight (no biases here)
        nonlocal concatenations
        concatenations += 1
        if concatenations == 3:
            raise MemoryError("no memory left for the fused weight")
        return concatenate(tensors)

    monkeypatch.setattr(torch, "cat", failing_third)
    with pytest.raises(MemoryError):
        fuse_projections(model)
    monkeypatch.undo()
    after = snapshot(model)
    assert concatenations == 3
    assert after["parameters"] == before["parameters"]
    assert after["buffers"] == before["buffers"]
    assert after["attributes"] == before["attributes"]
    assert all(torch.equal(after["state"][key], data) for key, data in before["state"].items())
    assert len(fuse_projections(model).groups) == 4  # and it can be fused afterwards


def test_groups_already_fused_or_hooked_are_left_alone() -> None:
    model = build("llama").model
    hooked = model.get_submodule("model.layers.0.mlp.up_proj")
    hooked.register_forward_hook(lambda module, args, output: None)
    fused = fuse_projections(model)
    assert len(fused.groups) == 3
    assert fused.skipped == {
        "model.layers.0.mlp.{gate_proj,up_proj}": "up_proj has a forward of its own or forward hooks"
    }
    again = fuse_projections(model)
    assert again.groups == ()
    assert set(again.skipped.values()) == {"already fused", "up_proj has a forward of its own or forward hooks"}
