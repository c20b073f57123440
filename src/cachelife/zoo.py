"""Small models built from configs in code (random weights, fixed seeds, no downloads).

The demo's embedded default, the tests and the benchmarks all build their models here, so a model named
the same is the same model everywhere. `build(name)` returns the model in eval mode and a function making
seeded inputs for `generate`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import torch
from attrs import frozen
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    T5Config,
    T5ForConditionalGeneration,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

from cachelife.errors import InvalidArgumentError, UnsupportedGenerationError

# Keyword arguments for `generate`: tensors named as the model's forward names them.
Inputs = dict[str, Any]


@frozen
class ZooModel:
    """A model and how to make its inputs: `inputs(batch_size, length, seed)` on the model's device."""

    model: PreTrainedModel
    inputs: Callable[[int, int, int], Inputs]


def _token_inputs(model: PreTrainedModel, vocab_size: int) -> Callable[[int, int, int], Inputs]:
    def make(batch_size: int, length: int, seed: int) -> Inputs:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(5, vocab_size, (batch_size, length), generator=generator).to(model.device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    return make


def t5_tiny() -> T5Config:
    """The demo's embedded default: 2+2 layers, 4 heads of 16 (heads x d_kv == d_model)."""
    return T5Config(
        vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip


def t5_small_shaped() -> T5Config:
    """Shaped like t5-small, the model of the README's speed numbers: d_model 512, 6+6 layers, 8 heads, d_kv 64,
    vocab 32128."""
    return T5Config(
        vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip


def bart_tiny() -> BartConfig:
    """BART with different encoder and decoder head counts (8 and 4) and layer counts (3 and 2)."""
    return BartConfig(
        vocab_size=320, d_model=64, encoder_layers=3, decoder_layers=2, encoder_attention_heads=8,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=256,
    )  # fmt: skip


def bart_small() -> BartConfig:
    """A small BART on which transformers' compiled recipe fails (README, "Why"): d_model 256, 3+3 layers, 4 heads."""
    return BartConfig(
        vocab_size=1000, d_model=256, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=512, decoder_ffn_dim=512, max_position_embeddings=256,
    )  # fmt: skip


def whisper_tiny() -> WhisperConfig:
    """Whisper with 2+2 layers, 4 heads, 16 mel bins and 32 encoder positions (64 input frames)."""
    return WhisperConfig(
        vocab_size=300, num_mel_bins=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=32, max_target_positions=128, decoder_start_token_id=1, pad_token_id=0,
        eos_token_id=2, begin_suppress_tokens=None, suppress_tokens=None,
    )  # fmt: skip


def whisper_small() -> WhisperConfig:
    """A small Whisper on which transformers' compiled recipe fails (README, "Why"): d_model 256, 2+2 layers, 4
    heads, 80 mel bins, 64 positions, with Whisper's real 448 decoder positions so that 192 new tokens fit."""
    return WhisperConfig(
        vocab_size=1000, num_mel_bins=80, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, d_model=256, encoder_ffn_dim=512, decoder_ffn_dim=512,
        max_source_positions=64, max_target_positions=448, decoder_start_token_id=1, pad_token_id=0,
        eos_token_id=2, begin_suppress_tokens=None, suppress_tokens=None,
    )  # fmt: skip


def llama_tiny() -> LlamaConfig:
    """A Llama-shaped decoder with grouped-query attention (4 heads, 2 key/value heads)."""
    return LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def llama_small() -> LlamaConfig:
    """A small Llama on which transformers' compiled recipe fails (README, "Why"): hidden 256, 4 layers, 4 heads,
    2 key/value heads."""
    return LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def _whisper_inputs(model: PreTrainedModel, config: WhisperConfig) -> Callable[[int, int, int], Inputs]:
    def make(batch_size: int, length: int, seed: int) -> Inputs:
        # Whisper's encoder takes exactly 2 * max_source_positions frames; `length` does not apply.
        frames = 2 * config.max_source_positions
        generator = torch.Generator().manual_seed(seed)
        features = torch.randn(batch_size, config.num_mel_bins, frames, generator=generator)
        return {"input_features": features.to(model.device, model.dtype)}

    return make


_ZOO: Final[Mapping[str, tuple[Callable[[], PreTrainedConfig], type[PreTrainedModel]]]] = {
    "t5": (t5_tiny, T5ForConditionalGeneration),
    "t5-small": (t5_small_shaped, T5ForConditionalGeneration),
    "bart": (bart_tiny, BartForConditionalGeneration),
    "bart-small": (bart_small, BartForConditionalGeneration),
    "whisper": (whisper_tiny, WhisperForConditionalGeneration),
    "whisper-small": (whisper_small, WhisperForConditionalGeneration),
    "llama": (llama_tiny, LlamaForCausalLM),
    "llama-small": (llama_small, LlamaForCausalLM),
}

MODEL_NAMES: Final[tuple[str, ...]] = tuple(_ZOO)


def build(
    name: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> ZooModel:
    """Build the named model with seeded random weights, in eval mode, on `device` in `dtype`."""
    if name not in _ZOO:
        msg = f"unknown zoo model {name!r}; choose one of {', '.join(MODEL_NAMES)}"
        raise InvalidArgumentError(msg)
    make_config, model_class = _ZOO[name]
    config = make_config()
    torch.manual_seed(seed)
    model = model_class(config).to(device=device, dtype=dtype).eval()
    if isinstance(config, WhisperConfig):
        return ZooModel(model, _whisper_inputs(model, config))
    return ZooModel(model, _token_inputs(model, int(config.vocab_size)))


def generate_tokens(model: PreTrainedModel, inputs: Inputs, **settings: Any) -> torch.Tensor:
    """`model.generate(**inputs, **settings)`, narrowed to the token tensor it returns by default."""
    output = model.generate(**inputs, **settings)
    if not isinstance(output, torch.Tensor):
        msg = f"generate returned a {type(output).__name__}; call it without return_dict_in_generate=True"
        raise UnsupportedGenerationError(msg)
    return output
