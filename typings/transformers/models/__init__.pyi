# Model families cachelife's zoo, tests and benchmarks build (transformers 5.17.0 - 5.24.0).
from typing import Any

from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_utils import PreTrainedModel

class T5Config(PreTrainedConfig):
    def __init__(self, **kwargs: Any) -> None: ...

class T5ForConditionalGeneration(PreTrainedModel): ...

class BartConfig(PreTrainedConfig):
    def __init__(self, **kwargs: Any) -> None: ...

class BartForConditionalGeneration(PreTrainedModel): ...

class WhisperConfig(PreTrainedConfig):
    max_source_positions: int
    num_mel_bins: int
    def __init__(self, **kwargs: Any) -> None: ...

class WhisperForConditionalGeneration(PreTrainedModel): ...

class LlamaConfig(PreTrainedConfig):
    def __init__(self, **kwargs: Any) -> None: ...

class LlamaForCausalLM(PreTrainedModel): ...
