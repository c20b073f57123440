"""Small models built from configs in code (random weights, fixed seeds, no downloads).

The demo's embedded default, the tests and the benchmarks all build their models here, so a model named
the same is the same model everywhere. `build(name)` returns the model in eval mode and a function making
seeded inputs for `generate`.
"""

from __future__ import annotations

import importlib
import string
from collections.abc import Callable, Mapping
from typing import Any, Final

import torch
from attrs import frozen
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MarianConfig,
    MarianMTModel,
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


def left_padded(inputs: Inputs, pads: int, pad_token_id: int) -> Inputs:
    """One prompt of `inputs` (`input_ids`, batch 1) with its first `pads` tokens made padding, as a tokenizer
    with `padding=True` left-pads a shorter prompt: pad tokens and a mask of zeros there."""
    ids = inputs["input_ids"].clone()
    ids[:, :pads] = pad_token_id
    mask = torch.ones_like(ids)
    mask[:, :pads] = 0
    return {"input_ids": ids, "attention_mask": mask}


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


def marian_tiny() -> MarianConfig:
    """Marian with its translation checkpoints' conventions: the pad token (the last id) starts decoding."""
    return MarianConfig(
        vocab_size=320, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=256,
        pad_token_id=319, decoder_start_token_id=319, eos_token_id=0, forced_eos_token_id=0,
    )  # fmt: skip


def whisper_large_v3_shaped(*, decoder_layers: int = 32) -> WhisperConfig:
    """Shaped like whisper-large-v3's decoder (32 layers, d_model 1280, 20 heads, FFN 5120, vocab 51866, 1500
    encoder positions, 128 mel bins; `decoder_layers` for others of its family) with 2 encoder layers to keep it
    cheap: decoding reads only the encoder output, whose shape this keeps."""
    return WhisperConfig(
        vocab_size=51866, num_mel_bins=128, encoder_layers=2, decoder_layers=decoder_layers,
        encoder_attention_heads=20, decoder_attention_heads=20, d_model=1280, encoder_ffn_dim=5120,
        decoder_ffn_dim=5120, max_source_positions=1500, max_target_positions=448, decoder_start_token_id=50258,
        pad_token_id=50256, bos_token_id=50257, eos_token_id=50257, begin_suppress_tokens=None, suppress_tokens=None,
    )  # fmt: skip


def whisper_large_v3_turbo_shaped() -> WhisperConfig:
    """Shaped like whisper-large-v3-turbo: whisper-large-v3's shape with 4 decoder layers (its encoder, cut to 2
    layers here too, is large-v3's)."""
    return whisper_large_v3_shaped(decoder_layers=4)


def bart_large_cnn_shaped() -> BartConfig:
    """Shaped like bart-large-cnn: d_model 1024, 12+12 layers, 16 heads, FFN 4096, vocab 50264."""
    return BartConfig(
        vocab_size=50264, d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
        decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, max_position_embeddings=1024,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=0,
        forced_eos_token_id=2,
    )  # fmt: skip


