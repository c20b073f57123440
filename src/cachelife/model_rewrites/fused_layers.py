"""Fused decoder layers: each pre-norm decoder layer of a family cachelife knows run through its few-row fused
products (`cachelife.kernels.layer_linear`), reversibly.

A pre-norm layer normalises its input before each block and adds the block's output to it after. `fuse_layers`
folds every norm into the products that read it and every residual add and activation into the product before
it, so that a decoding step runs a layer in its products, its attention and its cache writes:

- each norm module's output feeds only known projections (the self-attention's query, key and value, the
  cross-attention's query, the first MLP product): those projections are given a forward that normalises their
  input inside the product (`NormedProduct`; with fused projections, their group's product), and the layer
  passes them the un-normalised states;
- the attention modules' output projections are given a forward that returns their input (`PassThrough`), and
  the layer applies the projection with the residual add in one product; the MLP's products likewise, with the
  activation in the first.

The layer's `forward` becomes `FusedLayerForward`, which calls the layer's own attention modules (their cache
updates, masks and attention implementation are the model's) and runs the rest as the layer's class does, in
the same order and with the same roundings. Training (dropout), or inputs that need gradients, run the same
operations one by one in torch.

Families (`FAMILIES`): Whisper's decoder layer. A layer is left alone, with the reason in `skipped`, when a part
is not what the family's class holds (another module type, a forward of its own or hooks, an activation other
than erf GELU). `FusedLayers.restore()` puts every forward back; the parameters are never touched.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import torch
from attrs import define, field, frozen
from torch import nn

from cachelife.kernels.layer_linear import Activation, Norm, layer_linear, layer_linear_reference
from cachelife.model_rewrites.fused_projections import MemberForward, ProjectionGroup

logger = logging.getLogger(__name__)

FAMILIES: Final = frozenset({"WhisperDecoderLayer"})
"""Class names of the decoder layers `fuse_layers` rewrites: pre-norm layers with a self-attention, an optional
cross-attention and a two-product MLP, each block behind a `torch.nn.LayerNorm`."""


def _reference_wanted(*tensors: torch.Tensor | None) -> bool:
    """Whether the fused op cannot serve: gradients wanted (the op has none)."""
    return torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in tensors)


def fused_product(
    x: torch.Tensor,
    linear: nn.Linear,
    *,
    norm: nn.LayerNorm | None = None,
    activation: Activation = Activation.NONE,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`linear` of `x` (normalised by `norm` first), `activation`, plus `residual`: the fused op, or the same
    operations in torch where gradients are wanted."""
    return _product(x, linear.weight, linear.bias, norm=norm, activation=activation, residual=residual)


