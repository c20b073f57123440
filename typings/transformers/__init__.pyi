# Stubs for the parts of transformers that cachelife, its tests and benchmarks use.
# Checked against transformers 5.17.0, 5.23.0, 5.24.0 and 5.25.0; tests/test_stubs.py compares every declaration
# here with the installed transformers (signatures, attribute types, bases, re-exports) on 5.17.0 and 5.25.0.
from transformers.cache_utils import (
    Cache as Cache,
    DynamicCache as DynamicCache,
    EncoderDecoderCache as EncoderDecoderCache,
    StaticCache as StaticCache,
)
from transformers.configuration_utils import PreTrainedConfig as PreTrainedConfig
from transformers.distributed import DistributedConfig as DistributedConfig
from transformers.generation.configuration_utils import (
    CompileConfig as CompileConfig,
    GenerationConfig as GenerationConfig,
)
from transformers.modeling_utils import PreTrainedModel as PreTrainedModel
from transformers.models import (
    BartConfig as BartConfig,
    BartForConditionalGeneration as BartForConditionalGeneration,
    Gemma2Config as Gemma2Config,
    Gemma2ForCausalLM as Gemma2ForCausalLM,
    GPT2Config as GPT2Config,
    GPT2LMHeadModel as GPT2LMHeadModel,
    LlamaConfig as LlamaConfig,
    LlamaForCausalLM as LlamaForCausalLM,
    MarianConfig as MarianConfig,
    MarianMTModel as MarianMTModel,
    MistralConfig as MistralConfig,
    MistralForCausalLM as MistralForCausalLM,
    OPTConfig as OPTConfig,
    OPTForCausalLM as OPTForCausalLM,
    Qwen2Config as Qwen2Config,
    Qwen2ForCausalLM as Qwen2ForCausalLM,
    T5Config as T5Config,
    T5ForConditionalGeneration as T5ForConditionalGeneration,
    WhisperConfig as WhisperConfig,
    WhisperForConditionalGeneration as WhisperForConditionalGeneration,
)

__version__: str
