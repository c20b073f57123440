"""cachelife's decode attention kernel (`cachelife.kernels.attention`) as a transformers attention
implementation: `decode_attention_forward` has the signature of transformers' attention functions and runs the
kernel for one query (transformers' SDPA otherwise), `register_decode_attention` registers it under `ATTENTION`,
and `use_decode_attention(model)` switches a model to it until `restore()`.
"""

from __future__ import annotations

from typing import Any, Final

import torch
from attrs import frozen
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from cachelife.errors import UnsupportedGenerationError
from cachelife.kernels.attention import decode_attention, input_problem

ATTENTION: Final = "cachelife_decode"

UNMASKED_BY_KERNEL = False
"""Whether one-query calls without a mask or bias (Whisper's and BART's cross-attention) take the kernel's matrix
products (`decode_attention(..., products=True)`) instead of SDPA. Off: the products round the attention weights
as flash attention does but not as the SDPA backends a step keeps to, and the step's wall time and tokens with
them are not yet measured (`bench.engine`'s `engine_unmasked_kernel` path sets it for the comparison)."""


def decode_attention_forward(  # noqa: PLR0917 (transformers' attention-function signature)
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: `decode_attention` for one query over masked keys, transformers' SDPA
    otherwise (no mask and no bias, such as Whisper's cross-attention, unless `UNMASKED_BY_KERNEL`; more
    queries, dropout, soft-capping, attention sinks, a query that needs gradients (the op has none), or inputs
    the kernel does not take). Returns the output as (batch, q_len, heads, head_dim) and no
    weights, as SDPA does. T5's `position_bias` joins the mask."""
    declined = dropout != 0.0 or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
    declined = declined or (torch.is_grad_enabled() and query.requires_grad)
    unmasked = attention_mask is None and position_bias is None
    declined = declined or (unmasked and not UNMASKED_BY_KERNEL)
    tensor_mask = attention_mask is None or isinstance(attention_mask, torch.Tensor)  # not a flex BlockMask
    if query.shape[2] == 1 and tensor_mask and not declined:
        mask = attention_mask if position_bias is None else _biased_mask(position_bias, attention_mask)
        if not input_problem(query, key, value, mask):
            output = decode_attention(query, key, value, mask, scaling=scaling, products=unmasked)
            return output.transpose(1, 2), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
        position_bias=position_bias, **kwargs,
    )  # fmt: skip


def _biased_mask(position_bias: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """An additive mask: the bias where the mask attends, -inf where it does not."""
    if mask is None:
        return position_bias
    if mask.dtype == torch.bool:
        return torch.where(mask, position_bias, float("-inf"))
    return position_bias + mask


def register_decode_attention() -> str:
    """Register `decode_attention_forward` with transformers under `ATTENTION`, with SDPA's mask function (a bool
    mask, or none where SDPA needs none); returns the name. Calling it again changes nothing."""
    AttentionInterface.register(ATTENTION, decode_attention_forward)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION


@frozen
class AttentionSwitch:
    """The attention implementation each config of a model had before `use_decode_attention`."""

    previous: tuple[tuple[PreTrainedConfig, str | None], ...]

    def restore(self) -> None:
        """Give each config its previous implementation back."""
        for config, implementation in self.previous:
            config._attn_implementation_internal = implementation


def check_decode_attention(model: PreTrainedModel) -> None:
    """Refuse, with `UnsupportedGenerationError`, a model with a part whose attention does not go through
    transformers' attention interface, where `ATTENTION` would not be used."""
    refused = sorted({type(m).__name__ for m in model.modules() if isinstance(m, PreTrainedModel)
                      and not type(m)._can_set_attn_implementation()})  # fmt: skip
    if refused:
        msg = (
            f"{', '.join(refused)} computes attention outside transformers' attention interface, so "
            f"{ATTENTION!r} would not be used; keep the model's own attention for it"
        )
        raise UnsupportedGenerationError(msg)


def use_decode_attention(model: PreTrainedModel) -> AttentionSwitch:
    """Switch every attention layer of `model` to `decode_attention_forward`; `restore()` on the result undoes it.

    Each config the model's modules hold is set, not only `model.config`: transformers 5.17's
    `set_attn_implementation` leaves the configs of T5's encoder and decoder stacks (copies of the model's) as
    they were. A model `check_decode_attention` refuses is refused, and nothing changes. Switch before
    compiling: a compiled forward would compile again.
    """
    check_decode_attention(model)
    register_decode_attention()
    configs = {id(c): c for m in model.modules() if isinstance(c := getattr(m, "config", None), PreTrainedConfig)}
    switch = AttentionSwitch(tuple((c, c._attn_implementation_internal) for c in configs.values()))
    for config in configs.values():
        config._attn_implementation_internal = ATTENTION
    return switch
