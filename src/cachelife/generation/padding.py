"""Left-padded prompts of decoder-only models, as the compiled step sees them.

`generate` decodes a batch of prompts of different lengths with left padding and a 2-D attention mask: it
computes each row's positions from the mask (`attention_mask.cumsum(-1) - 1`, padding excluded) and, at every
step, appends a one to the mask and one to the positions. The compiled step reads the same from static buffers
instead: the mask once at its final width (the prompt's mask, then ones: positions past the current length
are masked by causality anyway), and each row's padding count, from which the position of the token at
`length - 1` is `length - 1 - padding`. Rows of one input's beams share their padding, so beam reorders leave
both as they are. Right padding is not what `generate` is made for with decoder-only models, and is refused.
An encoder-decoder model's decoder prompt is read the same way from `decoder_attention_mask`, with
`decoder_position_ids`: Whisper's sequential long form left-pads the earlier segments' tokens of a batch
(`condition_on_prev_tokens`), and its `prepare_inputs_for_generation` computes the positions as above.
"""

from __future__ import annotations

import inspect

import torch
from attrs import frozen
from transformers import PreTrainedModel

# The forward's arguments for the mask and the positions: a decoder-only model's, and an encoder-decoder
# model's decoder's (Whisper's sequential long form left-pads a batch's prompts of earlier segments).
DECODER_ONLY = ("attention_mask", "position_ids")
DECODER = ("decoder_attention_mask", "decoder_position_ids")


@frozen
class LeftPadding:
    """Static buffers: the attention mask at the cache's width, and each row's padding count; `names` are the
    forward's arguments for them (`DECODER_ONLY` or `DECODER`)."""

    mask: torch.Tensor  # (rows, cache length), the mask's dtype
    padding: torch.Tensor  # (rows,) long
    names: tuple[str, str] = DECODER_ONLY

    def step_inputs(self, length: torch.Tensor) -> dict[str, torch.Tensor]:
        """The mask and position ids of the step whose input is the token at `length - 1` (0-dim)."""
        mask_name, positions_name = self.names
        return {mask_name: self.mask, positions_name: (length - 1 - self.padding)[:, None]}


def is_padded(mask: object) -> bool:
    return isinstance(mask, torch.Tensor) and bool((mask == 0).any())


def unsupported_padding(model: PreTrainedModel, mask: torch.Tensor) -> str | None:
    """Why a padded prompt (a decoder-only model's, or an encoder-decoder model's decoder's) cannot be decoded
    on the fast path, or None."""
    mask_name, positions_name = DECODER if model.config.is_encoder_decoder else DECODER_ONLY
    prompts = "decoder prompts" if model.config.is_encoder_decoder else "prompts for a decoder-only model"
    if mask.dim() != 2:
        return f"a {mask_name} of {mask.dim()} dimensions (2 are decoded)"
    ones_then_zeros = (mask[:, 1:] == 0) & (mask[:, :-1] != 0)
    if bool(ones_then_zeros.any()):
        return f"right-padded {prompts} ({mask_name} zeros after tokens; pad on the left)"
    if positions_name not in inspect.signature(model.forward).parameters:
        return f"padded {prompts} for {type(model).__name__}, whose forward takes no {positions_name}"
    return None


def left_padding(model: PreTrainedModel, model_kwargs: dict[str, object]) -> int:
    """The pad tokens on the left of the first prompt `generate` prepared (its decoder prompt's, for an
    encoder-decoder model): the zeros of the attention mask it was given or inferred, 0 without a mask."""
    mask = model_kwargs.get((DECODER if model.config.is_encoder_decoder else DECODER_ONLY)[0])
    return int((mask[0] == 0).sum()) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else 0


def padding_counts(mask: torch.Tensor) -> torch.Tensor:
    """Each row's left padding: the zeros of its mask."""
    return (mask == 0).sum(dim=-1).to(torch.long)
