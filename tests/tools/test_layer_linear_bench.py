"""bench.layer_linear's measurement on the CPU (Triton's interpreter, or the op's torch operations without it),
with its CUDA-graph timer replaced by one call: every path it times, and a verdict that fails when a path's
output is further from float64 than twice the compiled operations'."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from bench import layer_linear

from cachelife.kernels.layer_linear import Activation, Fusion, Norm, layer_linear_reference


def untimed(call: Any) -> float:
    call()
    return 1.0


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layer_linear, "device_ms_per_call", untimed)


def test_many_rows_time_the_lanes_and_the_other_tiles_and_agree() -> None:
    case = layer_linear.Case(inputs=64, features=48, residual=True)
    result = layer_linear.measure("out", case, 16, torch.device("cpu"), torch.float32, dot_plans=("16x64", "32x32"))
    assert list(result["paths"]) == ["inductor", "fused", "fused_lanes", "fused_dot_16x64", "fused_dot_32x32"]
    assert result["verdict"]["all_agree_with_inductor"] is True


def test_a_path_further_from_float64_fails_the_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    def off(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fusion: Fusion) -> torch.Tensor:
        return layer_linear_reference(x, weight, bias, fusion._replace(activation=Activation.NONE))  # GELU dropped

    monkeypatch.setattr(layer_linear, "layer_linear", off)
    case = layer_linear.Case(inputs=64, features=48, norm=Norm.LAYER, activation=Activation.GELU)
    result = layer_linear.measure("fc1", case, 1, torch.device("cpu"), torch.float32)
    assert result["verdict"]["all_agree_with_inductor"] is False
