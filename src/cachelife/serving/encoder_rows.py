"""A newcomer's encoder output in an engine's batch: padded to the engine's encoder length, and copied into the
newcomer's rows of the static encoder buffers every step reads (made at the first encoder-decoder join)."""

from __future__ import annotations

from typing import Any

import torch
from attrs import frozen
from transformers.modeling_outputs import BaseModelOutput

from cachelife.errors import InvalidArgumentError


@frozen
class EncoderRow:
    hidden: torch.Tensor  # (1, encoder length, hidden)
    mask: torch.Tensor | None  # (1, encoder length), for models that mask the encoder's padding


def padded_encoder_row(
    kwargs: dict[str, Any], *, width: int, rows: int, step_inputs: dict[str, Any], masked: bool
) -> EncoderRow:
    """The newcomer's encoder output (and, where `masked`, its mask) padded to `width` positions, put back into
    its prefill's `kwargs`; the batch's static buffers for them made in `step_inputs` if they are not yet."""
    hidden: torch.Tensor = kwargs["encoder_outputs"][0]
    length = int(hidden.shape[1])
    if length > width:
        msg = f"the request's encoder output has {length} positions, the engine's encoder_length is {width}"
        raise InvalidArgumentError(msg)
    padded = hidden.new_zeros(1, width, hidden.shape[2])
    padded[:, :length] = hidden
    kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=padded)
    if "encoder hidden" not in step_inputs:
        step_inputs["encoder hidden"] = _static(hidden.new_zeros(rows, width, hidden.shape[2]))
        step_inputs["encoder_outputs"] = BaseModelOutput(last_hidden_state=step_inputs["encoder hidden"])
    if not masked:
        return EncoderRow(padded, None)
    mask = kwargs.get("attention_mask")
    full = torch.zeros(1, width, dtype=torch.long, device=hidden.device)
    full[:, :length] = mask if isinstance(mask, torch.Tensor) else 1
    kwargs["attention_mask"] = full
    if "attention_mask" not in step_inputs:
        step_inputs["attention_mask"] = _static(torch.ones_like(full).expand(rows, -1).clone())
    return EncoderRow(padded, full)


def write_encoder_row(step_inputs: dict[str, Any], row: int, encoder: EncoderRow) -> None:
    """Row `row` of the batch's encoder buffers holds `encoder`."""
    step_inputs["encoder hidden"][row].copy_(encoder.hidden[0])
    if encoder.mask is not None:
        step_inputs["attention_mask"][row].copy_(encoder.mask[0])


def _static(tensor: torch.Tensor) -> torch.Tensor:
    torch._dynamo.mark_static_address(tensor)
    return tensor
