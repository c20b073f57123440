"""Fused decoder layers (`cachelife.Options(fused_layers=True)`, `cachelife.model_rewrites.fused_layers`):
Whisper's and Llama's decoder layers with their norms, activation and residual adds in `cachelife::layer_linear`;
the tokens of the unrewritten model; gradients; `disable` giving the model back; models it does not know left
alone.

Every token test also counts the op's calls, so that equality tests the rewritten layers and not their absence.
Without Triton (or without `TRITON_INTERPRET=1`) the op runs the same operations in torch; with both, the
kernel in Triton's interpreter.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from transformers import PreTrainedModel

import cachelife
from cachelife.kernels.layer_linear import layer_linear
from cachelife.model_rewrites import layer_products
from cachelife.model_rewrites.fused_layers import WhisperLayerForward, fuse_layers
from cachelife.serving.engine import Engine
from cachelife.tools import zoo

OP = "cachelife::layer_linear"
NEW = 6
SETTINGS: dict[str, Any] = {"do_sample": False, "max_new_tokens": NEW, "min_new_tokens": NEW}
# Per decoder layer and step, without and with fused projections. Whisper: the query, key and value (one product
# fused), the cross-attention's query, the two output projections with their residuals, fc1 with its norm and
# activation, fc2 with its residual. Llama: the query, key and value, the output projection, gate and up (one
# product fused), down.
CALLS_PER_LAYER = {
    "whisper": {False: 3 + 1 + 2 + 2, True: 1 + 1 + 2 + 2},
    "llama": {False: 3 + 1 + 2 + 1, True: 1 + 1 + 1 + 1},
}


def op_calls(model: PreTrainedModel, inputs: zoo.Inputs, **options: Any) -> tuple[int, torch.Tensor]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True) as profile:
        output = cachelife.generate(model, fallback=False, **inputs, **SETTINGS, **options)
    if not isinstance(output, torch.Tensor):
        pytest.fail(f"cachelife.generate returned a {type(output).__name__}")
    return sum(event.count for event in profile.key_averages() if event.key == OP), output


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    layers = model.get_submodule("model.decoder.layers")
    assert isinstance(layers, torch.nn.ModuleList)
    return layers


def enabled(name: str = "whisper", *, projections: bool) -> tuple[PreTrainedModel, zoo.Inputs, torch.Tensor]:
    built = zoo.build(name)
    model, inputs = built.model, built.inputs(1, 7, 1)  # one row: FUSED_ROWS
    if name == "llama":  # a left-padded prompt with its mask
        inputs = zoo.left_padded(inputs, 3, int(model.config.pad_token_id or 0))
    expected = zoo.generate_tokens(model, inputs, **SETTINGS)
    cachelife.enable(model, options=cachelife.Options(fused_layers=True, fuse_projections=projections))
    return model, inputs, expected


def layer_count(model: PreTrainedModel) -> int:
    return int(getattr(model.config, "decoder_layers", None) or model.config.num_hidden_layers)


@pytest.mark.parametrize("name", ["whisper", "llama"])
@pytest.mark.parametrize("projections", [False, True])
def test_the_eager_tokens_come_through_the_fused_products(name: str, projections: bool) -> None:
    model, inputs, expected = enabled(name, projections=projections)
    calls, tokens = op_calls(model, inputs, compile_step=False)
    # Every step ran each layer's products through the op; the prefill too where its rows are few (Whisper's
    # decoder prompt), not Llama's prompt of ten tokens.
    steps = NEW if name == "whisper" else NEW - 1
    assert calls == steps * layer_count(model) * CALLS_PER_LAYER[name][projections]
    assert torch.equal(tokens, expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["whisper", "llama"])
def test_the_compiled_step_decodes_the_eager_tokens(name: str) -> None:
    model, inputs, expected = enabled(name, projections=True)
    tokens = cachelife.generate(model, fallback=False, **inputs, **SETTINGS)
    assert isinstance(tokens, torch.Tensor)
    assert torch.equal(tokens, expected)


# The kernels a compiled step's code calls: CPU inductor's fused kernels, extern products and custom ops.
KERNEL_CALL = re.compile(r"\b(?:cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+\.default)\(")


def step_kernels(options: cachelife.Options) -> int:
    """The kernel calls in the code of Whisper's compiled decoding step with `options` (dynamo reset first)."""
    torch._dynamo.reset()
    built = zoo.build("whisper")
    model, inputs = built.model, built.inputs(1, 5, 1)
    cachelife.enable(model, options=options)
    _, codes = run_and_get_code(lambda: cachelife.generate(model, fallback=False, **inputs, **SETTINGS))
    return sum(len(KERNEL_CALL.findall(code.split("def call(")[-1])) for code in codes if "def call(" in code)


