"""Fused decoder layers: each pre-norm decoder layer of a family cachelife knows run through its one-row fused
products (`cachelife.kernels.layer_linear`), reversibly.

A pre-norm layer normalises its input before each block and adds the block's output to it after. `fuse_layers`
folds every norm into the products that read it and every residual add (and Whisper's activation) into the
product before it, so that a decoding step runs a layer in its products, its attention and its cache writes:

- each norm module's output feeds only known projections (the self-attention's query, key and value; Whisper's
  cross-attention query and first MLP product; Llama's gate and up products): those projections are given a
  forward that normalises their input inside the product (`NormedLinearForward`; with fused projections, their
  group's product), and the layer passes them the un-normalised states;
- the attention's output projection and the MLP's last product are given a forward that returns their input
  (`PassThrough`), and the layer applies each with the residual add in one product.

The layer's `forward` becomes `WhisperLayerForward` or `LlamaLayerForward`, which call the layer's own attention
modules (their cache updates, masks, rotary embeddings and attention implementation are the model's) and Llama's
own MLP forward (its activation of the gate times the up product), and run the rest as the layer's class does,
in the same order and with the same roundings. Training (dropout), inputs that need gradients, and inputs the
op does not take (a norm kept in another dtype) run the same operations in torch.

Families (`FAMILIES`): Whisper's and Llama's decoder layers. A layer is left alone, with the reason in
`skipped`, when a part is not what the family's class holds (another module type, a forward of its own or
hooks, an activation other than Whisper's erf GELU). `FusedLayers.restore()` puts every forward and group
product back; the parameters are never touched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

import torch
from attrs import define, field, frozen
from torch import nn

from cachelife.kernels.layer_linear import Activation, Norm
from cachelife.model_rewrites.fused_projections import MemberForward, ProjectionGroup
from cachelife.model_rewrites.layer_products import (
    RMS_NORMS,
    NormedLinearForward,
    NormedProduct,
    NormModule,
    PassThrough,
    linear_product,
    product,
)

logger = logging.getLogger(__name__)


def _dropped(linear: nn.Linear, x: torch.Tensor, residual: torch.Tensor, layer: nn.Module, name: str) -> torch.Tensor:
    """`residual + dropout(linear(x))` with the layer's dropout `name`: in one product unless dropout is live."""
    dropout = float(getattr(layer, name, 0.0))
    if layer.training and dropout > 0:
        return residual + nn.functional.dropout(linear_product(x, linear), p=dropout, training=True)
    return linear_product(x, linear, residual=residual)


@frozen(kw_only=True)
class WhisperParts:
    """The modules of a Whisper decoder layer that `fuse_layers` reads or rewrites, as their types."""

    layer: nn.Module
    self_attn: nn.Module
    encoder_attn: nn.Module
    self_norm: NormModule
    cross_norm: NormModule
    final_norm: NormModule
    self_projections: tuple[nn.Linear, nn.Linear, nn.Linear]  # query, key, value
    self_out: nn.Linear
    cross_query: nn.Linear
    cross_out: nn.Linear
    fc1: nn.Linear
    fc2: nn.Linear

    def normalised(self) -> tuple[tuple[tuple[nn.Linear, ...], NormModule], ...]:
        return ((self.self_projections, self.self_norm), ((self.cross_query,), self.cross_norm))

    def passed_through(self) -> tuple[nn.Linear, ...]:
        return (self.self_out, self.cross_out)


