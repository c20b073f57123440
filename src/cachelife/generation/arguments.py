"""What `cachelife.generate` accepts: the arguments and merged generation configs it decodes itself.

The merge of per-call arguments with the model's generation config is transformers' own
(`GenerationMixin._prepare_generation_config`, the function `generate` calls), run on the same arguments
before anything else, so that the features checked here are the ones `generate` would use. Each check
returns the name of the first feature `cachelife.generate` does not implement, or None.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode

from cachelife.errors import UnsupportedGenerationError
from cachelife.generation.processors import unsupported_processor

# Arguments of `generate` whose presence (with a value that is not None, empty or False) asks for a
# feature that cachelife.generate leaves to transformers.
FALLBACK_ARGUMENTS: tuple[str, ...] = (
    "prefix_allowed_tokens_fn",
    "assistant_model",
    "assistant_tokenizer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "synced_gpus",
    "constraints",
    "force_words_ids",
    "cache",
    "past_key_values",
    "inputs_embeds",
    "decoder_inputs_embeds",
    "decoder_attention_mask",
    # Whisper: token timestamps come from the cross-attentions, which the loop does not keep.
    "return_token_timestamps",
)

# Generation-config fields that ask for outputs or stopping rules this loop does not produce.
FALLBACK_CONFIG_FIELDS: tuple[str, ...] = (
    "output_attentions",
    "output_hidden_states",
    "prefill_chunk_size",
    "guidance_scale",
    "watermarking_config",
    "token_healing",
)
_NEUTRAL_CONFIG: Mapping[str, tuple[object, ...]] = {
    "output_attentions": (None, False),
    "output_hidden_states": (None, False),
    "prefill_chunk_size": (None,),
    "guidance_scale": (None, 1, 1.0),
    "watermarking_config": (None,),
    "token_healing": (None, False),
}

SUPPORTED_MODES = (
    GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE
)  # fmt: skip


def unsupported_argument(kwargs: Mapping[str, Any]) -> str | None:
    """The first argument (or input property) of this call that asks for an unimplemented feature; a
    `logits_processor` list only for a processor that cachelife does not run (it runs its own `OccurrencePenalty`
    and the transformers processors `generation.processors` converts)."""
    custom = kwargs.get("logits_processor")
    if custom:
        reason = unsupported_processor(list(custom))
        if reason is not None:
            return reason if reason.startswith("logits_processor") else f"logits_processor ({reason})"
    for name in FALLBACK_ARGUMENTS:
        value = kwargs.get(name)
        if value is not None and value is not False and not (isinstance(value, list | tuple) and not value):
            return name
    if kwargs.get("inputs") is not None:
        return "inputs (positional input tensor; pass it by name: input_ids=, input_features=)"
    return None


def merged_config(model: PreTrainedModel, kwargs: Mapping[str, Any]) -> GenerationConfig:
    """The generation config `generate` would decode with: transformers' own merge of `kwargs`."""
    arguments = dict(kwargs)
    base = arguments.pop("generation_config", None)
    for name in ("language", "task"):  # Whisper's, consumed before GenerationMixin.generate
        arguments.pop(name, None)
    config, _ = model._prepare_generation_config(base, **arguments)
    return config


# Outputs that `generate` returns only inside the output object of `return_dict_in_generate=True`: alone, it
# ignores them, and so does cachelife.
_OUTPUT_FIELDS = ("output_attentions", "output_hidden_states")
# What the user passed for a generation mode cachelife does not run, by the mode's name.
_MODE_ARGUMENTS: Mapping[str, str] = {
    "group_beam_search": "num_beam_groups > 1 (group beam search)",
    "constrained_beam_search": "constraints or force_words_ids (constrained beam search)",
    "assisted_generation": "assistant_model or prompt_lookup_num_tokens (assisted generation)",
    "contrastive_search": "penalty_alpha with top_k (contrastive search)",
    "dola_generation": "dola_layers (DoLa decoding)",
}


def unsupported_config(config: GenerationConfig, assistant: object = None) -> str | None:
    """The first setting of a merged generation config that asks for an unimplemented feature, named as the
    user sets it."""
    mode = config.get_generation_mode(assistant)
    if mode not in SUPPORTED_MODES:
        return _MODE_ARGUMENTS.get(mode.value, f"generation mode {mode.value!r}")
    returns_dict = bool(getattr(config, "return_dict_in_generate", False))
    for name in FALLBACK_CONFIG_FIELDS:
        if name in _OUTPUT_FIELDS and not returns_dict:
            continue
        if getattr(config, name, None) not in _NEUTRAL_CONFIG[name]:
            return name
    return None


# -- fields of the generation config `generate` hands the decoding method ------------------------------------


def eos_ids(config: GenerationConfig) -> torch.Tensor | None:
    """The end-of-sequence ids `generate` resolved, as a 1-D long tensor, or None."""
    eos = special_tokens(config, "_eos_token_tensor")
    return None if eos is None else eos.view(-1).to(torch.long)


def special_tokens(config: GenerationConfig, name: str) -> torch.Tensor | None:
    """A special-token tensor `generate` sets on its config (`_prepare_special_tokens`): not a field a fresh
    `GenerationConfig` has, so it is read by name."""
    value = getattr(config, name, None)
    return value if isinstance(value, torch.Tensor) else None


def beam_fill(config: GenerationConfig) -> int:
    """What beam search writes past a hypothesis' end: `_beam_search`'s output_fill_value, as transformers
    writes it (the pad token, else the first end token, else -1)."""
    pad, ends = special_tokens(config, "_pad_token_tensor"), special_tokens(config, "_eos_token_tensor")
    return int(pad or ends[0] if ends is not None else -1)


def _resolved(config: GenerationConfig, name: str) -> object:
    """A field `generate` has filled with its default by the time it calls the decoding method."""
    value = getattr(config, name)
    if value is None:
        msg = f"generate called cachelife's decoding method with generation_config.{name} unset; expected a value"
        raise UnsupportedGenerationError(msg)
    return value


def float_field(config: GenerationConfig, name: str) -> float:
    value = _resolved(config, name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = f"generation_config.{name} must be a number here, got {value!r}"
        raise UnsupportedGenerationError(msg)
    return float(value)


def early_stopping(config: GenerationConfig) -> bool | str:
    value = _resolved(config, "early_stopping")
    if not isinstance(value, bool | str):
        msg = f"generation_config.early_stopping must be True, False or 'never', got {value!r}"
        raise UnsupportedGenerationError(msg)
    return value


def int_field(config: GenerationConfig, name: str) -> int:
    value = _resolved(config, name)
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"generation_config.{name} must be an int here, got {value!r}"
        raise UnsupportedGenerationError(msg)
    return value
