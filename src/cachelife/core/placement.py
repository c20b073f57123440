"""Where a model's cache layers live: one device per decoder layer, and the tensor-parallel degree.

transformers allocates a lazily initialised cache layer on the device of the key states that first reach it,
which is where that decoder layer's attention projections run. cachelife pins ahead of that first update, so
it names the same device itself: `model.device` for a model on one device, and each decoder layer's own
device for a model whose layers are spread over several (`from_pretrained(..., device_map={...})`).
A cross-attention cache layer lives with the decoder layer that reads it.

Under tensor parallelism each rank is one process on one device, so `model.device` applies; its share of
the heads is a matter of shapes (`cachelife.core.shapes`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import PreTrainedModel

from cachelife.errors import UnsupportedCacheError

# Attribute names under which decoders keep their layer list: BART, Whisper, Llama (`layers`), T5 (`block`).
_LAYER_LIST_NAMES = ("layers", "block", "h", "layer")


def resolve_device(device: torch.device | str) -> torch.device:
    """The device tensors allocated on `device` report: `cuda` becomes `cuda:<current index>`."""
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return resolved


def is_spread_over_devices(model: object) -> bool:
    """Whether the model was loaded over several devices (`hf_device_map` names more than one)."""
    device_map = getattr(model, "hf_device_map", None)
    return isinstance(device_map, Mapping) and len({str(device) for device in device_map.values()}) > 1


def decoder_layer_devices(model: PreTrainedModel, layers: int) -> tuple[torch.device, ...]:
    """The device of each of the model's `layers` decoder layers, by layer index.

    A model on one device gives `model.device` for every layer. A model spread over devices gives the
    device of each decoder layer's weights; a decoder layer whose weights are offloaded (on the meta
    device) or split over several devices is refused with `UnsupportedCacheError`.
    """
    if not is_spread_over_devices(model):
        return (resolve_device(model.device),) * layers
    found = decoder_layer_list(model, layers)
    return tuple(_layer_device(model, index, layer) for index, layer in enumerate(found))


def cache_layer_devices(model: PreTrainedModel, self_layers: int, cross_layers: int) -> list[torch.device]:
    """One device per cache layer in `CacheLifecycle.layers` order: self-attention layers, then
    cross-attention layers, layer i of either on decoder layer i's device."""
    per_layer = decoder_layer_devices(model, max(self_layers, cross_layers))
    return [*per_layer[:self_layers], *per_layer[:cross_layers]]


def decoder_layer_list(model: PreTrainedModel, layers: int) -> torch.nn.ModuleList:
    """The decoder's list of `layers` layers: `get_decoder().layers` (BART, Whisper, Llama), `.block` (T5),
    or else the outermost list of that length inside the decoder."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    root = decoder if isinstance(decoder, torch.nn.Module) else model
    for owner in (root, getattr(root, "model", None)):
        for name in _LAYER_LIST_NAMES:
            candidate = getattr(owner, name, None)
            if isinstance(candidate, torch.nn.ModuleList) and len(candidate) == layers:
                return candidate
    for _, module in root.named_modules():  # outermost first, so a layer's own sub-lists come later
        if isinstance(module, torch.nn.ModuleList) and len(module) == layers:
            return module
    msg = (
        f"cannot find the {layers} decoder layers of {type(model).__name__} (looked for a ModuleList of that "
        f"length under {type(root).__name__}), so cachelife cannot tell which device each cache layer "
        "belongs on; load the model on one device, or declare the shapes and pin the cache yourself"
    )
    raise UnsupportedCacheError(msg)


def _layer_device(model: PreTrainedModel, index: int, layer: torch.nn.Module) -> torch.device:
    devices = sorted({str(parameter.device) for parameter in layer.parameters()})
    who = f"decoder layer {index} ({type(layer).__name__}) of {type(model).__name__}"
    if "meta" in devices:
        msg = (
            f"{who} holds weights on the meta device: they are offloaded (a device_map entry 'cpu' or 'disk' "
            "with offloading) or were never loaded, so the device its attention writes keys on is only known "
            "while it runs. cachelife pins every cache layer ahead, on its layer's device; load every decoder "
            "layer onto a device (no offloading) to decode with static caches."
        )
        raise UnsupportedCacheError(msg)
    if len(devices) != 1:
        msg = (
            f"{who} holds weights on {', '.join(devices) or 'no device (it has no parameters)'}; cachelife needs "
            "each decoder layer whole on one device to know where its cache belongs. Keep decoder layers whole "
            "in device_map (device_map='auto' does, through the model's _no_split_modules)."
        )
        raise UnsupportedCacheError(msg)
    return resolve_device(devices[0])