def _product(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    norm: nn.LayerNorm | None = None,
    activation: Activation = Activation.NONE,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    arguments: dict[str, Any] = {"activation": activation, "residual": residual}
    if norm is not None:
        arguments |= {"norm": Norm.LAYER, "norm_weight": norm.weight, "norm_bias": norm.bias, "eps": norm.eps}
    parameters = (weight, bias) if norm is None else (weight, bias, norm.weight, norm.bias)
    if _reference_wanted(x, residual, *parameters):
        return layer_linear_reference(x, weight, bias, **arguments)
    return layer_linear(x, weight, bias, **arguments)


@frozen
class NormedProduct:
    """A product that normalises its input by `norm` first (`torch.nn.functional.linear`'s signature)."""

    norm: nn.LayerNorm

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _product(x, weight, bias, norm=self.norm)


@frozen
class NormedLinearForward:
    """The forward of a projection that reads a norm's output: the norm inside its product."""

    linear: nn.Linear
    norm: nn.LayerNorm

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        return fused_product(input, self.linear, norm=self.norm)


@frozen
class PassThrough:
    """The forward of an output projection the layer applies itself: the input, unchanged."""

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        return input


@frozen(kw_only=True)
class LayerParts:
    """The modules of a Whisper-style decoder layer that `fuse_layers` reads or rewrites, as their types."""

    layer: nn.Module
    self_attn: nn.Module
    encoder_attn: nn.Module
    self_norm: nn.LayerNorm
    cross_norm: nn.LayerNorm
    final_norm: nn.LayerNorm
    self_projections: tuple[nn.Linear, nn.Linear, nn.Linear]  # query, key, value
    self_out: nn.Linear
    cross_query: nn.Linear
    cross_out: nn.Linear
    fc1: nn.Linear
    fc2: nn.Linear


@frozen
class FusedLayerForward:
    """A Whisper-style decoder layer's forward (its class's signature), with the norms, activation and residual
    adds in the layer's products. The un-normalised states go to the attention modules, whose normalising
    projections and pass-through output projections `fuse_layers` installed."""

    parts: LayerParts

    def __call__(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        parts = self.parts
        kwargs.pop("use_cache", None)
        attended = parts.self_attn(hidden_states, attention_mask=attention_mask, **kwargs)[0]
        hidden_states = self._add(parts.self_out, attended, hidden_states)
        if encoder_hidden_states is not None:
            attended = parts.encoder_attn(
                hidden_states, key_value_states=encoder_hidden_states, attention_mask=encoder_attention_mask, **kwargs
            )[0]
            hidden_states = self._add(parts.cross_out, attended, hidden_states)
        inner = fused_product(hidden_states, parts.fc1, norm=parts.final_norm, activation=Activation.GELU)
        layer = parts.layer
        inner = nn.functional.dropout(
            inner, p=float(getattr(layer, "activation_dropout", 0.0)), training=layer.training
        )
        return self._add(parts.fc2, inner, hidden_states)

    def _add(self, linear: nn.Linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + dropout(linear(x))`, in one product unless dropout is live."""
        layer = self.parts.layer
        dropout = float(getattr(layer, "dropout", 0.0))
        if layer.training and dropout > 0:
            return residual + nn.functional.dropout(fused_product(x, linear), p=dropout, training=True)
        return fused_product(x, linear, residual=residual)


@define(eq=False)
class FusedLayer:
    """One rewritten layer: the modules whose forward `fuse_layers` set (None: it set a group's product) and
    the projection groups whose product it set."""

    layer: nn.Module
    modules: tuple[nn.Module, ...]
    groups: tuple[ProjectionGroup, ...]

    def restore(self) -> None:
        for group in self.groups:
            group.product = nn.functional.linear
        for module in (self.layer, *self.modules):
            module.__dict__.pop("forward", None)


@define(eq=False)
class FusedLayers:
    """What `fuse_layers` did: the layers it rewrote, and why it left the others (path -> reason). `restore()`
    undoes it; a second call does nothing."""

    layers: tuple[FusedLayer, ...]
    skipped: dict[str, str]
    _restored: bool = field(default=False, alias="restored")

    @property
    def restored(self) -> bool:
        return self._restored

    def restore(self) -> None:
        if self._restored:
            return
        for layer in self.layers:
            layer.restore()
        self._restored = True
        logger.debug("fused layers: %d layer(s) restored", len(self.layers))


def _plain(module: object, kind: type[nn.Module]) -> bool:
    """Whether `module` is exactly a `kind` with the class's forward and no hooks."""
    return (
        type(module) is kind
        and isinstance(module, nn.Module)
        and "forward" not in module.__dict__
        and not module._forward_hooks
        and not module._forward_pre_hooks
    )


def _linear(module: nn.Module, name: str, *, fused_member: bool = False) -> nn.Linear | str:
    """`module`'s child `name` if it is a plain `nn.Linear` (or, with `fused_member`, one member of fused
    projections), else why not."""
    child = getattr(module, name, None)
    member = fused_member and isinstance(child, nn.Linear) and isinstance(child.__dict__.get("forward"), MemberForward)
    if isinstance(child, nn.Linear) and (_plain(child, nn.Linear) or member):
        return child
    return f"{name} is not a plain torch.nn.Linear"


def _norm(module: nn.Module, name: str) -> nn.LayerNorm | str:
    child = getattr(module, name, None)
    if isinstance(child, nn.LayerNorm) and _plain(child, nn.LayerNorm) and child.weight is not None:
        return child
    return f"{name} is not a plain torch.nn.LayerNorm with a weight"


def _attention(layer: nn.Module, name: str) -> nn.Module | str:
    child = getattr(layer, name, None)
    if isinstance(child, nn.Module) and not child._forward_hooks and not child._forward_pre_hooks:
        return child
    return f"{name} is missing or has forward hooks"


def layer_parts(layer: nn.Module) -> LayerParts | str:
    """`layer`'s parts if `fuse_layers` can rewrite it, else why not."""
    if type(layer).__name__ not in FAMILIES:
        return f"a {type(layer).__name__}, not one of {sorted(FAMILIES)}"
    if "forward" in layer.__dict__ or layer._forward_hooks or layer._forward_pre_hooks:
        return "the layer has a forward of its own or forward hooks"
    activation = getattr(layer, "activation_fn", None)
    if type(activation).__name__ != "GELUActivation" or getattr(activation, "act", None) is not nn.functional.gelu:
        return f"the activation is {type(activation).__name__}, not erf GELU"
    self_attn, encoder_attn = _attention(layer, "self_attn"), _attention(layer, "encoder_attn")
    if isinstance(self_attn, str) or isinstance(encoder_attn, str):
        return self_attn if isinstance(self_attn, str) else str(encoder_attn)
    found = {
        "self_norm": _norm(layer, "self_attn_layer_norm"),
        "cross_norm": _norm(layer, "encoder_attn_layer_norm"),
        "final_norm": _norm(layer, "final_layer_norm"),
        "query": _linear(self_attn, "q_proj", fused_member=True),
        "key": _linear(self_attn, "k_proj", fused_member=True),
        "value": _linear(self_attn, "v_proj", fused_member=True),
        "self_out": _linear(self_attn, "out_proj"),
        "cross_query": _linear(encoder_attn, "q_proj"),
        "cross_out": _linear(encoder_attn, "out_proj"),
        "fc1": _linear(layer, "fc1"),
        "fc2": _linear(layer, "fc2"),
    }
    problems = [value for value in found.values() if isinstance(value, str)]
    if problems:
        return problems[0]
    linears = {name: value for name, value in found.items() if isinstance(value, nn.Linear)}
    norms = {name: value for name, value in found.items() if isinstance(value, nn.LayerNorm)}
    return LayerParts(
        layer=layer, self_attn=self_attn, encoder_attn=encoder_attn,
        self_norm=norms["self_norm"], cross_norm=norms["cross_norm"], final_norm=norms["final_norm"],
        self_projections=(linears["query"], linears["key"], linears["value"]), self_out=linears["self_out"],
        cross_query=linears["cross_query"], cross_out=linears["cross_out"], fc1=linears["fc1"], fc2=linears["fc2"],
    )  # fmt: skip


def _normalise(projections: tuple[nn.Linear, ...], norm: nn.LayerNorm) -> tuple[list[nn.Module], list[ProjectionGroup]]:
    """Give `projections` the norm inside their products: their group's product where they are fused
    projections, else a forward each."""
    modules: list[nn.Module] = []
    groups: list[ProjectionGroup] = []
    for projection in projections:
        forward = projection.__dict__.get("forward")
        if isinstance(forward, MemberForward):
            if forward.group not in groups:
                forward.group.product = NormedProduct(norm)
                groups.append(forward.group)
        else:
            projection.__dict__["forward"] = NormedLinearForward(projection, norm)
            modules.append(projection)
    return modules, groups


def _rewrite(parts: LayerParts) -> FusedLayer:
    modules, groups = _normalise(parts.self_projections, parts.self_norm)
    more, _ = _normalise((parts.cross_query,), parts.cross_norm)
    for projection in (parts.self_out, parts.cross_out):
        projection.__dict__["forward"] = PassThrough()
    parts.layer.__dict__["forward"] = FusedLayerForward(parts)
    return FusedLayer(parts.layer, (*modules, *more, parts.self_out, parts.cross_out), tuple(groups))


def fuse_layers(model: nn.Module) -> FusedLayers:
    """Rewrite every decoder layer of `model` of a family in `FAMILIES` that can be (see the module docstring);
    returns what restores them."""
    done: list[FusedLayer] = []
    skipped: dict[str, str] = {}
    try:
        for path, module in model.named_modules():
            if type(module).__name__ not in FAMILIES:
                continue
            parts = layer_parts(module)
            if isinstance(parts, str):
                skipped[path] = parts
            else:
                done.append(_rewrite(parts))
    except BaseException:
        for layer in done:
            layer.restore()
        raise
    for path, reason in skipped.items():
        logger.debug("%s: not fused: %s", path, reason)
    logger.debug("fused layers: %d layer(s) rewritten", len(done))
    return FusedLayers(tuple(done), skipped)
