"""`cachelife.Options(decode_attention=True)`: cachelife's decode attention as an enabled model's attention
implementation, eager tokens from `cachelife.generate`, and `disable` giving every config its implementation back.

Every token test also counts the op's calls, so that equality tests the kernel and not its absence. Without
Triton (or without `TRITON_INTERPRET=1`) the op runs its torch fallback; with both, Triton's interpreter.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedConfig, PreTrainedModel

import cachelife
from cachelife.errors import UnsupportedGenerationError
from cachelife.integration.runtime import runtime_of
from cachelife.model_rewrites.decode_attention import ATTENTION
from cachelife.tools import zoo

OP = "cachelife::decode_attention"
NEW = 6
SETTINGS: dict[str, Any] = {"do_sample": False, "max_new_tokens": NEW, "min_new_tokens": NEW}
# name -> the op's calls in one call of NEW new tokens: attention layers per decoder step (self-attention, and
# cross-attention with a mask or T5's position bias) x the steps with one query (all but a decoder-only prompt's).
# Whisper's cross-attention has no mask, nothing for the kernel to skip: SDPA keeps it.
OP_CALLS = {"llama": 2 * (NEW - 1), "whisper": 2 * NEW, "t5": 4 * NEW}


def configs(model: nn.Module) -> list[PreTrainedConfig]:
    """Every config the model's modules hold, once each (T5's stacks hold copies of the model's)."""
    found = {id(c): c for m in model.modules() if isinstance(c := getattr(m, "config", None), PreTrainedConfig)}
    return list(found.values())


def implementations(model: nn.Module) -> list[str | None]:
    return [config._attn_implementation for config in configs(model)]


def op_calls_and_tokens(model: PreTrainedModel, inputs: zoo.Inputs, **options: Any) -> tuple[int, torch.Tensor]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        output = cachelife.generate(model, fallback=False, **inputs, **SETTINGS, **options)
    if not isinstance(output, torch.Tensor):
        pytest.fail(f"cachelife.generate returned a {type(output).__name__}")
    return sum(event.count for event in profile.key_averages() if event.key == OP), output


@pytest.mark.parametrize("name", list(OP_CALLS))
def test_cachelife_generate_takes_the_kernel_with_eager_tokens(name: str) -> None:
    built = zoo.build(name)
    model, inputs = built.model, built.inputs(2, 7, 1)
    expected = zoo.generate_tokens(model, inputs, **SETTINGS)
    cachelife.enable(model, options=cachelife.Options(decode_attention=True))
    assert implementations(model) == [ATTENTION] * len(configs(model))
    calls, tokens = op_calls_and_tokens(model, inputs, compile_step=False)
    assert calls == OP_CALLS[name]
    assert torch.equal(tokens, expected)


@pytest.mark.slow
@pytest.mark.ci_families("whisper")
@pytest.mark.parametrize("name", list(OP_CALLS))
def test_the_compiled_step_takes_the_kernel_with_eager_tokens(name: str) -> None:
    torch._dynamo.reset()
    built = zoo.build(name)
    model, inputs = built.model, built.inputs(2, 7, 1)
    expected = zoo.generate_tokens(model, inputs, **SETTINGS)
    cachelife.enable(model, options=cachelife.Options(decode_attention=True, fuse_projections=True))
    calls, tokens = op_calls_and_tokens(model, inputs)
    assert calls > 0
    assert torch.equal(tokens, expected)
    torch._dynamo.reset()


def test_disable_and_enable_without_it_give_each_config_its_implementation_back() -> None:
    model = zoo.build("t5").model
    configs(model)[0]._attn_implementation = "eager"
    before = implementations(model)
    assert before == ["eager", "sdpa", "sdpa"]
    switched = [ATTENTION] * 3
    cachelife.enable(model, options=cachelife.Options(decode_attention=True))
    assert implementations(model) == switched
    cachelife.disable(model)
    assert implementations(model) == before
    cachelife.enable(model, options=cachelife.Options(decode_attention=True))
    cachelife.enable(model, options=cachelife.Options(decode_attention=True))  # unchanged: nothing happens
    assert implementations(model) == switched
    cachelife.enable(model)
    assert cachelife.is_enabled(model)
    assert implementations(model) == before


def test_switching_releases_the_runtime() -> None:
    built = zoo.build("llama")
    model, inputs = built.model, built.inputs(2, 7, 1)
    cachelife.enable(model)
    cachelife.generate(model, compile_step=False, **inputs, **SETTINGS)
    assert len(runtime_of(model).states) > 0
    cachelife.enable(model, options=cachelife.Options(decode_attention=True))
    assert len(runtime_of(model).states) == 0  # compiled steps and graphs called the other attention


def test_a_deep_copy_is_switched_and_restored_on_its_own() -> None:
    model = zoo.build("whisper").model
    before = implementations(model)
    cachelife.enable(model, options=cachelife.Options(decode_attention=True))
    twin = copy.deepcopy(model)
    assert implementations(twin) == [ATTENTION] * len(before)
    cachelife.disable(twin)
    assert implementations(twin) == before
    assert implementations(model) == [ATTENTION] * len(before)


class OwnAttention(nn.Module):
    """Attention written out in the module, as in models from before transformers' attention interface
    (transformers tells them by their module's source: an attention class, and no call of the interface)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.softmax(hidden @ hidden.transpose(-1, -2), dim=-1) @ hidden


class OwnAttentionModel(PreTrainedModel):
    config_class = LlamaConfig

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.attention = OwnAttention()


def test_a_model_with_a_part_of_its_own_attention_is_refused_before_anything_changes() -> None:
    """A composite model, one part of which computes attention itself: refused at `enable`, fresh or enabled
    already, and nothing else asked for in the same call (fused projections) is applied either."""
    model = zoo.build("llama").model
    model.add_module("own", OwnAttentionModel(zoo.llama_tiny()))
    before = implementations(model)
    refusal = "OwnAttentionModel computes attention outside transformers' attention interface"
    with pytest.raises(UnsupportedGenerationError, match=refusal):
        cachelife.enable(model, options=cachelife.Options(decode_attention=True))
    assert not cachelife.is_enabled(model)
    cachelife.enable(model, options=cachelife.EXACT)
    with pytest.raises(UnsupportedGenerationError, match=refusal):
        cachelife.enable(model, options=cachelife.Options(decode_attention=True, fuse_projections=True))
    assert implementations(model) == before
    assert not any("cachelife_fused" in name for name, _ in model.named_buffers())
    cachelife.enable(
        model, options=cachelife.Options(fuse_projections=True)
    )  # the settings were left as they were: this fuses
    assert any("cachelife_fused" in name for name, _ in model.named_buffers())


def test_the_kernel_is_enabled_without_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On CUDA too: the process lost in GPU runs 26 and 29 was pytest ending its session on a warning filter it
    could not parse, not the kernel, whose GPU tests (captured in CUDA graphs too) pass since run 35."""
    model = zoo.build("llama").model
    for device in (torch.device("cpu"), torch.device("cuda")):

        def on(self: object, device: torch.device = device) -> torch.device:
            return device

        monkeypatch.setattr(type(model), "device", property(on))
        with caplog.at_level(logging.WARNING, logger="cachelife"):
            cachelife.enable(model, options=cachelife.Options(decode_attention=True))
        assert model.device == device
        assert not caplog.records, caplog.text
        cachelife.disable(model)
    monkeypatch.undo()
