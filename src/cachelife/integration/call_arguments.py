"""Readers of the keyword arguments of a forward call, or of `generate`'s model_kwargs: the cache, the batch
size, the query length and the encoder output. They read shapes only (host-side facts), never tensor values.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from transformers import PreTrainedModel

# Where transformers passes the cache to forward and to `generate`'s model_kwargs: `cache` from 5.24 on,
# `past_key_values` before.
CACHE_ARGUMENT_NAMES = ("cache", "past_key_values")
# Inputs whose first two dims are (batch, query length), in the order a decoder step reads them.
_QUERY_INPUTS = ("decoder_input_ids", "input_ids", "decoder_inputs_embeds", "inputs_embeds")


def find_cache(kwargs: Mapping[str, Any]) -> object:
    """The cache object in forward kwargs or `generate`'s model_kwargs, under either transformers name."""
    for name in CACHE_ARGUMENT_NAMES:
        cache = kwargs.get(name)
        if cache is not None:
            return cache
    return None


def cache_argument_name(model: PreTrainedModel) -> str:
    """The keyword `model.forward` and `generate` take the cache under: `cache` (5.24+) or `past_key_values`."""
    parameters = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def batch_size(kwargs: Mapping[str, Any]) -> int | None:
    """The call's batch: the first dim of its query input, else of the encoder output; None if neither is there."""
    query = _first_tensor(kwargs, _QUERY_INPUTS)
    if query is not None:
        return int(query.shape[0])
    encoded = encoder_states(kwargs)
    return None if encoded is None else int(encoded.shape[0])


def query_length(kwargs: Mapping[str, Any]) -> int | None:
    """How many positions the call writes into the self-attention cache (the query input's second dim)."""
    query = _first_tensor(kwargs, _QUERY_INPUTS)
    return None if query is None or query.dim() < 2 else int(query.shape[1])


def encoder_states(kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The encoder's output states (`encoder_outputs[0]`), if the call carries them."""
    encoder_outputs = kwargs.get("encoder_outputs")
    if encoder_outputs is None:
        return None
    states = encoder_outputs[0]
    return states if isinstance(states, torch.Tensor) else None


def encoder_length(kwargs: Mapping[str, Any]) -> int | None:
    """The encoder output's length (positions), if the call carries it."""
    states = encoder_states(kwargs)
    return None if states is None or states.dim() < 2 else int(states.shape[1])


def _first_tensor(kwargs: Mapping[str, Any], names: tuple[str, ...]) -> torch.Tensor | None:
    for name in names:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            return value
    return None
