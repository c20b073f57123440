"""The stubs in typings/ describe the installed transformers: every class and member they name exists."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import torch
import transformers
from transformers.cache_utils import EncoderDecoderCache, StaticCache, StaticSlidingWindowLayer
from transformers.generation.utils import GenerationMixin

from cachelife import zoo

STUBS = Path(__file__).resolve().parents[1] / "typings" / "transformers"
# Instance attributes set in __init__ (checked on an instance below) rather than on the class.
INSTANCE_ONLY = {"keys", "values", "is_initialized", "max_cache_len", "cumulative_length", "cumulative_length_int",
                 "layers", "self_attention_cache", "cross_attention_cache", "is_updated", "config",
                 "generation_config", "model_type", "is_encoder_decoder", "fullgraph", "dynamic", "backend", "mode",
                 "num_beams", "num_return_sequences", "cache_implementation", "compile_config", "disable_compile",
                 "max_length", "max_source_positions", "num_mel_bins", "eos_token_id", "pad_token_id",
                 "decoder_start_token_id", "forced_eos_token_id", "no_repeat_ngram_size"} | {
    # GenerationConfig fields cachelife.generate reads or the zoo sets (checked on instances below).
    "do_sample", "min_length", "min_new_tokens", "max_new_tokens", "forced_bos_token_id", "bad_words_ids",
    "suppress_tokens", "begin_suppress_tokens", "repetition_penalty", "temperature", "top_k", "top_p",
    "early_stopping", "length_penalty", "_eos_token_tensor", "_pad_token_tensor",
    "lang_to_id", "task_to_id", "is_multilingual", "no_timestamps_token_id", "return_timestamps",
}  # fmt: skip


def stub_members() -> list[tuple[str, str, str]]:
    found = []
    for path in sorted(STUBS.rglob("*.pyi")):
        module = "transformers." + ".".join(path.relative_to(STUBS).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AnnAssign):
                        name = item.name if isinstance(item, ast.FunctionDef) else ast.unparse(item.target)
                        found.append((module, node.name, name))
                found.append((module, node.name, ""))
    return found


@pytest.mark.parametrize(("module", "cls", "member"), stub_members())
def test_stubbed_member_exists(module: str, cls: str, member: str) -> None:
    owner = getattr(importlib.import_module(module), cls)
    if member and member not in INSTANCE_ONLY and not member.startswith("__"):
        assert hasattr(owner, member), f"{module}.{cls}.{member} is in the stubs but not in transformers"


def test_instance_attributes_exist() -> None:
    config = zoo.t5_tiny()
    cache = EncoderDecoderCache(
        StaticCache(config=config, max_cache_len=4), StaticCache(config=config, max_cache_len=3)
    )
    for name in ("self_attention_cache", "cross_attention_cache", "is_updated"):
        assert hasattr(cache, name)
    assert not hasattr(cache, "layers")  # hence the stubs give `layers` to StaticCache and DynamicCache only
    assert hasattr(cache.self_attention_cache, "layers")
    layer = StaticSlidingWindowLayer(max_cache_len=8, sliding_window=4)
    for name in ("keys", "values", "is_initialized", "max_cache_len", "cumulative_length", "cumulative_length_int"):
        assert hasattr(layer, name)
    generation = transformers.GenerationConfig()
    for name in (
        "num_beams", "num_return_sequences", "cache_implementation", "compile_config", "disable_compile",
        "eos_token_id", "pad_token_id", "decoder_start_token_id", "forced_eos_token_id", "no_repeat_ngram_size",
    ):  # fmt: skip
        assert hasattr(generation, name), name
    for name in (
        "do_sample", "min_length", "min_new_tokens", "max_new_tokens", "forced_bos_token_id", "bad_words_ids",
        "suppress_tokens", "begin_suppress_tokens", "repetition_penalty", "temperature", "top_k", "top_p",
        "early_stopping", "length_penalty",
    ):  # fmt: skip
        assert hasattr(generation, name), name
    # Set by GenerationMixin._prepare_special_tokens inside generate; Whisper's fields by its checkpoints.
    whisper = zoo.build("whisper").model
    whisper._prepare_special_tokens(whisper.generation_config, False, device=torch.device("cpu"))
    for name in ("_eos_token_tensor", "_pad_token_tensor"):
        assert hasattr(whisper.generation_config, name), name
    zoo.whisper_tiny_generation(whisper.generation_config)
    for name in ("lang_to_id", "task_to_id", "is_multilingual", "no_timestamps_token_id", "return_timestamps"):
        assert hasattr(whisper.generation_config, name), name


def test_the_documented_signature_of_prepare_cache_for_generation() -> None:
    parameters = list(inspect.signature(GenerationMixin._prepare_cache_for_generation).parameters)
    assert parameters == [
        "self",
        "generation_config",
        "model_kwargs",
        "generation_mode",
        "batch_size",
        "max_cache_length",
    ]
