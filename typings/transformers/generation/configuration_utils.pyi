# transformers.generation.configuration_utils, as checked against 5.17.0, 5.23.0, 5.24.0 and 5.25.0.
from enum import Enum
from typing import Any

import torch

class GenerationMode(str, Enum):
    GREEDY_SEARCH = "greedy_search"
    SAMPLE = "sample"
    BEAM_SEARCH = "beam_search"
    BEAM_SAMPLE = "beam_sample"
    ASSISTED_GENERATION = "assisted_generation"

class CompileConfig:
    fullgraph: bool
    dynamic: bool | None
    backend: str
    mode: str
    # Class attribute transformers reads to allow auto-compilation on devices other than CUDA.
    _compile_all_devices: bool | None
    def __init__(
        self,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        backend: str = "inductor",
        mode: str = "reduce-overhead",
        options: dict[str, Any] | None = None,
    ) -> None: ...

class GenerationConfig:
    # None on a fresh GenerationConfig (5.17 and 5.24): generate then uses its own default.
    num_beams: int | None
    num_return_sequences: int | None
    cache_implementation: str | None
    compile_config: CompileConfig | None
    disable_compile: bool | None
    max_length: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    decoder_start_token_id: int | list[int] | None
    forced_eos_token_id: int | list[int] | None
    no_repeat_ngram_size: int | None
    do_sample: bool | None
    min_length: int | None
    min_new_tokens: int | None
    max_new_tokens: int | None
    forced_bos_token_id: int | None
    bad_words_ids: list[list[int]] | None
    suppress_tokens: list[int] | None
    begin_suppress_tokens: list[int] | None
    repetition_penalty: float | None
    temperature: float | None
    top_k: int | None
    top_p: float | None
    early_stopping: bool | str | None
    length_penalty: float | None
    # Whisper checkpoints' fields (lang_to_id, task_to_id, no_timestamps_token_id, ...) and the special-token
    # tensors generate sets (_eos_token_tensor, _pad_token_tensor) are not on a fresh GenerationConfig: they
    # are read and written through getattr / setattr.
    def get_generation_mode(self, assistant_model: Any = None) -> GenerationMode: ...
    def __init__(self, **kwargs: Any) -> None: ...
