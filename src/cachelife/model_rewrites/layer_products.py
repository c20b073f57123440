"""The products of a fused decoder layer (`cachelife.model_rewrites.fused_layers`): a norm module the products
fold in (`NormModule`), the product that takes the fused op (`cachelife.kernels.layer_linear`) for one row and the
layer's own operations otherwise (`product`), and the forwards `fuse_layers` gives a layer's projections: the norm
inside the product (`NormedLinearForward`, and `NormedProduct` for a fused projection group) or the input passed
through to the layer, which applies the projection with its residual (`PassThrough`)."""

from __future__ import annotations

import math
from typing import Any, Final

import torch
from attrs import frozen
from torch import nn

from cachelife.kernels.layer_linear import (
    Activation,
    Fusion,
    Norm,
    layer_linear,
    layer_linear_problem,
    layer_linear_reference,
)

RMS_NORMS: Final = frozenset({"LlamaRMSNorm"})
"""Class names of RMS norms that compute Llama's: the normalised input rounded to its dtype, then scaled."""


@frozen
class NormModule:
    """A norm module the products fold in, and which norm it computes. Its parameters are read at each call."""

    module: nn.Module
    kind: Norm

    def fusion(self, activation: Activation, residual: torch.Tensor | None) -> Fusion:
        """`layer_linear`'s fusion of this norm (its parameters as they are now), `activation` and `residual`."""
        module = self.module
        if isinstance(module, nn.LayerNorm):
            return Fusion(Norm.LAYER, module.weight, module.bias, module.eps, activation, residual)
        weight: Any = module.weight  # one of `RMS_NORMS`, which `fuse_layers` checked for these
        eps: Any = module.variance_epsilon
        return Fusion(Norm.RMS, weight, None, eps, activation, residual)


FUSED_ROWS: Final = 1
"""The most rows a layer's product takes the fused op for: one row (batch-1 decoding). From a few rows on the op
is slower on the GPU than the matrix-product library that the layer's own operations call (`bench.layer_linear`
measures both), so more rows take those."""


def _reference_wanted(*tensors: torch.Tensor | None) -> bool:
    """Whether the fused op cannot serve: gradients wanted (the op has none)."""
    return torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in tensors)


def product(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    norm: NormModule | None = None,
    activation: Activation = Activation.NONE,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The product of `x` (normalised by `norm` first) with `weight` and `bias`, `activation`, plus `residual`:
    the fused op for at most `FUSED_ROWS` rows; the same operations in torch for more, where gradients are
    wanted, or where the op does not take the inputs (a norm kept in another dtype than the states, say)."""
    fusion = Fusion(activation=activation, residual=residual) if norm is None else norm.fusion(activation, residual)
    tensors = (x, weight, bias, fusion.norm_weight, fusion.norm_bias, residual)
    # Many rows (a prompt, a full engine) take the layer's own operations, which a compiled region fuses as the
    # model's.
    many = math.prod(x.shape[:-1]) > FUSED_ROWS
    if many or _reference_wanted(*tensors) or layer_linear_problem(x, weight, bias, fusion):
        return layer_linear_reference(x, weight, bias, fusion)
    return layer_linear(x, weight, bias, fusion)


def linear_product(
    x: torch.Tensor,
    linear: nn.Linear,
    *,
    activation: Activation = Activation.NONE,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`product` with `linear`'s parameters."""
    return product(x, linear.weight, linear.bias, activation=activation, residual=residual)


@frozen
class NormedProduct:
    """A product that normalises its input first (`torch.nn.functional.linear`'s signature)."""

    norm: NormModule

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return product(x, weight, bias, norm=self.norm)


@frozen
class NormedLinearForward:
    """The forward of a projection that reads a norm's output: the norm inside its product."""

    linear: nn.Linear
    norm: NormModule

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        return product(input, self.linear.weight, self.linear.bias, norm=self.norm)


@frozen
class PassThrough:
    """The forward of an output projection the layer applies itself: the input, unchanged."""

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        return input
