"""The attention the engine's rows decode with.

A step's rows attend over the static cache's whole width with SDPA, its unused slots masked but still read.
cachelife's decode attention kernel (`cachelife.kernels.attention`) skips the tiles a row's mask leaves out, so
a row reads only the slots it attends (a call without a mask, cross-attention over every encoder frame, keeps
SDPA). `Engine(attention=...)` chooses: "auto" (the default) takes the kernel on a
CUDA device where Triton runs and where every config of the model uses transformers' SDPA (a model set to another
implementation keeps it); "decode" takes it wherever the model supports it (elsewhere the op's torch fallback, or
Triton's interpreter under `TRITON_INTERPRET=1`); "model" keeps the model's own implementation. The GPU suite
checks the kernel in the engine's rows: fp32 tokens equal `model.generate` under CUDA graphs.
The switch holds while the engine serves and is undone when its scheduler ends (`AttentionSwitch.restore`).
"""

from __future__ import annotations

import logging
from typing import Final, Literal

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from cachelife.errors import UnsupportedGenerationError
from cachelife.kernels.triton_support import triton_runs_on
from cachelife.model_rewrites.decode_attention import AttentionSwitch, check_decode_attention, use_decode_attention
from cachelife.validate import check_choice

logger = logging.getLogger(__name__)

StepAttention = Literal["auto", "decode", "model"]
CHOICES: Final = ("auto", "decode", "model")


def check_attention(attention: object) -> StepAttention:
    """`attention` if it is one of `CHOICES`, else `InvalidArgumentError` naming them."""
    choice = check_choice("attention", attention, CHOICES)
    return "auto" if choice == "auto" else "decode" if choice == "decode" else "model"


def switch_attention(model: PreTrainedModel, attention: StepAttention) -> AttentionSwitch | None:
    """Switch the model to the decode attention kernel as `attention` says (see the module docstring); the switch
    to undo, or None where the model keeps its own. "decode" on a model whose attention does not go through
    transformers' attention interface raises `UnsupportedGenerationError`, and nothing changes."""
    if attention == "model" or (attention == "auto" and not _kernel_by_default(model)):
        return None
    switch = use_decode_attention(model)
    logger.debug("cachelife.Engine: the rows decode with cachelife's decode attention (attention=%r)", attention)
    return switch


def triton_on_gpu(device: torch.device) -> bool:
    """Whether "auto" takes the kernel on `device`: a CUDA device where Triton runs (Triton's CPU interpreter is
    for tests, not for serving)."""
    return device.type == "cuda" and triton_runs_on(device)


def _kernel_by_default(model: PreTrainedModel) -> bool:
    if not triton_on_gpu(model.device):
        return False
    configs = [c for m in model.modules() if isinstance(c := getattr(m, "config", None), PreTrainedConfig)]
    if any(config._attn_implementation != "sdpa" for config in configs):
        return False
    try:
        check_decode_attention(model)
    except UnsupportedGenerationError:
        return False
    return True
