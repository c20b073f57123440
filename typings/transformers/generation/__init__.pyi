from transformers.generation.configuration_utils import (
    CompileConfig as CompileConfig,
    GenerationConfig as GenerationConfig,
)
from transformers.generation.utils import GenerationMixin as GenerationMixin
