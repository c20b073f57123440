"""A linear layer's product for a few rows (a decoding step's batch): one Triton program per block of output
features reads its rows of the weight once, for every input row.

At one to a few rows a matrix product is a matrix-vector product: its time is the weight's bytes over the
memory bandwidth, and cuBLAS's tiles for it leave much of that bandwidth unused on a GPU. `small_linear` cuts
the output features into blocks of `BLOCK_N` so that the programs cover the GPU, and each program walks the
input features in tiles, accumulating in float32 per lane and summing the lanes once at the end. The bias is
added before the one rounding to the output's dtype.

It runs the custom op `cachelife::small_linear`: Triton kernels on CUDA tensors, and on CPU tensors under
`TRITON_INTERPRET=1`; `torch.nn.functional.linear` everywhere else and for more than `MAX_ROWS` rows. Its fake
implementation lets dynamo trace it with `fullgraph=True`, and its launch depends on static shapes only, so it
captures in CUDA graphs. `SmallLinearProducts`, a torch function mode, sends a region's
`torch.nn.functional.linear` calls of the products it is faster at than cuBLAS (`taken`: one row, at most
`TAKEN_FEATURES` output features, measured on an H200 by `bench/linear.py`, in the repository's history) to it
(`nn.Linear` modules and fused projections call that function); cachelife's decoding steps run in it when a model
is enabled with `small_linear=True`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from cachelife.errors import InvalidArgumentError
from cachelife.kernels.triton_support import (
    DTYPES,
    LAUNCH,
    Pointer,
    Scalar,
    constexpr,
    launching_on,
    multiprocessors,
    power_of_two_at_least,
    tl,
    triton,
    triton_runs_on,
)

MAX_ROWS: Final = 16
"""Most input rows the kernel takes; more go to `torch.nn.functional.linear`."""
TAKEN_ROWS: Final = 1
TAKEN_FEATURES: Final = 2048
"""The products `SmallLinearProducts` sends to the kernel: at most `TAKEN_ROWS` rows and `TAKEN_FEATURES` output
features, those at which it ran faster than cuBLAS on an H200 (`bench/linear.py`, in the repository's history)."""
# Elements of a program's product tile (rows x output features x input features) held at once.
_TILE_ELEMENTS: Final = 4096
_PROGRAMS_PER_SM: Final = 2


def small_linear_kernel(  # noqa: PLR0912, PLR0915, PLR0917 (a Triton kernel: every pointer, size and stride positionally)
    x: Pointer, weight: Pointer, bias: Pointer, out: Pointer,
    norm_weight: Pointer, norm_bias: Pointer, residual: Pointer,
    rows: Scalar, features: Scalar, inputs: Scalar, eps: Scalar,
    x_sm: Scalar, x_sk: Scalar, w_sn: Scalar, w_sk: Scalar, o_sm: Scalar, o_sn: Scalar, r_sm: Scalar, r_sn: Scalar,
    HAS_BIAS: constexpr, BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_K: constexpr,
    NORM: constexpr = 0, NORM_BIAS: constexpr = False, ACTIVATION: constexpr = 0, HAS_RESIDUAL: constexpr = False,
    DOT: constexpr = False, LANES: constexpr = 1,
) -> None:  # fmt: skip
    """In Triton's language: output features [program * BLOCK_N, + BLOCK_N) of every row. Each tile's products
    are summed per lane (LANES = BLOCK_K) and the lanes once at the end, or, with DOT (16 rows and more), by
    `tl.dot` on the tensor cores (float32 inputs in IEEE precision, as the lanes sum them; LANES = 1).

    A layer's few-row product (`cachelife.kernels.layer_linear`) adds a prologue and an epilogue, each rounding
    where the separate operations round: NORM normalises the input rows first (1: layer norm with `norm_weight`
    and, if NORM_BIAS, `norm_bias`; 2: Llama's RMS norm), ACTIVATION applies one to the product (1: GELU, erf
    form) and HAS_RESIDUAL adds `residual` to it."""
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_in = n < features
    m_in = m < rows
    dtype = out.dtype.element_ty
    mean = tl.zeros([BLOCK_M], tl.float32)
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if NORM != 0:
        # Each program takes the rows' statistics over every input feature (the rows are a few KB): the mean
        # first (layer norm), then the mean square about it.
        if NORM == 1:
            total = tl.zeros([BLOCK_M], tl.float32)
            for start in range(0, inputs, BLOCK_K):
                k = start + tl.arange(0, BLOCK_K)
                live = m_in[:, None] & (k < inputs)[None, :]
                total += tl.sum(
                    tl.load(x + m[:, None] * x_sm + k[None, :] * x_sk, mask=live, other=0.0).to(tl.float32), axis=1
                )
            mean = total / inputs
        spread = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, inputs, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            live = m_in[:, None] & (k < inputs)[None, :]
            row = tl.load(x + m[:, None] * x_sm + k[None, :] * x_sk, mask=live, other=0.0).to(tl.float32)
            centred = tl.where(live, row - mean[:, None], 0.0)
            spread += tl.sum(centred * centred, axis=1)
        rstd = 1.0 / tl.sqrt(spread / inputs + eps)
    products = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    partial = tl.zeros([BLOCK_M, BLOCK_N, LANES], tl.float32)
    for start in range(0, inputs, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_in = k < inputs
        w = tl.load(weight + n[:, None] * w_sn + k[None, :] * w_sk, mask=n_in[:, None] & k_in[None, :], other=0.0)
        a = tl.load(x + m[:, None] * x_sm + k[None, :] * x_sk, mask=m_in[:, None] & k_in[None, :], other=0.0)
        a = a.to(tl.float32)
        if NORM != 0:
            scale = tl.load(norm_weight + k, mask=k_in, other=0.0).to(tl.float32)[None, :]
            if NORM == 1:
                a = (a - mean[:, None]) * rstd[:, None] * scale
                if NORM_BIAS:
                    a += tl.load(norm_bias + k, mask=k_in, other=0.0).to(tl.float32)[None, :]
            else:
                a = (a * rstd[:, None]).to(dtype).to(tl.float32) * scale
            a = a.to(dtype).to(tl.float32)
        if DOT:
            products = tl.dot(a.to(w.dtype), tl.trans(w), products, input_precision="ieee")
        else:
            partial += a[:, None, :] * w.to(tl.float32)[None, :, :]
    acc = products + tl.sum(partial, axis=2)
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=n_in, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION != 0 or HAS_RESIDUAL:
        acc = acc.to(dtype).to(tl.float32)
    if ACTIVATION == 1:
        acc = (0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))).to(dtype).to(tl.float32)
    live_out = m_in[:, None] & n_in[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(residual + m[:, None] * r_sm + n[None, :] * r_sn, mask=live_out, other=0.0).to(tl.float32)
    tl.store(out + m[:, None] * o_sm + n[None, :] * o_sn, acc.to(dtype), mask=live_out)


@functools.cache
def small_linear_launcher() -> Any:
    """The kernel, jitted on first use (after the process set TRITON_INTERPRET, if it does)."""
    return triton.jit(small_linear_kernel)


DOT_ROWS: Final = 9
"""Rows from which a product runs on the tensor cores (`tl.dot`, whose tiles take 16 rows), in tiles of
`_DOT_FEATURES` output and `_DOT_INPUTS` input features."""
_DOT_FEATURES: Final = 16
_DOT_INPUTS: Final = 128


def plan_blocks(*, rows: int, features: int, inputs: int, programs: int, dot: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for these static shapes: on the tensor cores (`dot`), `tl.dot`'s tiles; else
    the widest block of output features (at most 64) that still gives `programs` programs, and as many input
    features per tile as fit `_TILE_ELEMENTS`."""
    block_m = power_of_two_at_least(rows)
    if dot:
        return max(block_m, 16), _DOT_FEATURES, min(_DOT_INPUTS, max(power_of_two_at_least(inputs), 16))
    block_n = 64
    while block_n > 1 and math.ceil(features / block_n) < programs:
        block_n //= 2
    block_k = max(_TILE_ELEMENTS // (block_m * block_n), 16)
    return block_m, block_n, min(block_k, power_of_two_at_least(inputs))


def launch_plan(
    *, rows: int, features: int, inputs: int, dtype: torch.dtype, device: torch.device
) -> tuple[dict[str, Any], int]:
    """The kernel's block constants (BLOCK_M, BLOCK_N, BLOCK_K, DOT, LANES) and its programs for these static
    shapes on `device`: the tensor cores from `DOT_ROWS` rows on. Triton's interpreter (the CPU) computes a
    16-bit `tl.dot` wrongly: there only float32 products take them."""
    dot = rows >= DOT_ROWS and (device.type == "cuda" or dtype == torch.float32)
    wanted = _PROGRAMS_PER_SM * multiprocessors(device)
    block_m, block_n, block_k = plan_blocks(rows=rows, features=features, inputs=inputs, programs=wanted, dot=dot)
    blocks = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "DOT": dot, "LANES": 1 if dot else block_k}
    return blocks, math.ceil(features / block_n)


def input_problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """What keeps these inputs from a linear product ("" when nothing does)."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        got = f"{tuple(x.shape)}, {tuple(weight.shape)}"
        return f"an input (..., in_features) and a weight (out_features, in_features), got {got}"
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        return f"a bias (out_features,) = ({weight.shape[0]},), got {tuple(bias.shape)}"
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if x.dtype not in DTYPES or any(tensor.dtype != x.dtype for tensor in tensors):
        return f"input, weight and bias all of one dtype of {DTYPES}, got {[t.dtype for t in tensors]}"
    if any(tensor.device != x.device for tensor in tensors):
        return f"input, weight and bias on one device, got {[str(t.device) for t in tensors]}"
    return ""


def _triton_small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows, inputs, features = math.prod(x.shape[:-1]), x.shape[-1], weight.shape[0]
    flat = x.reshape(rows, inputs)
    out = torch.empty((rows, features), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out.reshape(*x.shape[:-1], features)
    if inputs == 0:
        return (out.zero_() if bias is None else out.copy_(bias.expand_as(out))).reshape(*x.shape[:-1], features)
    blocks, programs = launch_plan(rows=rows, features=features, inputs=inputs, dtype=x.dtype, device=x.device)
    with launching_on(x.device):
        small_linear_launcher()[(programs,)](
            flat, weight, weight if bias is None else bias, out, weight, weight, weight, rows, features, inputs, 0.0,
            *flat.stride(), *weight.stride(), *out.stride(), 0, 0, HAS_BIAS=bias is not None, **blocks, **LAUNCH,
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], features)


@torch.library.custom_op("cachelife::small_linear", mutates_args=())
def _small_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = math.prod(x.shape[:-1])
    if rows <= MAX_ROWS and triton_runs_on(x.device):
        return _triton_small_linear(x, weight, bias)
    return F.linear(x, weight, bias)


@_small_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear(x, weight, bias)`, through the kernel for at most `MAX_ROWS` rows (the
    product of `x`'s leading dimensions); float32 accumulation. Raises `InvalidArgumentError` for inputs that
    are not a linear product's."""
    if problem := input_problem(x, weight, bias):
        msg = f"small_linear expects {problem}"
        raise InvalidArgumentError(msg)
    output: torch.Tensor = _small_linear_op(x, weight, bias)
    return output


def taken(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `SmallLinearProducts` sends this product to the kernel (`TAKEN_ROWS`, `TAKEN_FEATURES`)."""
    return math.prod(x.shape[:-1]) <= TAKEN_ROWS and weight.dim() == 2 and weight.shape[0] <= TAKEN_FEATURES


class SmallLinearProducts(TorchFunctionMode):
    """Within it, `torch.nn.functional.linear` products that are `taken` (one row, the product of the input's
    leading dimensions, and few output features) of a dtype the kernel takes run `small_linear`; every other call
    runs as it would. dynamo traces the mode, so a compiled region entered within it holds the custom op in place
    of those products."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if taken(x, weight) and not input_problem(x, weight, bias):
                return _small_linear_op(x, weight, bias)
        return func(*args, **kwargs)


def through_small_linear(function: Callable[..., None]) -> Callable[..., None]:
    """`function`, run within `SmallLinearProducts`."""

    def run(**arguments: Any) -> None:
        with SmallLinearProducts():
            function(**arguments)

    return run
