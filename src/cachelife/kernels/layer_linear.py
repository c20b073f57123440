"""A decoder layer's linear product for a few rows with what surrounds it in the layer, in one kernel: the norm
that feeds the product (prologue), and the activation or the residual add that follows it (epilogue).

A decoding step runs a handful of rows through each layer, so each of the layer's operations is a kernel that
moves a few kilobytes of activations and waits for the one before it: the norms, the activation and the residual
adds cost the step as much as the products' weights. `layer_linear` runs `cachelife.kernels.linear`'s few-row
kernel with them folded in: every program takes its input rows' norm statistics itself (the rows are a few KB),
normalises each tile it reads, and applies the activation and the residual to its block of output features.

Each fused operation rounds where the separate operations round (the normalised input, the product with its
bias, the activation, each to the input's dtype), so that a bfloat16 step sums what the unfused step sums, in
another order only within the product and the norm's statistics.

It runs the custom op `cachelife::layer_linear`: Triton on CUDA tensors, and on CPU tensors under
`TRITON_INTERPRET=1`, for at most `MAX_ROWS` rows; the same operations in torch (the layer's own) everywhere
else. Its fake implementation lets dynamo trace it with `fullgraph=True`, and its launch depends on static
shapes only, so it captures in CUDA graphs.
"""

from __future__ import annotations

import enum
import math
from typing import Final, NamedTuple

import torch
import torch.nn.functional as F

from cachelife.errors import InvalidArgumentError
from cachelife.kernels.linear import MAX_ROWS, input_problem, launch_plan, small_linear_launcher
from cachelife.kernels.triton_support import LAUNCH, launching_on, triton_runs_on


class Norm(enum.IntEnum):
    """The norm before the product: none, `torch.nn.LayerNorm`'s, or Llama's RMS norm (the normalised input
    rounded to its dtype before the weight scales it)."""

    NONE = 0
    LAYER = 1
    RMS = 2


class Activation(enum.IntEnum):
    """The activation after the product: none, or GELU in its erf form (`torch.nn.functional.gelu`)."""

    NONE = 0
    GELU = 1


class Fusion(NamedTuple):
    """What `layer_linear` folds around a product: the norm before it (its weight, bias and eps), the activation
    after it, and the residual added last. `PLAIN`: nothing."""

    norm: Norm = Norm.NONE
    norm_weight: torch.Tensor | None = None
    norm_bias: torch.Tensor | None = None
    eps: float = 1e-5
    activation: Activation = Activation.NONE
    residual: torch.Tensor | None = None


PLAIN: Final = Fusion()


def layer_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fusion: Fusion = PLAIN
) -> torch.Tensor:
    """The operations `layer_linear` fuses, one after another, as the layers write them."""
    if fusion.norm is Norm.LAYER:
        x = F.layer_norm(x, (x.shape[-1],), fusion.norm_weight, fusion.norm_bias, fusion.eps)
    elif fusion.norm is Norm.RMS and fusion.norm_weight is not None:
        wide = x.to(torch.float32)
        normed = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + fusion.eps)).to(x.dtype)
        x = fusion.norm_weight * normed
    y = F.linear(x, weight, bias)
    if fusion.activation is Activation.GELU:
        y = F.gelu(y)
    return y if fusion.residual is None else fusion.residual + y


def _triton_layer_linear(  # noqa: PLR0917 (the op's arguments, as the op takes them)
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    norm: int,
    eps: float,
    activation: int,
) -> torch.Tensor:
    rows, inputs, features = math.prod(x.shape[:-1]), x.shape[-1], weight.shape[0]
    flat = x.reshape(rows, inputs)
    out = torch.empty((rows, features), dtype=x.dtype, device=x.device)
    added = None if residual is None else residual.reshape(rows, features)
    blocks, programs = launch_plan(rows=rows, features=features, inputs=inputs, dtype=x.dtype, device=x.device)
    with launching_on(x.device):
        small_linear_launcher()[(programs,)](
            flat, weight, weight if bias is None else bias, out,
            weight if norm_weight is None else norm_weight, weight if norm_bias is None else norm_bias,
            out if added is None else added,
            rows, features, inputs, eps,
            *flat.stride(), *weight.stride(), *out.stride(), *(out if added is None else added).stride(),
            HAS_BIAS=bias is not None, **blocks,
            NORM=norm, NORM_BIAS=norm_bias is not None, ACTIVATION=activation, HAS_RESIDUAL=added is not None,
            **LAUNCH,
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], features)