def t5_base_shaped() -> T5Config:
    """Shaped like t5-base: d_model 768, 12+12 layers, 12 heads of 64, d_ff 3072, vocab 32128."""
    return T5Config(
        vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip


# Whisper's suppress list as whisper-large-v3's generation config ships it (88 ids).
WHISPER_V3_SUPPRESS_TOKENS: Final[tuple[int, ...]] = (
    1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60, 61, 62, 63, 90, 91, 92, 93, 359, 503, 522, 542,
    873, 893, 902, 918, 922, 931, 1350, 1853, 1982, 2460, 2627, 3246, 3253, 3268, 3536, 3846, 3961, 4183, 4667,
    6585, 6647, 7273, 9061, 9383, 10428, 10929, 11938, 12033, 12331, 12562, 13793, 14157, 14635, 15265, 15618,
    16553, 16604, 18362, 18956, 20075, 21675, 22520, 26130, 26161, 26435, 28279, 29464, 31650, 32302, 32470,
    36865, 42863, 47425, 49870, 50254, 50258, 50359, 50360, 50361, 50362, 50363,
)  # fmt: skip


def whisper_v3_generation(config: GenerationConfig) -> None:
    """whisper-large-v3's generation-config fields: suppress lists, language and task tokens (100 languages
    from 50259, translate 50359, transcribe 50360, no-timestamps 50364)."""
    languages = ("en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr")
    config.suppress_tokens = list(WHISPER_V3_SUPPRESS_TOKENS)
    config.begin_suppress_tokens = [220, 50257]
    _set_whisper_fields(
        config,
        lang_to_id={f"<|{code}|>": 50259 + index for index, code in enumerate(languages)},
        task_to_id={"translate": 50359, "transcribe": 50360},
        no_timestamps_token_id=50364,
    )
    config.max_length = 448


def whisper_tiny_generation(config: GenerationConfig) -> None:
    """The same fields for the tiny Whisper (vocab 300): languages 250-259, translate 260, transcribe 261,
    no-timestamps 262, a suppress list and begin-suppress [220, eos]."""
    config.suppress_tokens = [3, 7, 11, 40, 41, 97, 120, 131, 250, 251, 260, 261]
    config.begin_suppress_tokens = [220, 2]
    _set_whisper_fields(
        config,
        lang_to_id={f"<|{code}|>": 250 + index for index, code in enumerate(("en", "de", "fr"))},
        task_to_id={"translate": 260, "transcribe": 261},
        no_timestamps_token_id=262,
    )


def _set_whisper_fields(
    config: GenerationConfig, *, lang_to_id: dict[str, int], task_to_id: dict[str, int], no_timestamps_token_id: int
) -> None:
    """Fields Whisper checkpoints add to their plain `GenerationConfig` (not attributes of a fresh one)."""
    fields = {
        "lang_to_id": lang_to_id,
        "task_to_id": task_to_id,
        "is_multilingual": True,
        "no_timestamps_token_id": no_timestamps_token_id,
        "return_timestamps": False,
    }
    for name, value in fields.items():
        setattr(config, name, value)


def bart_cnn_generation(config: GenerationConfig) -> None:
    """bart-large-cnn's generation config: 4 beams, no-repeat 3, lengths 56-142, length penalty 2.0, early
    stopping, forced BOS 0 and EOS 2."""
    config.num_beams = 4
    config.no_repeat_ngram_size = 3
    config.min_length = 56
    config.max_length = 142
    config.length_penalty = 2.0
    config.early_stopping = True
    config.forced_bos_token_id = 0
    config.forced_eos_token_id = 2


def marian_generation(config: GenerationConfig) -> None:
    """Marian translation checkpoints' generation config: bad_words_ids [[pad]], 4 beams."""
    config.bad_words_ids = [[319]]
    config.num_beams = 4
    config.max_length = 64


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
    "marian": (marian_tiny, MarianMTModel),
    "whisper-large-v3": (whisper_large_v3_shaped, WhisperForConditionalGeneration),
    "whisper-large-v3-turbo": (whisper_large_v3_turbo_shaped, WhisperForConditionalGeneration),
    "bart-large-cnn": (bart_large_cnn_shaped, BartForConditionalGeneration),
    "t5-base": (t5_base_shaped, T5ForConditionalGeneration),
}

