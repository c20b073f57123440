"""`cachelife::cumulative_sum`: a row's cumulative sum as torch's own kernel computes it, inside compiled steps too."""

from __future__ import annotations

import torch


@torch.library.custom_op("cachelife::cumulative_sum", mutates_args=())
def cumulative_sum(values: torch.Tensor) -> torch.Tensor:
    """`values.cumsum(dim=-1)` as torch's own kernel computes it, also within a compiled step: inductor's scan of a
    (rows, vocabulary) tensor fails to generate on CUDA (torch 2.11), and the kernel's sums are eager
    transformers' sums."""
    return values.cumsum(dim=-1)


@cumulative_sum.register_fake
def _(values: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(values)