@torch.library.custom_op("cachelife::layer_linear", mutates_args=())
def _layer_linear_op(  # noqa: PLR0917 (a custom op's schema: positional tensors, then numbers)
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    norm: int,
    eps: float,
    activation: int,
) -> torch.Tensor:
    rows = math.prod(x.shape[:-1])
    if 0 < rows <= MAX_ROWS and x.shape[-1] > 0 and triton_runs_on(x.device):
        return _triton_layer_linear(x, weight, bias, norm_weight, norm_bias, residual, norm, eps, activation)
    fusion = Fusion(Norm(norm), norm_weight, norm_bias, eps, Activation(activation), residual)
    return layer_linear_reference(x, weight, bias, fusion)


@_layer_linear_op.register_fake
def _(  # noqa: PLR0917 (the op's schema)
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    norm: int,
    eps: float,
    activation: int,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _norm_problem(x: torch.Tensor, norm: Norm, norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None) -> str:
    """What keeps the norm's parameters from normalising `x`'s rows ("" when nothing does)."""
    if norm is Norm.NONE:
        return "" if norm_weight is None and norm_bias is None else "no norm parameters without a norm"
    if norm_weight is None:
        return f"a norm weight for {norm.name}"
    if norm is Norm.RMS and norm_bias is not None:
        return "no norm bias for RMS"
    for name, tensor in (("norm weight", norm_weight), ("norm bias", norm_bias)):
        if tensor is not None and (
            tensor.shape != x.shape[-1:] or (tensor.dtype, tensor.device) != (x.dtype, x.device)
        ):
            got = f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}"
            return f"a {name} ({x.shape[-1]},) of the input's dtype and device, got {got}"
    return ""


def _residual_problem(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> str:
    """What keeps `residual` from being added to the product ("" when nothing does)."""
    expected = (*x.shape[:-1], weight.shape[0])
    if residual is None or (residual.shape, residual.dtype, residual.device) == (expected, x.dtype, x.device):
        return ""
    got = f"{tuple(residual.shape)} {residual.dtype} on {residual.device}"
    return f"a residual {expected} of the input's dtype and device, got {got}"


def layer_linear_problem(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, fusion: Fusion = PLAIN
) -> str:
    """What keeps these inputs from `layer_linear` ("" when nothing does): what it would raise for."""
    problem = input_problem(x, weight, bias) or _norm_problem(x, fusion.norm, fusion.norm_weight, fusion.norm_bias)
    return problem or _residual_problem(x, weight, fusion.residual)


def layer_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, fusion: Fusion = PLAIN
) -> torch.Tensor:
    """`layer_linear_reference`'s operations in one kernel for at most `MAX_ROWS` rows (the product of `x`'s
    leading dimensions): `fusion`'s norm of `x`, the product with `weight` and `bias`, its activation, then its
    residual added. Raises `InvalidArgumentError` for inputs that do not fit together."""
    if problem := layer_linear_problem(x, weight, bias, fusion):
        msg = f"layer_linear expects {problem}"
        raise InvalidArgumentError(msg)
    norm, norm_weight, norm_bias, eps, activation, residual = fusion
    output: torch.Tensor = _layer_linear_op(
        x, weight, bias, norm_weight, norm_bias, residual, int(norm), float(eps), int(activation)
    )
    return output