@pytest.mark.slow
def test_the_compiled_step_calls_fewer_kernels_per_layer() -> None:
    """Each layer's norms, activation and residual adds leave the step's code: with fused projections, at least
    five kernels fewer per layer than the default step on CPU inductor (each norm's own kernel, the GELU's, the
    residual adds' and two of the query, key and value products)."""
    layers = zoo.build("whisper").model.config.decoder_layers
    default = step_kernels(cachelife.EXACT)
    fused = step_kernels(cachelife.Options(fused_layers=True, fuse_projections=True))
    assert 0 < fused <= default - 5 * layers, (fused, default)


def test_the_forward_equals_the_layers_as_written_for_many_rows_and_a_prompt() -> None:
    """Teacher-forced logits, several rows of several positions (the prefill's shape), within float32 sums."""
    built = zoo.build("whisper")
    model, inputs = built.model, built.inputs(3, 5, 2)
    decoder_ids = torch.randint(3, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(**inputs, decoder_input_ids=decoder_ids).logits
        fused = fuse_layers(model)
        output = model(**inputs, decoder_input_ids=decoder_ids).logits
        fused.restore()
    assert len(fused.layers) == model.config.decoder_layers
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=2e-5)


def test_a_prompt_of_many_rows_takes_the_layer_s_own_operations() -> None:
    """More than FUSED_ROWS rows (a prompt of 7 tokens) run the model's operations, which a compiled prefill fuses
    as it fuses the unrewritten model's; the decoding steps' one row takes the op."""
    built = zoo.build("llama")
    model, inputs = built.model, built.inputs(1, 7, 2)
    expected = zoo.generate_tokens(model, inputs, **SETTINGS)
    cachelife.enable(model, options=cachelife.Options(fused_layers=True, fuse_projections=False))
    calls, tokens = op_calls(model, inputs, compile_step=False)
    assert calls == (NEW - 1) * layer_count(model) * CALLS_PER_LAYER["llama"][False]
    assert torch.equal(tokens, expected)