@frozen
class WhisperLayerForward:
    """A Whisper decoder layer's forward (its class's signature), with the norms, activation and residual adds in
    the layer's products. The un-normalised states go to the attention modules, whose normalising projections
    and pass-through output projections `fuse_layers` installed."""

    parts: WhisperParts

    def __call__(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        parts, layer = self.parts, self.parts.layer
        kwargs.pop("use_cache", None)
        attended = parts.self_attn(hidden_states, attention_mask=attention_mask, **kwargs)[0]
        hidden_states = _dropped(parts.self_out, attended, hidden_states, layer, "dropout")
        if encoder_hidden_states is not None:
            attended = parts.encoder_attn(
                hidden_states, key_value_states=encoder_hidden_states, attention_mask=encoder_attention_mask, **kwargs
            )[0]
            hidden_states = _dropped(parts.cross_out, attended, hidden_states, layer, "dropout")
        fc1 = parts.fc1
        inner = product(hidden_states, fc1.weight, fc1.bias, norm=parts.final_norm, activation=Activation.GELU)
        inner = nn.functional.dropout(
            inner, p=float(getattr(layer, "activation_dropout", 0.0)), training=layer.training
        )
        return _dropped(parts.fc2, inner, hidden_states, layer, "dropout")


@frozen(kw_only=True)
class LlamaParts:
    """The modules of a Llama decoder layer that `fuse_layers` reads or rewrites, as their types."""

    layer: nn.Module
    self_attn: nn.Module
    mlp: nn.Module
    input_norm: NormModule
    post_norm: NormModule
    self_projections: tuple[nn.Linear, nn.Linear, nn.Linear]  # query, key, value
    self_out: nn.Linear
    gate_up: tuple[nn.Linear, nn.Linear]
    down: nn.Linear

    def normalised(self) -> tuple[tuple[tuple[nn.Linear, ...], NormModule], ...]:
        return ((self.self_projections, self.input_norm), (self.gate_up, self.post_norm))

    def passed_through(self) -> tuple[nn.Linear, ...]:
        return (self.self_out, self.down)


@frozen
class LlamaLayerForward:
    """A Llama decoder layer's forward (its class's keyword arguments): the norms inside the query, key, value,
    gate and up products, the residual adds in the output and down products. The MLP's own forward computes
    the activation of the gate times the up product; its down projection passes that through."""

    parts: LlamaParts

    def __call__(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        parts = self.parts
        attended = parts.self_attn(hidden_states=hidden_states, **kwargs)[0]
        hidden_states = linear_product(attended, parts.self_out, residual=hidden_states)
        return linear_product(parts.mlp(hidden_states), parts.down, residual=hidden_states)


Parts = WhisperParts | LlamaParts


@define(eq=False)
class FusedLayer:
    """One rewritten layer: the modules whose forward `fuse_layers` set and the projection groups whose product
    it set."""

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


def _plain(module: object, kind: type[nn.Module] | None = None) -> bool:
    """Whether `module` is a module with its class's forward and no hooks (and exactly a `kind`, if given)."""
    return (
        isinstance(module, nn.Module)
        and (kind is None or type(module) is kind)
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


def _norm(module: nn.Module, name: str) -> NormModule | str:
    """`module`'s child `name` as a norm the products can fold in, else why not."""
    child = getattr(module, name, None)
    if not isinstance(child, nn.Module):
        return f"{name} is missing"
    if isinstance(child, nn.LayerNorm) and _plain(child, nn.LayerNorm) and len(child.normalized_shape) == 1:
        return NormModule(child, Norm.LAYER)  # with a weight, if any: `layer_linear` refuses one without
    weight, eps = getattr(child, "weight", None), getattr(child, "variance_epsilon", None)
    known = type(child).__name__ in RMS_NORMS and _plain(child) and isinstance(eps, float)
    if known and isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return NormModule(child, Norm.RMS)
    return f"{name} is not a plain torch.nn.LayerNorm with a weight, nor one of {sorted(RMS_NORMS)}"


def _child(layer: nn.Module, name: str) -> nn.Module | str:
    child = getattr(layer, name, None)
    if isinstance(child, nn.Module) and not child._forward_hooks and not child._forward_pre_hooks:
        return child
    return f"{name} is missing or has forward hooks"


def _first_problem(found: Mapping[str, object]) -> str | None:
    problems = [value for value in found.values() if isinstance(value, str)]
    return problems[0] if problems else None


def _whisper_parts(layer: nn.Module) -> WhisperParts | str:
    activation = getattr(layer, "activation_fn", None)
    if type(activation).__name__ != "GELUActivation" or getattr(activation, "act", None) is not nn.functional.gelu:
        return f"the activation is {type(activation).__name__}, not erf GELU"
    self_attn, encoder_attn = _child(layer, "self_attn"), _child(layer, "encoder_attn")
    if isinstance(self_attn, str) or isinstance(encoder_attn, str):
        return self_attn if isinstance(self_attn, str) else str(encoder_attn)
    norms = {
        name: _norm(layer, name) for name in ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")
    }
    linears = {
        "query": _linear(self_attn, "q_proj", fused_member=True),
        "key": _linear(self_attn, "k_proj", fused_member=True),
        "value": _linear(self_attn, "v_proj", fused_member=True),
        "self_out": _linear(self_attn, "out_proj"),
        "cross_query": _linear(encoder_attn, "q_proj"),
        "cross_out": _linear(encoder_attn, "out_proj"),
        "fc1": _linear(layer, "fc1"),
        "fc2": _linear(layer, "fc2"),
    }
    if problem := _first_problem(norms) or _first_problem(linears):
        return problem
    n = {name: value for name, value in norms.items() if isinstance(value, NormModule)}
    p = {name: value for name, value in linears.items() if isinstance(value, nn.Linear)}
    if n["self_attn_layer_norm"].kind is not Norm.LAYER:
        return "the norms are not torch.nn.LayerNorm"
    return WhisperParts(
        layer=layer, self_attn=self_attn, encoder_attn=encoder_attn, self_norm=n["self_attn_layer_norm"],
        cross_norm=n["encoder_attn_layer_norm"], final_norm=n["final_layer_norm"],
        self_projections=(p["query"], p["key"], p["value"]), self_out=p["self_out"], cross_query=p["cross_query"],
        cross_out=p["cross_out"], fc1=p["fc1"], fc2=p["fc2"],
    )  # fmt: skip


def _llama_parts(layer: nn.Module) -> LlamaParts | str:
    self_attn, mlp = _child(layer, "self_attn"), _child(layer, "mlp")
    if isinstance(self_attn, str) or isinstance(mlp, str):
        return self_attn if isinstance(self_attn, str) else str(mlp)
    if type(mlp).__name__ != "LlamaMLP" or not _plain(mlp):
        return f"the MLP is a {type(mlp).__name__} with a forward of its own, not a plain LlamaMLP"
    norms = {name: _norm(layer, name) for name in ("input_layernorm", "post_attention_layernorm")}
    linears = {
        name: _linear(module, name, fused_member=name not in {"o_proj", "down_proj"})
        for module, names in (
            (self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
            (mlp, ("gate_proj", "up_proj", "down_proj")),
        )
        for name in names
    }
    if problem := _first_problem(norms) or _first_problem(linears):
        return problem
    n = {name: value for name, value in norms.items() if isinstance(value, NormModule)}
    p = {name: value for name, value in linears.items() if isinstance(value, nn.Linear)}
    return LlamaParts(
        layer=layer, self_attn=self_attn, mlp=mlp, input_norm=n["input_layernorm"],
        post_norm=n["post_attention_layernorm"], self_projections=(p["q_proj"], p["k_proj"], p["v_proj"]),
        self_out=p["o_proj"], gate_up=(p["gate_proj"], p["up_proj"]), down=p["down_proj"],
    )  # fmt: skip


FAMILIES: Final[Mapping[str, Callable[[nn.Module], Parts | str]]] = {
    "WhisperDecoderLayer": _whisper_parts,
    "LlamaDecoderLayer": _llama_parts,
}
"""The decoder layers `fuse_layers` rewrites, by class name, and how each finds its parts: pre-norm layers whose
norms feed known projections only."""


def layer_parts(layer: nn.Module) -> Parts | str:
    """`layer`'s parts if `fuse_layers` can rewrite it, else why not."""
    parts_of = FAMILIES.get(type(layer).__name__)
    if parts_of is None:
        return f"a {type(layer).__name__}, not one of {sorted(FAMILIES)}"
    if "forward" in layer.__dict__ or layer._forward_hooks or layer._forward_pre_hooks:
        return "the layer has a forward of its own or forward hooks"
    return parts_of(layer)


def _normalise(projections: tuple[nn.Linear, ...], norm: NormModule) -> tuple[list[nn.Module], list[ProjectionGroup]]:
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


def _rewrite(parts: Parts) -> FusedLayer:
    modules: list[nn.Module] = []
    groups: list[ProjectionGroup] = []
    for projections, norm in parts.normalised():
        more, more_groups = _normalise(projections, norm)
        modules += more
        groups += more_groups
    for projection in parts.passed_through():
        projection.__dict__["forward"] = PassThrough()
    forward = WhisperLayerForward(parts) if isinstance(parts, WhisperParts) else LlamaLayerForward(parts)
    parts.layer.__dict__["forward"] = forward
    return FusedLayer(parts.layer, (*modules, *parts.passed_through()), tuple(groups))


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
