# transformers.masking_utils, as checked against 5.17.0, 5.24.0 and 5.25.0.
from collections.abc import Callable
from typing import Any

import torch

# A mapping from attention implementation names to the functions that build their masks.
class AttentionMaskInterface:
    @classmethod
    def register(cls, key: str, value: Callable[..., Any]) -> None: ...

# SDPA's mask: bool, (batch, 1, q_length, kv_length), True where a query attends; None where SDPA needs none.
def sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] = ...,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> torch.Tensor | None: ...