def test_gradients_flow_as_through_the_layers_as_written() -> None:
    built = zoo.build("whisper")
    model, inputs = built.model, built.inputs(2, 5, 4)
    decoder_ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(5))

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(**inputs, decoder_input_ids=decoder_ids, labels=decoder_ids).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    expected = gradients()
    fused = fuse_layers(model)
    output = gradients()
    fused.restore()
    assert output.keys() == expected.keys()
    assert any("fc1" in name for name in output)
    for name, grad in expected.items():
        torch.testing.assert_close(output[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_disable_gives_every_forward_back() -> None:
    model, _, _ = enabled(projections=True)
    layer = decoder_layers(model)[0]
    assert isinstance(layer.forward, WhisperLayerForward)
    cachelife.disable(model)
    rewritten = [name for name, module in model.named_modules() if "forward" in module.__dict__]
    assert rewritten == []


def test_a_deep_copy_runs_and_restores_its_own_layers() -> None:
    model, inputs, expected = enabled(projections=True)
    twin = copy.deepcopy(model)
    twin_forward = decoder_layers(twin)[0].forward
    assert isinstance(twin_forward, WhisperLayerForward)
    assert twin_forward.parts.layer is decoder_layers(twin)[0]  # the copy's modules, not the original's
    calls, tokens = op_calls(twin, inputs, compile_step=False)
    assert calls > 0
    assert torch.equal(tokens, expected)
    cachelife.disable(twin)
    assert [name for name, module in twin.named_modules() if "forward" in module.__dict__] == []
    assert isinstance(decoder_layers(model)[0].forward, WhisperLayerForward)


def test_turning_fused_projections_off_keeps_the_layers_fused_and_exact() -> None:
    """The guard undoes and reapplies the fused layers around the projections they build on."""
    model, inputs, expected = enabled(projections=True)
    cachelife.enable(model, options=cachelife.Options(fused_layers=True, fuse_projections=False))
    calls, tokens = op_calls(model, inputs, compile_step=False)
    assert calls == NEW * layer_count(model) * CALLS_PER_LAYER["whisper"][False]
    assert torch.equal(tokens, expected)


def test_a_model_it_does_not_know_is_left_alone_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    built = zoo.build("t5")
    model, inputs = built.model, built.inputs(1, 5, 1)
    expected = zoo.generate_tokens(model, inputs, **SETTINGS)
    with caplog.at_level(logging.WARNING, logger="cachelife"):
        cachelife.enable(model, options=cachelife.Options(fused_layers=True, fuse_projections=False))
    assert "fused_layers=True: no layer of T5ForConditionalGeneration can be fused" in caplog.text
    calls, tokens = op_calls(model, inputs, compile_step=False)
    assert calls == 0
    assert torch.equal(tokens, expected)


def test_a_layer_with_a_hook_is_skipped_by_name() -> None:
    model = zoo.build("whisper").model
    decoder_layers(model)[1].get_submodule("fc1").register_forward_hook(lambda *_: None)
    fused = fuse_layers(model)
    assert len(fused.layers) == model.config.decoder_layers - 1
    assert fused.skipped == {"model.decoder.layers.1": "fc1 is not a plain torch.nn.Linear"}
    fused.restore()


def engine_requests(name: str, device: str = "cpu") -> tuple[PreTrainedModel, list[dict[str, Any]]]:
    built = zoo.build(name, device=device)
    if name == "whisper":
        zoo.whisper_tiny_generation(built.model.generation_config)
    requests = [{**built.inputs(1, 2 + (5 * index) % 9, index), "max_new_tokens": 2 + (7 * index) % 11}
                for index in range(6)]  # fmt: skip
    return built.model, requests


@pytest.mark.parametrize("batch", [1, 2])
def test_one_row_takes_the_op_and_two_rows_the_layer_s_own_operations(batch: int) -> None:
    """One row (a one-token prompt, then every step) takes the op; two, the layer's own operations (the
    matrix-product library is faster than the op from a few rows on); the same tokens."""
    built = zoo.build("llama")
    model, inputs = built.model, built.inputs(batch, 1, 4)
    expected = zoo.generate_tokens(model, inputs, **SETTINGS)
    cachelife.enable(model, options=cachelife.Options(fused_layers=True, fuse_projections=False))
    calls, tokens = op_calls(model, inputs, compile_step=False)
    assert calls == (NEW * layer_count(model) * CALLS_PER_LAYER["llama"][False] if batch == 1 else 0)
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("name", ["whisper", "llama"])
def test_the_engine_s_rows_decode_generate_s_tokens_through_the_fused_products(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, requests = engine_requests(name)
    expected = [zoo.generate_tokens(model, request) for request in requests]
    cachelife.enable(model, options=cachelife.Options(fused_layers=True, fuse_projections=True))
    calls = []  # the engine's threads call the op: counted here, not by a profile of this thread

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return layer_linear(*args, **kwargs)

    monkeypatch.setattr(layer_products, "layer_linear", counted)
    with Engine(model, rows=1, max_length=40, compile_step=False) as engine:
        results = [future.result(timeout=120) for future in [engine.submit(**request) for request in requests]]
    assert calls
    for index, (result, tokens) in enumerate(zip(results, expected, strict=True)):
        assert torch.equal(result, tokens), index


# -- on a GPU: the compiled kernel in cachelife's CUDA graphs --------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["whisper", "llama"])
@pytest.mark.parametrize("steps", [1, 3])
def test_under_graphs_the_tokens_are_generate_s(name: str, steps: int) -> None:
    built = zoo.build(name, device=torch.device("cuda"))
    model, inputs = built.model, built.inputs(1, 7, 1)
    if name == "llama":
        inputs = zoo.left_padded(inputs, 3, int(model.config.pad_token_id or 0))
    expected = zoo.generate_tokens(model, inputs, **SETTINGS)
    cachelife.enable(model, options=cachelife.Options(fused_layers=True, fuse_projections=True))
    tokens = cachelife.generate(
        model, fallback=False, steps_per_call=steps, cuda_graphs="cachelife", **inputs, **SETTINGS
    )
    assert isinstance(tokens, torch.Tensor)
    assert torch.equal(tokens, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["whisper", "llama"])
def test_the_engine_s_rows_under_graphs_decode_generate_s_tokens(name: str) -> None:
    model, requests = engine_requests(name, "cuda")
    expected = [zoo.generate_tokens(model, request) for request in requests]
    cachelife.enable(model, options=cachelife.Options(fused_layers=True, fuse_projections=True))
    with Engine(model, rows=1, max_length=40) as engine:
        results = [future.result(timeout=300) for future in [engine.submit(**request) for request in requests]]
    for index, (result, tokens) in enumerate(zip(results, expected, strict=True)):
        assert torch.equal(result, tokens), index
