"""The decoding method behind `cachelife.generate`, in the gpt-fast style.

transformers' `generate` prepares everything (generation config, special tokens, encoder outputs, the
decoder prompt, beam expansion, lengths, the processor list) and calls `decoding_method`'s function in place
of `_sample` / `_beam_search`. It checks what reached it (processors, stopping criteria, the prompt's mask as
`generate` passed or inferred it) and either falls back to transformers' own method with one WARNING
(`fall_back`), or holds the model's lock and runs one of cachelife's searches (`searches`) on buffers leased
for the call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import StaticCache, StaticSlidingWindowLayer
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.utils import ModelOutput

from cachelife.errors import UnsupportedGenerationError
from cachelife.generation.arguments import int_field
from cachelife.generation.host import host_criteria
from cachelife.generation.loop_settings import LoopSettings
from cachelife.generation.padding import is_padded, unsupported_padding
from cachelife.generation.processors import unsupported_processor
from cachelife.generation.searches import beam_search, greedy_search
from cachelife.generation.states import StateLeases
from cachelife.integration.buckets import pad_generation_kwargs
from cachelife.integration.compile_cache import pinned_compile_cache
from cachelife.integration.runtime import collecting_after_compilation, runtime_of

logger = logging.getLogger(__name__)


def fall_back(feature: str, fallback: bool, model: PreTrainedModel) -> None:
    """Name the feature and the way out: one WARNING per model and feature (later ones at DEBUG), or
    `UnsupportedGenerationError` with `fallback=False`."""
    leave_out = f"leave out {feature} to decode on cachelife's fast path"
    if not fallback:
        msg = (
            f"cachelife.generate does not implement {feature}: {leave_out}, or call model.generate (or "
            "cachelife.generate with fallback=True) for transformers' own loop"
        )
        raise UnsupportedGenerationError(msg)
    first = runtime_of(model).warn_once(("fallback", feature))
    logger.log(
        logging.WARNING if first else logging.DEBUG,
        "cachelife.generate falls back to model.generate (transformers' host loop, eager speed) for %s: %s",
        feature,
        f"{leave_out}, or pass fallback=False to make this an error",
    )


# The argument behind each stopping criterion transformers builds from the generation config.
_CRITERION_ARGUMENT = {"StopStringCriteria": "stop_strings", "MaxTimeCriteria": "max_time"}


def unsupported_criterion(criteria: StoppingCriteriaList, config: GenerationConfig) -> str | None:
    """Host-side stopping criteria are evaluated at host checks in greedy search and sampling
    (`cachelife.generation.host`); beam search leaves them to transformers."""
    if int_field(config, "num_beams") == 1:
        return None
    for criterion in host_criteria(criteria):
        name = type(criterion).__name__
        return f"{_CRITERION_ARGUMENT.get(name, f'stopping_criteria (a {name})')} with beam search"
    return None


def unsupported_prompt(model: PreTrainedModel, model_kwargs: dict[str, Any]) -> str | None:
    """A prompt the loop does not decode, read from what reaches the decoding method: the attention mask
    `generate` was given or inferred from the pad token, so that both are treated alike."""
    mask = model_kwargs.get("decoder_attention_mask" if model.config.is_encoder_decoder else "attention_mask")
    if not isinstance(mask, torch.Tensor) or not is_padded(mask):
        return None
    return unsupported_padding(model, mask)


def unsupported_window(model: PreTrainedModel, config: GenerationConfig, settings: LoopSettings) -> str | None:
    """Sliding-window layers under a compiled step. transformers' sliding cache layer counts its positions in a
    Python int (`cumulative_length_int`, which also gives the positions of new tokens and says when the window
    is full); a compiled step and a captured graph keep it at the value they were traced with, so their tokens
    would drift from `generate`'s. Such calls are left to transformers; the eager step (`compile_step=False`)
    reads the int afresh at every step."""
    if not settings.compile_step:
        return None
    if has_sliding_layers(model, int_field(config, "max_length") + settings.steps_per_call):
        return "sliding-window attention in a compiled step (pass compile_step=False for cachelife's eager step)"
    return None


def has_sliding_layers(model: PreTrainedModel, positions: int) -> bool:
    """Whether a static cache of `positions` for the model's decoder has sliding-window layers (a window
    longer than `positions` makes a full layer)."""
    layers = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=positions).layers
    return any(isinstance(layer, StaticSlidingWindowLayer) for layer in layers)


def decoding_method(
    settings: LoopSettings, on_call: Callable[[], None], streamer: BaseStreamer | None = None
) -> Callable[..., torch.Tensor | ModelOutput]:
    """A decoding method for `generate(custom_generate=...)`: the compiled loop, or transformers' own
    (after the fallback warning) for processors or stopping criteria it cannot run. `on_call` runs first, so
    that the caller can tell whether `generate` called it at all."""

    def decode(
        model: PreTrainedModel,
        input_ids: torch.Tensor,
        *,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        **model_kwargs: Any,
    ) -> torch.Tensor | ModelOutput:
        on_call()
        feature = (
            unsupported_processor(logits_processor)
            or unsupported_criterion(stopping_criteria, generation_config)
            or unsupported_prompt(model, model_kwargs)
            or unsupported_window(model, generation_config, settings)
        )
        if feature is not None:
            fall_back(feature, settings.fallback, model)
            beams = int_field(generation_config, "num_beams") > 1  # beam search and beam sampling
            method = model._beam_search if beams else model._sample
            result = method(
                input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                generation_config=generation_config, synced_gpus=synced_gpus, streamer=streamer, **model_kwargs,
            )  # fmt: skip
            if not isinstance(result, torch.Tensor | ModelOutput):
                msg = f"transformers' decoding method returned a {type(result).__name__}, expected tokens"
                raise UnsupportedGenerationError(msg)
            return result
        if settings.encoder_buckets is not None:
            pad_generation_kwargs(model_kwargs, settings.encoder_buckets)
        runtime = runtime_of(model)
        # A decoding method that compiled collects its traces' cycles before the next one runs (Whisper's
        # generate calls it once per segment and per fallback), so that the next cache gets this one's buffers.
        with runtime.lock, collecting_after_compilation(), StateLeases(runtime) as leases, pinned_compile_cache():
            if int_field(generation_config, "num_beams") > 1:
                return beam_search(
                    model, input_ids, processors=logits_processor, config=generation_config, settings=settings,
                    model_kwargs=model_kwargs, leases=leases,
                )  # fmt: skip
            return greedy_search(
                model, input_ids, processors=logits_processor, config=generation_config, settings=settings,
                model_kwargs=model_kwargs, leases=leases, criteria=host_criteria(stopping_criteria),
                streamer=streamer,
            )  # fmt: skip

    return decode