# Generation-config fields the real checkpoints ship, set on `model.generation_config` after building.
_GENERATION: Final[Mapping[str, Callable[[GenerationConfig], None]]] = {
    "marian": marian_generation,
    "whisper-large-v3": whisper_v3_generation,
    "whisper-large-v3-turbo": whisper_v3_generation,  # the same tokenizer and generation config
    "bart-large-cnn": bart_cnn_generation,
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
    if name in _GENERATION:
        _GENERATION[name](model.generation_config)
    if isinstance(config, WhisperConfig):
        return ZooModel(model, _whisper_inputs(model, config))
    return ZooModel(model, _token_inputs(model, int(config.vocab_size)))


def mixed_settings() -> list[dict[str, Any]]:
    """Everyday generation settings, one per request: greedy and sampling, penalties, suppressed tokens, minimum
    lengths, end tokens of their own, n-gram bans (the engine decodes them together, each as values in its row)."""
    return [
        {},
        {"repetition_penalty": 1.3},
        {"do_sample": True, "temperature": 0.7, "top_k": 0},
        {"do_sample": True, "temperature": 1.2, "top_k": 5},
        {"do_sample": True, "top_p": 0.8, "top_k": 0},
        {"do_sample": True, "min_p": 0.1, "top_k": 0, "repetition_penalty": 1.2},
        {"do_sample": True, "typical_p": 0.9, "top_k": 0},
        {"suppress_tokens": [3, 5, 7], "min_new_tokens": 4, "eos_token_id": [4, 9]},
        {"do_sample": True, "temperature": 0.9, "top_k": 20, "top_p": 0.95, "begin_suppress_tokens": [1, 2]},
        {"no_repeat_ngram_size": 2},
        {"do_sample": True, "temperature": 0.8, "top_k": 0, "no_repeat_ngram_size": 3, "repetition_penalty": 1.1},
    ]


def generate_tokens(model: PreTrainedModel, inputs: Inputs, **settings: Any) -> torch.Tensor:
    """`model.generate(**inputs, **settings)`, narrowed to the token tensor it returns by default."""
    output = model.generate(**inputs, **settings)
    if not isinstance(output, torch.Tensor):
        msg = f"generate returned a {type(output).__name__}; call it without return_dict_in_generate=True"
        raise UnsupportedGenerationError(msg)
    return output


def letters_tokenizer(vocab_size: int) -> Any:
    """A tokenizer for the zoo's token models: single letters, then `<i>` for every other id (for
    `stop_strings`, which need a tokenizer)."""
    vocab = {letter: index for index, letter in enumerate(string.ascii_lowercase)}
    vocab.update({f"<{index}>": index for index in range(len(vocab), vocab_size)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    # transformers' tokenizer classes are not described in typings/: reached through the module.
    return importlib.import_module("transformers").PreTrainedTokenizerFast(tokenizer_object=backend)


# The roles of a chat as words of `words_tokenizer`'s vocabulary, and its chat template: each turn its role's
# word, then its text; the assistant's word opens the answer.
_ROLE_WORDS: Final = {"system": "w5", "developer": "w5", "user": "w6", "assistant": "w7"}
_CHAT_TEMPLATE: Final = (
    "{% for message in messages %}{{ roles[message['role']] }} {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}{{ roles['assistant'] }}{% endif %}"
)


def words_tokenizer(vocab_size: int = 320) -> Any:
    """A word-level tokenizer for the zoo's tiny Llama: <pad> <s> </s> <unk> <mask>, then w5 ... w{vocab_size-1};
    a prompt starts with <s>. Its chat template writes each turn as its role's word (w5 system, w6 user, w7
    assistant) and its text."""
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]
    vocab = {token: i for i, token in enumerate(specials)} | {f"w{i}": i for i in range(5, vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = importlib.import_module("transformers").PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = "{% set roles = " + repr(_ROLE_WORDS) + " %}" + _CHAT_TEMPLATE
    return tokenizer


def whisper_tiny_processor() -> Any:
    """A processor for the tiny Whisper (`whisper_tiny_generation`'s tokens): 16 mel bins over a 1 s window at
    16 kHz (64 frames, its encoder's input), and a word-level tokenizer for its 300 ids, t0 ... t299, whose
    start, end, language and task ids are special."""
    transformers = importlib.import_module("transformers")
    extractor = transformers.WhisperFeatureExtractor(
        feature_size=16, sampling_rate=16000, hop_length=250, chunk_length=1
    )
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(300)}, unk_token="t3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3",
        extra_special_tokens=[f"t{i}" for i in range(250, 263)],
    )  # fmt: skip
    return transformers.WhisperProcessor(feature_extractor=extractor, tokenizer=fast)
