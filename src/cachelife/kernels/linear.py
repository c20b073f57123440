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


def small_linear_kernel(  # noqa: PLR0917 (a Triton kernel: every pointer, size and stride positionally)
    x: Pointer, weight: Pointer, bias: Pointer, out: Pointer,
    rows: Scalar, features: Scalar, inputs: Scalar,
    x_sm: Scalar, x_sk: Scalar, w_sn: Scalar, w_sk: Scalar, o_sm: Scalar, o_sn: Scalar,
    HAS_BIAS: constexpr, BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_K: constexpr,
) -> None:  # fmt: skip
    """In Triton's language: output features [program * BLOCK_N, + BLOCK_N) of every row."""
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_in = n < features
    m_in = m < rows
    # Products summed per lane across the tiles, and across the lanes once at the end.
    partial = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for start in range(0, inputs, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_in = k < inputs
        w = tl.load(weight + n[:, None] * w_sn + k[None, :] * w_sk, mask=n_in[:, None] & k_in[None, :], other=0.0)
        a = tl.load(x + m[:, None] * x_sm + k[None, :] * x_sk, mask=m_in[:, None] & k_in[None, :], other=0.0)
        partial += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    acc = tl.sum(partial, axis=2)
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=n_in, other=0.0).to(tl.float32)[None, :]
    target = out + m[:, None] * o_sm + n[None, :] * o_sn
    tl.store(target, acc.to(out.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


@functools.cache
def _jitted() -> Any:
    """The kernel, jitted on first use (after the process set TRITON_INTERPRET, if it does)."""
    return triton.jit(small_linear_kernel)


def plan_blocks(*, rows: int, features: int, inputs: int, programs: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for these static shapes: the widest block of output features (at most 64)
    that still gives `programs` programs, and as many input features per tile as fit `_TILE_ELEMENTS`."""
    block_m = power_of_two_at_least(rows)
    block_n = 64
    while block_n > 1 and math.ceil(features / block_n) < programs:
        block_n //= 2
    block_k = max(_TILE_ELEMENTS // (block_m * block_n), 16)
    return block_m, block_n, min(block_k, power_of_two_at_least(inputs))


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
    programs = _PROGRAMS_PER_SM * multiprocessors(x.device)
    block_m, block_n, block_k = plan_blocks(rows=rows, features=features, inputs=inputs, programs=programs)
    with launching_on(x.device):
        _jitted()[(math.ceil(features / block_n),)](
            flat, weight, weight if bias is None else bias, out, rows, features, inputs,
            *flat.stride(), *weight.stride(), *out.stride(),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **LAUNCH,
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
