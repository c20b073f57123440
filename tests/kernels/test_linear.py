"""The small-batch linear kernel (`cachelife.kernels.linear`): its Triton kernel against a float64 product, the
custom op's fallback and tracing, its refusals, and (on a GPU) the compiled kernel inside a CUDA graph.

The Triton tests run the kernel on the CPU in Triton's interpreter (`TRITON_INTERPRET=1` with Triton
installed, as `nox` runs them); elsewhere they are skipped, and the op runs `torch.nn.functional.linear`.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from cachelife.errors import InvalidArgumentError
from cachelife.kernels.linear import DOT_ROWS, MAX_ROWS, plan_blocks, small_linear, small_linear_kernel
from cachelife.kernels.triton_support import triton_runs_on

INTERPRETED = triton_runs_on(torch.device("cpu"))
needs_triton = pytest.mark.skipif(
    not INTERPRETED, reason="needs Triton and TRITON_INTERPRET=1 (Triton's CPU interpreter): skipped, not passed"
)
# One output ulp of each dtype, relative, over a float64 product of the same inputs: Triton's interpreter
# rounds toward zero when it converts to bfloat16, a GPU to the nearest.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def inputs(shape: tuple[int, ...], features: int, dtype: torch.dtype, bias: bool, device: str = "cpu") -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor | None
]:  # fmt: skip
    generator = torch.Generator().manual_seed(math.prod(shape) * 1000 + features)
    x = torch.randn(shape, generator=generator).to(device, dtype)
    weight = (torch.randn(features, shape[-1], generator=generator) / shape[-1] ** 0.5).to(device, dtype)
    return x, weight, torch.randn(features, generator=generator).to(device, dtype) if bias else None


def check_close(output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert output.dtype == x.dtype
    assert output.shape == expected.shape
    tolerance = TOLERANCE[x.dtype]
    torch.testing.assert_close(output.double(), expected, atol=tolerance, rtol=tolerance)


CASES = [  # (input shape, output features, dtype, bias)
    ((1, 64), 96, torch.float32, True),
    ((3, 100), 37, torch.float32, False),  # no power of two anywhere
    ((2, 1, 128), 256, torch.bfloat16, True),  # a decoding step's (batch, 1, hidden)
    ((5, 1, 72), 40, torch.float16, False),
    ((MAX_ROWS, 48), 24, torch.float32, True),
]


@needs_triton
@pytest.mark.parametrize(("shape", "features", "dtype", "bias"), CASES)
def test_kernel_equals_a_float64_product(shape: tuple[int, ...], features: int, dtype: torch.dtype, bias: bool) -> None:
    x, weight, b = inputs(shape, features, dtype, bias)
    check_close(small_linear(x, weight, b), x, weight, b)


@needs_triton
def test_kernel_reads_strided_inputs() -> None:
    x, _, bias = inputs((40, 4), 24, torch.float32, True)
    strided_x, strided_weight = x.t(), torch.randn(40, 24).t()  # (4, 40) and (24, 40), neither contiguous
    check_close(small_linear(strided_x, strided_weight, bias), strided_x, strided_weight, bias)


@pytest.mark.parametrize("rows", [MAX_ROWS + 1, 40])
def test_more_rows_than_the_kernel_takes_are_torch_s_product(rows: int) -> None:
    """Past `MAX_ROWS` (and on any device without the kernels) the op is `F.linear` itself, bit for bit."""
    x, weight, bias = inputs((rows, 32), 16, torch.float32, True)
    assert torch.equal(small_linear(x, weight, bias), F.linear(x, weight, bias))


@pytest.mark.skipif(INTERPRETED, reason="checks the fallback, which the interpreter replaces: skipped, not passed")
def test_without_the_kernels_the_op_is_torch_s_product() -> None:
    x, weight, bias = inputs((2, 32), 16, torch.bfloat16, True)
    assert torch.equal(small_linear(x, weight, bias), F.linear(x, weight, bias))


def test_empty_inputs() -> None:
    x, weight, bias = inputs((0, 8), 4, torch.float32, True)
    assert small_linear(x, weight, bias).shape == (0, 4)
    none = torch.zeros(2, 0)
    assert torch.equal(small_linear(none, torch.zeros(3, 0), torch.ones(3)), torch.ones(2, 3))


def test_inputs_that_are_no_linear_product_are_refused() -> None:
    x, weight, bias = inputs((2, 8), 4, torch.float32, True)
    assert bias is not None
    with pytest.raises(InvalidArgumentError, match=r"weight \(out_features, in_features\), got \(2, 8\), \(4, 7\)"):
        small_linear(x, weight[:, :7])
    with pytest.raises(InvalidArgumentError, match=r"a bias \(out_features,\) = \(4,\), got \(3,\)"):
        small_linear(x, weight, bias[:3])
    with pytest.raises(InvalidArgumentError, match="all of one dtype"):
        small_linear(x, weight.double())
    with pytest.raises(InvalidArgumentError, match="all of one dtype"):
        small_linear(x.long(), weight.long())


@given(
    rows=st.integers(1, MAX_ROWS), features=st.integers(1, 60000), in_features=st.integers(1, 9000),
    programs=st.sampled_from([1, 264, 2000]), tensor_cores=st.booleans(),
)  # fmt: skip
def test_the_block_plan(rows: int, features: int, in_features: int, programs: int, tensor_cores: bool) -> None:
    dot = tensor_cores and rows >= DOT_ROWS  # the lanes' plan serves many rows too (16-bit on the interpreter)
    block_m, block_n, block_k = plan_blocks(
        rows=rows, features=features, inputs=in_features, programs=programs, dot=dot
    )
    for block in (block_m, block_n, block_k):
        assert block & (block - 1) == 0  # Triton's ranges are powers of two
    if dot:  # tensor cores: tiles of 16 rows, 16 features and 16 to 128 inputs
        assert (block_m, block_n) == (16, 16)
        assert 16 <= block_k <= 128
        return
    assert rows <= block_m < 2 * rows
    assert 1 <= block_n <= 64
    # The widest block that still gives the programs asked for: one step wider would give too few.
    assert block_n == 1 or math.ceil(features / block_n) >= programs or block_n == 64
    assert block_n == 64 or math.ceil(features / (2 * block_n)) < programs
    assert block_k <= 1 << max(in_features - 1, 0).bit_length()
    assert block_m * block_n * block_k <= max(4096, block_m * block_n * 16)


@pytest.mark.slow
def test_op_traces_under_fullgraph_compile() -> None:
    """dynamo traces the op with `fullgraph=True` (its fake implementation gives the shape), and the compiled
    function computes what the op computes eagerly."""
    x, weight, bias = inputs((2, 1, 64), 48, torch.float32, True)
    compiled = torch.compile(small_linear, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x, weight, bias), small_linear(x, weight, bias))


def test_kernel_compiles_for_a_gpu_without_one(tmp_path: Path) -> None:
    """Triton's compiler checks what its interpreter does not: the kernel compiles to code for an H100-class
    GPU (sm_90) here, which needs none. In a process of its own (TRITON_INTERPRET stays on once on)."""
    pytest.importorskip("triton.backends.nvidia", reason="needs Triton with its NVIDIA backend: skipped, not passed")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]


def compile_kernel() -> None:
    """Compile the kernel for sm_90 in a few variants down to a GPU binary (run as this file's main)."""
    compiler = importlib.import_module("triton.compiler")
    target = importlib.import_module("triton.backends.compiler").GPUTarget("cuda", 90, 32)
    kernel = importlib.import_module("triton.runtime.jit").JITFunction(small_linear_kernel)
    plain = {"NORM": 0, "NORM_BIAS": False, "ACTIVATION": 0, "HAS_RESIDUAL": False, "DOT": False}
    layer = {"NORM": 1, "NORM_BIAS": True, "ACTIVATION": 1, "HAS_RESIDUAL": True}  # every prologue and epilogue
    dot = {"DOT": True, "LANES": 1}  # tl.dot's tiles
    for dtype, has_bias, blocks, more in (
        ("bf16", True, (1, 4, 1024), plain), ("fp32", False, (8, 64, 16), plain),
        ("bf16", True, (2, 16, 256), plain | layer), ("fp32", False, (1, 8, 512), plain | {"NORM": 2}),
        ("bf16", True, (16, 16, 128), plain | layer | dot), ("fp32", False, (16, 16, 64), plain | dot),
    ):  # fmt: skip
        constants = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), blocks, strict=True)) | {"HAS_BIAS": has_bias}
        constants |= {"LANES": blocks[2]} | more
        pointers = dict.fromkeys(("x", "weight", "bias", "out", "norm_weight", "norm_bias", "residual"), f"*{dtype}")
        pointers["eps"] = "fp32"
        signature = {name: pointers.get(name, "constexpr" if name in constants else "i32") for name in kernel.arg_names}
        source = compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants)
        if "cubin" not in compiler.compile(source, target=target, options={"num_warps": 4}).asm:
            msg = f"small_linear_kernel ({dtype}) compiled to no GPU binary"
            raise RuntimeError(msg)


# -- on a GPU: the compiled Triton kernel -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "in_features", "features"), [(1, 1280, 1280), (8, 1280, 5120), (1, 5120, 1280),
                                                                (5, 1280, 51866)])  # fmt: skip
def test_kernel_on_cuda_equals_a_float64_product(
    rows: int, in_features: int, features: int, dtype: torch.dtype
) -> None:
    """whisper-large-v3's shapes: attention projections, fc1, fc2 and the output projection."""
    x, weight, bias = inputs((rows, 1, in_features), features, dtype, features != 51866, "cuda")
    check_close(small_linear(x, weight, bias), x, weight, bias)


@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph() -> None:
    x, weight, bias = inputs((2, 1, 256), 512, torch.bfloat16, True, "cuda")
    out = small_linear(x, weight, bias)  # compiled and launched once before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = small_linear(x, weight, bias)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    check_close(out, x, weight, bias)


if __name__ == "__main__":
    compile_kernel()
