# transformers.modeling_utils, as checked against 5.17.0, 5.23.0, 5.24.0 and 5.25.0.
import os
from collections.abc import Callable
from typing import Any

from typing_extensions import Self

import torch
from transformers.configuration_utils import PreTrainedConfig
from transformers.generation.configuration_utils import CompileConfig, GenerationConfig
from transformers.generation.utils import GenerationMixin

class PreTrainedModel(torch.nn.Module, GenerationMixin):
    config: PreTrainedConfig
    generation_config: GenerationConfig
    def __init__(self, config: PreTrainedConfig, *inputs: Any, **kwargs: Any) -> None: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike[str], *model_args: Any, **kwargs: Any
    ) -> Self: ...
    def save_pretrained(self, save_directory: str | os.PathLike[str], **kwargs: Any) -> None: ...
    def get_encoder(self) -> torch.nn.Module: ...
    def get_decoder(self) -> torch.nn.Module: ...
    def get_compiled_call(self, compile_config: CompileConfig | None) -> Callable[..., Any]: ...
    # Whether the class's attention goes through AttentionInterface (transformers reads the module's source).
    @classmethod
    def _can_set_attn_implementation(cls) -> bool: ...
    def set_attn_implementation(
        self, attn_implementation: str | dict[str, str], allow_all_kernels: bool = False
    ) -> None: ...
    def forward(self, *args: Any, **kwargs: Any) -> Any: ...

# A mapping from implementation names to attention functions; `register` adds one for every model.
class AttentionInterface:
    @classmethod
    def register(cls, key: str, value: Callable[..., Any]) -> None: ...
