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
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from cachelife.errors import UnsupportedGenerationError
from cachelife.generation.arguments import int_field
from cachelife.generation.host import host_criteria
from cachelife.generation.processors import unsupported_processor
from cachelife.generation.searches import beam_search, greedy_search
from cachelife.generation.states import StateLeases
from cachelife.generation.steps import LoopSettings
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
    mask = model_kwargs.get("attention_mask")
    if not model.config.is_encoder_decoder and isinstance(mask, torch.Tensor) and bool((mask == 0).any()):
        return "padded prompts for a decoder-only model (an attention_mask with zeros, passed or inferred)"
    return None


def decoding_method(
    settings: LoopSettings, on_call: Callable[[], None], streamer: BaseStreamer | None = None
) -> Callable[..., torch.Tensor]:
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
    ) -> torch.Tensor:
        on_call()
        feature = (
            unsupported_processor(logits_processor)
            or unsupported_criterion(stopping_criteria, generation_config)
            or unsupported_prompt(model, model_kwargs)
        )
        if feature is not None:
            fall_back(feature, settings.fallback, model)
            mode = generation_config.get_generation_mode()
            method = model._beam_search if mode == GenerationMode.BEAM_SEARCH else model._sample
            result = method(
                input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                generation_config=generation_config, synced_gpus=synced_gpus, streamer=streamer, **model_kwargs,
            )  # fmt: skip
            if not isinstance(result, torch.Tensor):
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
