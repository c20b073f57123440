"""Encoder-length buckets: the encoder output, and its attention mask, padded to a few fixed lengths.

Everything that pads lives here. An encoder-decoder model's cross-attention cache, and every compiled graph
that reads it, is shaped by the encoder's output length; one length per input length means one pinned
cross-attention cache shape, one dynamo graph and one CUDA-graph recording per length. With buckets
`(64, 128, 256, 512)` an encoder output of 37 positions is padded with zeros to 64 and its attention mask
with zeros (masked) to 64, so every length from 1 to 64 decodes with the same shapes.

The rules:
- Padding is exact only for models whose cross-attention applies the encoder attention mask: the masked
  positions then get zero attention weight. `BUCKETABLE_MODEL_TYPES` lists the families for which this is
  tested (tests/test_buckets.py); any other model is refused when buckets are asked for, because padding
  would change its output silently (Whisper's decoder, for one, takes no encoder mask).
- A length above every bucket is left as it is, with one WARNING naming the length and the largest bucket.
- Buckets are strictly increasing positive ints; anything else is refused with `InvalidBucketsError`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, MutableMapping
from typing import Any, Final, TypeAlias

import torch
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from cachelife.errors import CacheShapeError, InvalidBucketsError, UnsupportedGenerationError
from cachelife.validate import is_int_at_least

logger = logging.getLogger(__name__)

Buckets: TypeAlias = tuple[int, ...]

# Model types (`config.model_type`) whose decoder's cross-attention honours the encoder attention mask, so
# that zero padding under a zero mask leaves the output unchanged. Each one is tested in tests/test_buckets.py.
BUCKETABLE_MODEL_TYPES: Final[frozenset[str]] = frozenset(
    {
        "t5",
        "mt5",
        "umt5",
        "longt5",
        "bart",
        "mbart",
        "marian",
        "pegasus",
        "blenderbot",
        "blenderbot-small",
        "plbart",
        "m2m_100",
        "mvp",
    }
)
# Why a known family is refused, shown in the error.
_REFUSED_BECAUSE: Final[Mapping[str, str]] = {
    "whisper": "Whisper's decoder takes no encoder attention mask, so padded positions would be attended to",
}


def check_buckets(value: object) -> Buckets:
    """`value` as a tuple of bucket lengths, or `InvalidBucketsError` saying what was expected."""
    expected = "a non-empty, strictly increasing sequence of positive ints such as (64, 128, 256, 512)"
    if isinstance(value, str | bytes) or not isinstance(value, tuple | list):
        msg = f"encoder_buckets must be {expected}, got {value!r}"
        raise InvalidBucketsError(msg)
    lengths: list[int] = []
    for item in value:
        if not is_int_at_least(item, 1):
            msg = f"encoder_buckets must be {expected}, got {value!r} (the entry {item!r} is no positive int)"
            raise InvalidBucketsError(msg)
        lengths.append(item)
    if not lengths:
        msg = f"encoder_buckets must be {expected}, got an empty {type(value).__name__}"
        raise InvalidBucketsError(msg)
    for before, after in itertools.pairwise(lengths):
        if after <= before:
            msg = f"encoder_buckets must be {expected}, got {value!r} ({after} follows {before})"
            raise InvalidBucketsError(msg)
    return tuple(lengths)


def check_bucketable(model: PreTrainedModel) -> None:
    """Refuse, with the reason, a model for which padding the encoder output would change its output."""
    model_type = str(model.config.model_type)
    if model_type in BUCKETABLE_MODEL_TYPES:
        return
    if not model.config.is_encoder_decoder:
        reason = "it is decoder-only: there is no encoder output to pad"
    else:
        reason = _REFUSED_BECAUSE.get(
            model_type, "cachelife has not verified that its cross-attention honours the encoder attention mask"
        )
    msg = (
        f"encoder_buckets cannot be used with {type(model).__name__} (model type {model_type!r}): {reason}. "
        f"Buckets are supported for model types {', '.join(sorted(BUCKETABLE_MODEL_TYPES))}; "
        "pass encoder_buckets=None for this model"
    )
    raise UnsupportedGenerationError(msg)


def bucket_length(length: int, buckets: Buckets) -> int | None:
    """The smallest bucket >= `length`, or None when `length` is above every bucket."""
    return next((bucket for bucket in buckets if bucket >= length), None)


def pad_encoder_states(
    states: torch.Tensor, mask: torch.Tensor | None, buckets: Buckets
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Encoder states `(batch, length, hidden)` and their `(batch, length)` attention mask, padded with zeros
    along the length to the smallest bucket that fits; a missing mask is created as all ones first. A length
    above every bucket is returned as it is (mask unchanged), with a WARNING."""
    length = int(states.shape[1])
    if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != tuple(states.shape[:2])):
        msg = (
            f"the encoder attention mask has shape {tuple(mask.shape)} where {tuple(states.shape[:2])} (batch, "
            "encoder length) is needed to pad it to an encoder-length bucket"
        )
        raise CacheShapeError(msg)
    target = bucket_length(length, buckets)
    if target is None:
        logger.warning(
            "encoder length %d is above the largest encoder bucket %d: not padded, so this length gets its own "
            "cache shape (and compiled graphs); add a larger bucket to cachelife.enable(..., encoder_buckets=...)",
            length,
            buckets[-1],
        )
        return states, mask
    if mask is None:
        mask = torch.ones(states.shape[:2], dtype=torch.long, device=states.device)
    if target == length:
        return states, mask
    logger.debug("encoder length %d padded to bucket %d", length, target)
    extra = target - length
    padded_states = torch.cat([states, states.new_zeros(states.shape[0], extra, *states.shape[2:])], dim=1)
    padded_mask = torch.cat([mask, mask.new_zeros(mask.shape[0], extra)], dim=1)
    return padded_states, padded_mask


def pad_generation_kwargs(model_kwargs: MutableMapping[str, Any], buckets: Buckets) -> None:
    """Pad `generate`'s `encoder_outputs` and `attention_mask` in `model_kwargs` in place (new tensors and a new
    output object: the caller's own `encoder_outputs` is never changed). Within the buckets the mask is always
    set, all ones at a bucket's own length, so that every call hands the decoder the same kinds of inputs.
    Does nothing without encoder outputs."""
    outputs = model_kwargs.get("encoder_outputs")
    if not isinstance(outputs, ModelOutput | tuple) or len(outputs) == 0:
        return
    states = outputs[0]
    if not isinstance(states, torch.Tensor) or states.dim() != 3:
        return
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not isinstance(mask, torch.Tensor):
        msg = f"attention_mask must be a tensor to pad it to an encoder-length bucket, got a {type(mask).__name__}"
        raise CacheShapeError(msg)
    padded_states, padded_mask = pad_encoder_states(states, mask, buckets)
    if padded_states is not states:
        model_kwargs["encoder_outputs"] = _with_states(outputs, padded_states)
    if padded_mask is not None:
        model_kwargs["attention_mask"] = padded_mask


def _with_states(outputs: ModelOutput | tuple[Any, ...], states: torch.Tensor) -> ModelOutput | tuple[Any, ...]:
    """A copy of the encoder outputs with its first entry (`last_hidden_state`) replaced."""
    if isinstance(outputs, tuple):
        return (states, *outputs[1:])
    fields = dict(outputs.items())
    fields[next(iter(fields))] = states
    return type(outputs)(**fields)
