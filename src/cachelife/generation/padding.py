"""Left-padded prompts of decoder-only models, as the compiled step sees them.

`generate` decodes a batch of prompts of different lengths with left padding and a 2-D attention mask: it
computes each row's positions from the mask (`attention_mask.cumsum(-1) - 1`, padding excluded) and, at every
step, appends a one to the mask and one to the positions. The compiled step reads the same from static buffers
instead: the mask once at its final width (the prompt's mask, then ones: positions past the current length
are masked by causality anyway), and each row's padding count, from which the position of the token at
`length - 1` is `length - 1 - padding`. Rows of one input's beams share their padding, so beam reorders leave
both as they are. Right padding is not what `generate` is made for with decoder-only models, and is refused.
"""

from __future__ import annotations

import inspect

import torch
from attrs import frozen
from transformers import PreTrainedModel


@frozen
class LeftPadding:
    """Static buffers: the attention mask at the cache's width, and each row's padding count."""

    mask: torch.Tensor  # (rows, cache length), the mask's dtype
    padding: torch.Tensor  # (rows,) long

    def step_inputs(self, length: torch.Tensor) -> dict[str, torch.Tensor]:
        """The mask and position ids of the step whose input is the token at `length - 1` (0-dim)."""
        return {"attention_mask": self.mask, "position_ids": (length - 1 - self.padding)[:, None]}


def is_padded(mask: object) -> bool:
    return isinstance(mask, torch.Tensor) and bool((mask == 0).any())


def unsupported_padding(model: PreTrainedModel, mask: torch.Tensor) -> str | None:
    """Why a padded decoder-only prompt cannot be decoded on the fast path, or None."""
    if mask.dim() != 2:
        return f"an attention_mask of {mask.dim()} dimensions for a decoder-only model (2 are decoded)"
    ones_then_zeros = (mask[:, 1:] == 0) & (mask[:, :-1] != 0)
    if bool(ones_then_zeros.any()):
        return "right-padded prompts for a decoder-only model (attention_mask zeros after tokens; pad on the left)"
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return f"padded prompts for {type(model).__name__}, whose forward takes no position_ids"
    return None


def padding_counts(mask: torch.Tensor) -> torch.Tensor:
    """Each row's left padding: the zeros of its mask."""
    return (mask == 0).sum(dim=-1).to(torch.long)
