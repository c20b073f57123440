"""Layers compiled once: every layer of a stack of identical layers (a decoder's or an encoder's) marked as a
nested compile region (`torch.compiler.nested_compile_region`), reversibly.

`mark_layer_regions(model)` finds each `torch.nn.ModuleList` of two or more modules of one class and gives each of
those layers a `forward` attribute of its own: one region function per layer class, bound to the layer, which calls
what `forward` was before (the class's, or an instance attribute that was already there). torch.compile then
compiles the first layer's code and calls it again for every layer whose traced graph is the same (torch 2.11
compares the graphs; newer releases check guards), instead of compiling every layer's copy of it: the compile
time of a step falls with the number of layers. Outside torch.compile a region is a plain call.

torch does not let a region return one of its inputs (T5's blocks pass the position bias on), so an output that
is an input is returned as a copy. A region is traced once per layer class and set of input conditions; layers
whose graphs differ (T5's first block, which holds the relative position bias) get regions of their own.

`LayerRegions.restore()` puts every layer's `forward` back as it was. The model's classes are never changed.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any, Final

import torch
from attrs import define, field, frozen
from torch import nn

logger = logging.getLogger(__name__)

UNMARKED: Final = "_cachelife_unmarked_forward"
"""The attribute under which a marked layer keeps the `forward` its region calls."""


def _fresh(output: Any, given: list[torch.Tensor]) -> Any:
    """`output` with every tensor that is one of `given` replaced by a copy."""
    if isinstance(output, torch.Tensor):
        return output.clone() if any(output is tensor for tensor in given) else output
    if isinstance(output, tuple) and not hasattr(output, "_fields"):
        return tuple(_fresh(item, given) for item in output)
    return output


def _region_for(layer_class: type) -> Callable[..., Any]:
    """One region function per layer class, so that its layers share one compiled region."""

    def layer_region(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        output = getattr(layer, UNMARKED)(*args, **kwargs)
        given = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
        return _fresh(output, given)

    layer_region.__qualname__ = f"layer_region[{layer_class.__name__}]"
    region: Callable[..., Any] = torch.compiler.nested_compile_region(layer_region)
    return region


_REGIONS: dict[type, Callable[..., Any]] = {}


def _region(layer_class: type) -> Callable[..., Any]:
    if layer_class not in _REGIONS:
        _REGIONS[layer_class] = _region_for(layer_class)
    return _REGIONS[layer_class]


@frozen
class MarkedLayer:
    """One layer given a region `forward`, and the instance `forward` it had before (None: the class's)."""

    layer: nn.Module
    previous: Callable[..., Any] | None

    def restore(self) -> None:
        state = self.layer.__dict__
        state.pop(UNMARKED, None)
        if self.previous is None:
            state.pop("forward", None)
        else:
            state["forward"] = self.previous


def stacks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The model's stacks of identical layers: (path, ModuleList) for each list of two or more modules of one
    class, outermost first; a stack inside a layer of another stack is left out."""
    found: list[tuple[str, nn.ModuleList]] = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(layer) for layer in module}) != 1:
            continue
        if any(path.startswith(outer + ".") for outer, _ in found):
            continue
        found.append((path, module))
    return found


@define
class LayerRegions:
    """What `mark_layer_regions` did: the layers it marked (and the stacks' paths). `restore()` undoes it; a
    second call does nothing."""

    layers: tuple[MarkedLayer, ...]
    paths: tuple[str, ...]
    _restored: bool = field(default=False, alias="restored")

    @property
    def restored(self) -> bool:
        return self._restored

    def restore(self) -> None:
        if self._restored:
            return
        for marked in self.layers:
            marked.restore()
        self._restored = True
        logger.debug("layer regions: %d layer(s) restored", len(self.layers))


def mark_layer_regions(model: nn.Module) -> LayerRegions:
    """Mark every layer of the model's stacks of identical layers as a compile region (see the module docstring);
    returns what restores them."""
    marked: list[MarkedLayer] = []
    found = stacks(model)
    for _path, stack in found:
        for layer in stack:
            state = layer.__dict__
            previous = state.get("forward")
            state[UNMARKED] = layer.forward
            state["forward"] = types.MethodType(_region(type(layer)), layer)
            marked.append(MarkedLayer(layer, previous))
    paths = tuple(path for path, _ in found)
    logger.debug("layer regions: %d layer(s) marked in %s", len(marked), ", ".join(paths) or "no stack")
    return LayerRegions(tuple(marked), paths)
