"""Shape inference against the shapes real models write: one eager forward per family, every layer compared.

Each case builds a tiny model from a config chosen to expose wrong rules: encoder and decoder head counts
that differ, grouped-query attention, explicit head dims, heads x head_dim != hidden size, sliding-window
decoder layers, cross-attention shaped unlike self-attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

import cachelife
from cachelife.core.shapes import CacheShapes, LayerShape, infer_cache_shapes
from cachelife.errors import CacheShapeError, UnsupportedCacheError

B, ENCODER_LENGTH, DECODER_LENGTH, VOCAB = 2, 7, 3, 99
Case = Callable[[], tuple[Any, dict[str, Any]]]


def tf(name: str) -> Any:
    """A transformers class by name (the tests reach many families the stubs need not describe)."""
    return getattr(transformers, name)


def ids(length: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(4, vocab, (B, length), generator=torch.Generator().manual_seed(length))


def text_to_text(model: Any) -> tuple[Any, dict[str, Any]]:
    source = ids(ENCODER_LENGTH)
    return model, {"input_ids": source, "attention_mask": torch.ones_like(source), "decoder_input_ids": ids(3)}


def t5() -> tuple[Any, dict[str, Any]]:
    config = tf("T5Config")(
        vocab_size=VOCAB, d_model=32, d_kv=12, d_ff=40, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return text_to_text(tf("T5ForConditionalGeneration")(config))


def switch_transformers() -> tuple[Any, dict[str, Any]]:
    config = tf("SwitchTransformersConfig")(
        vocab_size=VOCAB, d_model=32, d_kv=12, d_ff=40, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=2, expert_capacity=8,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model, inputs = text_to_text(tf("SwitchTransformersForConditionalGeneration")(config))
    # An explicit use_cache=True reaches Switch's encoder stack, which refuses it; the decoder caches anyway.
    return model, {**inputs, "use_cache": None}


def bart_like(config_name: str, model_name: str) -> Case:
    def build() -> tuple[Any, dict[str, Any]]:
        config = tf(config_name)(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=8,
            decoder_attention_heads=2, encoder_ffn_dim=40, decoder_ffn_dim=40, max_position_embeddings=64,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        )  # fmt: skip
        return text_to_text(tf(model_name)(config))

    return build


def whisper() -> tuple[Any, dict[str, Any]]:
    config = tf("WhisperConfig")(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=8,
        decoder_attention_heads=2, encoder_ffn_dim=40, decoder_ffn_dim=40, num_mel_bins=8,
        max_source_positions=ENCODER_LENGTH, max_target_positions=32, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=3, suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    features = torch.randn(B, 8, 2 * ENCODER_LENGTH)
    return tf("WhisperForConditionalGeneration")(config), {"input_features": features, "decoder_input_ids": ids(3)}


def speech_to_text() -> tuple[Any, dict[str, Any]]:
    config = tf("Speech2TextConfig")(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=8,
        decoder_attention_heads=2, encoder_ffn_dim=40, decoder_ffn_dim=40, input_feat_per_channel=8, input_channels=1,
        conv_channels=16, conv_kernel_sizes=[5, 5], num_conv_layers=2, max_source_positions=64,
        max_target_positions=32, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    )  # fmt: skip
    features = torch.randn(B, 4 * ENCODER_LENGTH, 8)
    return tf("Speech2TextForConditionalGeneration")(config), {
        "input_features": features,
        "attention_mask": torch.ones(B, 4 * ENCODER_LENGTH, dtype=torch.long),
        "decoder_input_ids": ids(3),
    }


def t5gemma() -> tuple[Any, dict[str, Any]]:
    module_config = tf("T5GemmaModuleConfig")
    encoder = module_config(
        vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=6, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64,
    )  # fmt: skip
    decoder = module_config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=10, sliding_window=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=64,
    )  # fmt: skip
    config = tf("T5GemmaConfig")(
        encoder=encoder, decoder=decoder, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1,
    )  # fmt: skip
    return text_to_text(tf("T5GemmaForConditionalGeneration")(config))


def dia() -> tuple[Any, dict[str, Any]]:
    encoder = {
        "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "head_dim": 6, "vocab_size": 256, "max_position_embeddings": 64,
    }  # fmt: skip
    decoder = {
        "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 10, "cross_num_attention_heads": 4, "cross_head_dim": 7,
        "cross_num_key_value_heads": 1, "cross_hidden_size": 24, "vocab_size": 40, "num_channels": 2,
        "max_position_embeddings": 64, "pad_token_id": 37, "eos_token_id": 36, "bos_token_id": 38,
    }  # fmt: skip
    config = tf("DiaConfig")(
        encoder_config=encoder, decoder_config=decoder, delay_pattern=[0, 1], pad_token_id=37, eos_token_id=36,
        bos_token_id=38,
    )  # fmt: skip
    source = ids(ENCODER_LENGTH, 256)
    decoder_ids = torch.randint(0, 36, (B, 3, 2), generator=torch.Generator().manual_seed(5))
    return tf("DiaForConditionalGeneration")(config), {
        "input_ids": source,
        "attention_mask": torch.ones_like(source),
        "decoder_input_ids": decoder_ids,
    }


def moonshine() -> tuple[Any, dict[str, Any]]:
    # Moonshine's attention writes its head counts back into the shared config while the model is built;
    # inference reads the built model's config, which then describes what the decoder really caches.
    config = tf("MoonshineConfig")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, encoder_num_hidden_layers=2,
        decoder_num_hidden_layers=3, encoder_num_attention_heads=8, decoder_num_attention_heads=4,
        encoder_num_key_value_heads=8, decoder_num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, max_position_embeddings=64,
    )  # fmt: skip
    audio = torch.randn(B, 2000, generator=torch.Generator().manual_seed(2))
    return tf("MoonshineForConditionalGeneration")(config), {"input_values": audio, "decoder_input_ids": ids(3)}


def trocr() -> tuple[Any, dict[str, Any]]:
    encoder = tf("ViTModel")(
        tf("ViTConfig")(
            hidden_size=24, num_hidden_layers=1, num_attention_heads=4, intermediate_size=40, image_size=16,
            patch_size=4,
        ),
        add_pooling_layer=False,
    )  # fmt: skip
    decoder = tf("TrOCRForCausalLM")(
        tf("TrOCRConfig")(
            vocab_size=VOCAB, d_model=32, decoder_layers=3, decoder_attention_heads=2, decoder_ffn_dim=40,
            max_position_embeddings=64, cross_attention_hidden_size=24, pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=2,
        )
    )  # fmt: skip
    model = tf("VisionEncoderDecoderModel")(encoder=encoder, decoder=decoder)
    return model, {"pixel_values": torch.randn(B, 3, 16, 16), "decoder_input_ids": ids(3)}


def bert2bert() -> tuple[Any, dict[str, Any]]:
    def bert(**extra: Any) -> Any:
        settings = {
            "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 40, "max_position_embeddings": 64,
        }  # fmt: skip
        return tf("BertConfig")(**{**settings, **extra})

    decoder = bert(is_decoder=True, add_cross_attention=True, num_attention_heads=2, num_hidden_layers=3)
    config = tf("EncoderDecoderConfig").from_encoder_decoder_configs(bert(), decoder)
    config.decoder_start_token_id, config.pad_token_id = 2, 0
    return text_to_text(tf("EncoderDecoderModel")(config=config))


def decoder_only(config_name: str, model_name: str, **extra: Any) -> Case:
    def build() -> tuple[Any, dict[str, Any]]:
        config = tf(config_name)(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=64, **extra,
        )  # fmt: skip
        return tf(model_name)(config), {"input_ids": ids(5)}

    return build


CASES: dict[str, Case] = {
    "t5": t5,
    "switch_transformers": switch_transformers,
    "bart": bart_like("BartConfig", "BartForConditionalGeneration"),
    "marian": bart_like("MarianConfig", "MarianMTModel"),
    "m2m_100": bart_like("M2M100Config", "M2M100ForConditionalGeneration"),
    "pegasus": bart_like("PegasusConfig", "PegasusForConditionalGeneration"),
    "whisper": whisper,
    "speech_to_text": speech_to_text,
    "t5gemma": t5gemma,
    "dia": dia,
    "moonshine": moonshine,
    "vision-encoder-decoder (trocr)": trocr,
    "encoder-decoder (bert2bert)": bert2bert,
    "llama (GQA)": decoder_only("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2),
    "qwen3 (explicit head_dim)": decoder_only("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=24),
    "mistral (sliding window)": decoder_only(
        "MistralConfig", "MistralForCausalLM", num_key_value_heads=1, sliding_window=3
    ),
    "gemma2 (hybrid sliding)": decoder_only(
        "Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=2, head_dim=12, sliding_window=3
    ),
    "deepseek_v3 (latent attention: key and value dims differ)": decoder_only(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    "minicpm3 (latent attention)": decoder_only(
        "MiniCPM3Config",
        "MiniCPM3ForCausalLM",
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
    ),
}


def observed_shapes(model: Any, inputs: dict[str, Any]) -> CacheShapes:
    """Run one eager forward and read (kv heads, key dim, value dim) from every layer the model wrote."""
    with torch.no_grad():
        output = model(**{"use_cache": True, **inputs})
    cache = output.get("cache", output.get("past_key_values"))

    def read(layers: list[Any]) -> tuple[LayerShape, ...]:
        return tuple(LayerShape(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1]) for layer in layers)

    if isinstance(cache, EncoderDecoderCache):
        own, cross = cache.self_attention_cache, cache.cross_attention_cache
        assert isinstance(own, DynamicCache)
        assert isinstance(cross, DynamicCache)
        return CacheShapes(read(own.layers), read(cross.layers))
    return CacheShapes(read(cache.layers))


@pytest.mark.parametrize("family", list(CASES))
def test_inferred_shapes_equal_the_shapes_the_model_writes(family: str) -> None:
    torch.manual_seed(0)
    model, inputs = CASES[family]()
    model.eval()
    assert cachelife.model_cache_shapes(model) == observed_shapes(model, inputs)


def test_every_encoder_decoder_case_really_exposes_a_rule() -> None:
    # Guard against cases that would pass with a naive rule: encoder heads must differ from what is cached.
    torch.manual_seed(0)
    model, inputs = CASES["bart"]()
    shapes = observed_shapes(model.eval(), inputs)
    assert model.config.num_attention_heads == 8  # the alias points at the encoder...
    assert {shape.num_kv_heads for shape in shapes.self_attention} == {2}  # ...but the decoder caches 2 heads


def test_declared_protocol_shape_values_are_checked() -> None:
    with pytest.raises(CacheShapeError, match="num_kv_heads must be a positive int, got 0"):
        LayerShape(0, 8, 8)
    with pytest.raises(CacheShapeError, match="key_head_dim must be a positive int"):
        LayerShape(2, True, 8)


def test_unknown_encoder_decoder_family_is_refused_with_the_fix() -> None:
    config = tf("BartConfig")()
    config.model_type = "not-a-known-family"
    with pytest.raises(UnsupportedCacheError, match="cachelife_cache_shapes"):
        infer_cache_shapes(config)


def test_missing_attributes_name_what_was_looked_for() -> None:
    config = tf("BartConfig")()
    config.decoder_layers = None
    with pytest.raises(CacheShapeError, match="sets none of decoder_layers"):
        infer_cache_shapes(config)
