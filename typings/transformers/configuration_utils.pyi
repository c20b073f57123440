# transformers.configuration_utils, as checked against 5.17.0, 5.23.0 and 5.24.0.
from typing import Any

class PreTrainedConfig:
    model_type: str
    is_encoder_decoder: bool
    def __init__(self, **kwargs: Any) -> None: ...
    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> PreTrainedConfig: ...
    def __getattr__(self, name: str) -> Any: ...

PretrainedConfig = PreTrainedConfig
