"""A layer's fused few-row product (`cachelife.kernels.layer_linear`): every prologue and epilogue against the
same operations in torch, the fallback for many rows, tracing, refusals, and (on a GPU) the compiled kernel at
whisper-large-v3's shapes and inside a CUDA graph.

The Triton tests run the kernel in Triton's interpreter on the CPU (`TRITON_INTERPRET=1` with Triton installed,
as `nox` runs them); elsewhere they are skipped.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cachelife.errors import InvalidArgumentError
from cachelife.kernels.layer_linear import Activation, Fusion, Norm, layer_linear, layer_linear_reference
from cachelife.kernels.linear import MAX_ROWS
from cachelife.kernels.triton_support import triton_runs_on

needs_triton = pytest.mark.skipif(
    not triton_runs_on(torch.device("cpu")),
    reason="needs Triton and TRITON_INTERPRET=1 (Triton's CPU interpreter): skipped, not passed",
)
# Against the same operations in the same dtype: float32 sums in another order; bfloat16 may land one rounding
# step away at each of the fused roundings (the interpreter also rounds toward zero, a GPU to the nearest).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 0.07}


def parts(rows: int, inputs: int, features: int, dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows * 7919 + inputs * 31 + features)

    def draw(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * scale + shift).to(device, dtype)

    return {
        "x": draw(rows, 1, inputs, scale=3.0, shift=1.0),  # off-centre, so that a norm has work to do
        "weight": draw(features, inputs, scale=inputs**-0.5),
        "bias": draw(features),
        "norm_weight": draw(inputs, scale=0.1, shift=1.0),
        "norm_bias": draw(inputs, scale=0.1),
        "residual": draw(rows, 1, features),
    }


def arguments(case: str, given: dict[str, torch.Tensor]) -> Fusion:
    """The fusion of one prologue/epilogue case."""
    layer: dict[str, Any] = {"norm": Norm.LAYER, "norm_weight": given["norm_weight"], "norm_bias": given["norm_bias"]}
    cases: dict[str, dict[str, Any]] = {
        "layer_norm": layer,
        "layer_norm_without_bias": layer | {"norm_bias": None},
        "rms_norm": {"norm": Norm.RMS, "norm_weight": given["norm_weight"], "eps": 1e-6},
        "gelu": {"activation": Activation.GELU},
        "residual": {"residual": given["residual"]},
        "norm_and_gelu": layer | {"activation": Activation.GELU},
        "everything": layer | {"activation": Activation.GELU, "residual": given["residual"]},
    }
    return Fusion(**cases[case])


CASES = ["layer_norm", "layer_norm_without_bias", "rms_norm", "gelu", "residual", "norm_and_gelu", "everything"]


def check(case: str, given: dict[str, torch.Tensor], *, bias: bool = True) -> None:
    fusion = arguments(case, given)
    b = given["bias"] if bias else None
    output = layer_linear(given["x"], given["weight"], b, fusion)
    expected = layer_linear_reference(given["x"], given["weight"], b, fusion)
    assert output.dtype == expected.dtype
    assert output.shape == expected.shape
    tolerance = TOLERANCE[given["x"].dtype]
    torch.testing.assert_close(output.double(), expected.double(), atol=tolerance, rtol=tolerance)


SHAPES = [
    (1, 96, 40, torch.float32), (3, 100, 37, torch.float32), (2, 64, 130, torch.bfloat16),
    (12, 200, 40, torch.float32), (16, 72, 24, torch.bfloat16),  # tl.dot's tiles
]  # fmt: skip


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("rows", "inputs", "features", "dtype"), SHAPES)
def test_kernel_equals_the_operations_one_by_one(
    case: str, rows: int, inputs: int, features: int, dtype: torch.dtype
) -> None:
    check(case, parts(rows, inputs, features, dtype))


@needs_triton
def test_kernel_without_a_bias_and_at_the_most_rows() -> None:
    check("everything", parts(MAX_ROWS, 48, 24, torch.float32), bias=False)


@needs_triton
def test_each_fused_part_changes_the_output() -> None:
    """The prologue and epilogue are not skipped: each case differs from the plain product."""
    given = parts(2, 64, 32, torch.float32)
    plain = layer_linear(given["x"], given["weight"], given["bias"])
    for case in CASES:
        fused = layer_linear(given["x"], given["weight"], given["bias"], arguments(case, given))
        assert (fused - plain).abs().max() > 1e-2, case


def test_many_rows_run_the_operations_in_torch() -> None:
    given = parts(MAX_ROWS + 1, 32, 16, torch.float32)
    fusion = arguments("everything", given)
    output = layer_linear(given["x"], given["weight"], given["bias"], fusion)
    assert torch.equal(output, layer_linear_reference(given["x"], given["weight"], given["bias"], fusion))


@needs_triton
def test_the_op_traces_with_fullgraph() -> None:
    given = parts(2, 64, 48, torch.float32)

    def step(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        normed = layer_linear(x, given["weight"], given["bias"], arguments("norm_and_gelu", given))
        return layer_linear(normed, given["weight"][:, :48], None, Fusion(residual=residual))

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    residual = given["residual"]
    assert torch.equal(compiled(given["x"], residual), step(given["x"], residual))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"norm": Norm.LAYER}, "a norm weight for LAYER"),
        ({"norm_weight": torch.ones(64)}, "no norm parameters without a norm"),
        ({"norm": Norm.RMS, "norm_weight": torch.ones(64), "norm_bias": torch.zeros(64)}, "no norm bias for RMS"),
        ({"norm": Norm.LAYER, "norm_weight": torch.ones(63)}, "a norm weight (64,)"),
        ({"norm": Norm.LAYER, "norm_weight": torch.ones(64, dtype=torch.float64)}, "a norm weight (64,)"),
        ({"residual": torch.zeros(2, 1, 47)}, "a residual (2, 1, 48)"),
    ],
)
def test_inputs_that_do_not_fit_are_refused_by_name(change: dict[str, Any], named: str) -> None:
    given = parts(2, 64, 48, torch.float32)
    with pytest.raises(InvalidArgumentError, match=r"^layer_linear expects ") as error:
        layer_linear(given["x"], given["weight"], given["bias"], Fusion(**change))
    assert named in str(error.value)


# -- on a GPU: the compiled Triton kernel -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "inputs", "features", "case"), [
    (1, 1280, 3840, "layer_norm"), (1, 1280, 1280, "residual"), (1, 1280, 5120, "norm_and_gelu"),
    (1, 5120, 1280, "residual"), (16, 1280, 5120, "norm_and_gelu"), (16, 5120, 1280, "residual"),
    (4, 2048, 2048, "rms_norm"),
])  # fmt: skip
def test_kernel_on_cuda_equals_the_operations_one_by_one(
    rows: int, inputs: int, features: int, case: str, dtype: torch.dtype
) -> None:
    """whisper-large-v3's decoder products (fused query, key and value; output projections; fc1; fc2) at one and
    sixteen rows, and a Llama-3.2-1B-shaped normalised product."""
    check(case, parts(rows, inputs, features, dtype, "cuda"))


@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph() -> None:
    given = parts(2, 256, 512, torch.bfloat16, "cuda")
    fusion = arguments("everything", given)
    out = layer_linear(given["x"], given["weight"], given["bias"], fusion)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer_linear(given["x"], given["weight"], given["bias"], fusion)
    given["x"].copy_(torch.randn_like(given["x"]))
    given["residual"].copy_(torch.randn_like(given["residual"]))
    graph.replay()
    torch.cuda.synchronize()
    expected = layer_linear_reference(given["x"], given["weight"], given["bias"], fusion)
    torch.testing.assert_close(out.double(), expected.double(), atol=0.07, rtol=0.07)
