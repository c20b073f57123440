# transformers.generation.utils, as checked against 5.17.0, 5.23.0, 5.24.0 and 5.25.0.
from typing import Any

import torch
from transformers.generation.configuration_utils import GenerationConfig
from transformers.utils import ModelOutput

class GenerationMixin:
    def generate(
        self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, **kwargs: Any
    ) -> torch.Tensor | ModelOutput: ...
    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs: Any) -> dict[str, Any]: ...
    def compute_transition_scores(
        self,
        sequences: torch.Tensor,
        scores: tuple[torch.Tensor, ...],
        beam_indices: torch.Tensor | None = None,
        normalize_logits: bool = False,
    ) -> torch.Tensor: ...
    # Writes the cache it builds (or checks the one it is given) into model_kwargs. The signature is the
    # same in every version listed above.
    def _prepare_cache_for_generation(
        self,
        generation_config: GenerationConfig,
        model_kwargs: dict[str, Any],
        generation_mode: Any,
        batch_size: int,
        max_cache_length: int,
    ) -> None: ...
    # cachelife.generate: the merge generate runs first, its prefill and its two decoding methods.
    def _prepare_generation_config(
        self, generation_config: GenerationConfig | None, **kwargs: Any
    ) -> tuple[GenerationConfig, dict[str, Any]]: ...
    def _prefill(
        self, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict[str, Any]
    ) -> ModelOutput: ...
    def _sample(
        self,
        input_ids: torch.Tensor,
        logits_processor: Any,
        stopping_criteria: Any,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        **model_kwargs: Any,
    ) -> torch.Tensor | ModelOutput: ...
    def _beam_search(
        self,
        input_ids: torch.Tensor,
        logits_processor: Any,
        stopping_criteria: Any,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        **model_kwargs: Any,
    ) -> torch.Tensor | ModelOutput: ...
    # Read by cachelife (its source) to follow how beam sampling orders its draws; arguments differ by version.
    def _get_top_k_continuations(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]: ...
    def _prepare_special_tokens(
        self,
        generation_config: GenerationConfig,
        kwargs_has_attention_mask: bool | None = None,
        device: torch.device | str | None = None,
        batch_size: int | None = None,
    ) -> None: ...

# What `_sample` and `_beam_search` return with return_dict_in_generate=True; their fields are keyword
# arguments (`cache` in 5.24, `past_key_values` in 5.17), read by cachelife through dataclasses.fields.
class GenerateDecoderOnlyOutput(ModelOutput): ...
class GenerateEncoderDecoderOutput(ModelOutput): ...
class GenerateBeamDecoderOnlyOutput(ModelOutput): ...
class GenerateBeamEncoderDecoderOutput(ModelOutput): ...
