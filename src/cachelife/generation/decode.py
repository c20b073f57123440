"""`decode`: a preset of `cachelife.generate` for bare generation configs (at the top level until 0.2).

`decode(model, inputs, max_new_tokens=...)` is `cachelife.generate(model, **inputs, max_new_tokens=...)` with
greedy search or plain sampling (temperature, top-k, a seeded `torch.Generator`), nothing else: a model whose
generation config asks for more (forced or suppressed tokens, repetition penalties, minimum lengths, ...) is
refused with `UnsupportedGenerationError`, so that a caller who wants exactly the bare loop gets it or an error.
It returns the decoder's tokens from its start token (encoder-decoder models, Whisper's start token included)
or prompt and new tokens (decoder-only), padded after each sequence's end-of-sequence token, as `generate`
pads them. One decoding loop serves both (`cachelife.generation.method`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from cachelife.errors import InvalidArgumentError, UnsupportedGenerationError
from cachelife.generation.api import generate
from cachelife.validate import is_int_at_least

# Generation-config fields whose logits processors this preset leaves out, with their neutral values.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "bad_words_ids": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "forced_decoder_ids": (None,),
    "sequence_bias": (None,),
    "exponential_decay_length_penalty": (None,),
}


def decode(
    model: PreTrainedModel,
    inputs: Mapping[str, torch.Tensor],
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    stop_check_every: int = 16,
    steps_per_call: int = 1,
    compile_step: bool = True,
    encoder_buckets: Sequence[int] | None = None,
) -> torch.Tensor:
    """Generate up to `max_new_tokens` tokens; see the module docstring. `encoder_buckets` pads the encoder
    output and its mask to the smallest bucket that fits (`cachelife.integration.buckets`)."""
    _check_generation_config(model)
    if not all(is_int_at_least(count, 1) for count in (max_new_tokens, stop_check_every, steps_per_call)):
        msg = (
            "max_new_tokens, stop_check_every and steps_per_call must be ints >= 1, got "
            f"{max_new_tokens}, {stop_check_every} and {steps_per_call}"
        )
        raise InvalidArgumentError(msg)
    if do_sample and generator is None:
        msg = "sampling needs a seeded torch.Generator on the model's device (generator=...)"
        raise InvalidArgumentError(msg)
    # top_k=0 and top_p=1.0 turn off the warpers a generation config would otherwise add by default.
    choice: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_k": top_k or 0, "top_p": 1.0}
        if do_sample
        else {"do_sample": False}
    )
    arguments: dict[str, Any] = {**inputs, "max_new_tokens": max_new_tokens, **choice}
    tokens = generate(
        model, fallback=False, steps_per_call=steps_per_call, stop_check_every=stop_check_every,
        compile_step=compile_step, generator=generator, encoder_buckets=encoder_buckets, **arguments,
    )  # fmt: skip
    if not isinstance(tokens, torch.Tensor):
        msg = f"cachelife.generate returned a {type(tokens).__name__}, expected the token tensor"
        raise UnsupportedGenerationError(msg)
    return _with_whisper_start(model, tokens)


def _check_generation_config(model: PreTrainedModel) -> None:
    config = model.generation_config
    active = sorted(name for name, neutral in _NEUTRAL.items() if getattr(config, name, None) not in neutral)
    if active:
        msg = (
            f"{type(model).__name__}'s generation config sets {', '.join(active)}, whose logits processors "
            "decode (cachelife.generation.decode) does not apply; set them to None on model.generation_config, or use "
            "cachelife.generate, which applies them"
        )
        raise UnsupportedGenerationError(msg)


def _with_whisper_start(model: PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    """Whisper's `generate` drops the decoder start token from what it returns; decode keeps it, as T5's and
    BART's `generate` do."""
    if model.config.model_type != "whisper":
        return tokens
    start = model.generation_config.decoder_start_token_id
    if not isinstance(start, int):
        msg = f"decode needs one decoder start token id, got {start!r}"
        raise UnsupportedGenerationError(msg)
    return torch.cat([torch.full_like(tokens[:, :1], start), tokens], dim=1)
