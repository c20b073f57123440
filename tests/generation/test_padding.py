"""Left-padded prompts of decoder-only models on the fast path: tokens equal `model.generate`'s for full
attention, sliding windows and grouped-query attention (Llama, Qwen2, Mistral, Gemma-2, GPT-2 and OPT shapes),
greedy, beams with several returned sequences, and a mask passed or inferred from the pad token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import cachelife
from cachelife.errors import UnsupportedGenerationError

VOCAB = 200
PAD = 0
SMALL: dict[str, Any] = {"vocab_size": VOCAB, "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2}
GQA: dict[str, Any] = {
    **SMALL, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256,
}  # fmt: skip

MODELS: dict[str, Callable[[], PreTrainedModel]] = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**GQA)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**GQA)),
    # Windows longer than these calls write; the eager step also decodes past a window (tested below).
    "mistral-sliding": lambda: MistralForCausalLM(MistralConfig(**GQA, sliding_window=40)),
    "gemma2-sliding": lambda: Gemma2ForCausalLM(
        Gemma2Config(**GQA, head_dim=16, sliding_window=40, layer_types=["sliding_attention", "full_attention"])
    ),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(**SMALL, n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    "opt": lambda: OPTForCausalLM(
        OPTConfig(
            **SMALL,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=64,
        )
    ),
}


def build(name: str) -> PreTrainedModel:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None  # every row decodes its whole budget: more positions compared
    return model


def left_padded(rows: int = 3, length: int = 12, seed: int = 1) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    for row, pads in enumerate((0, 5, 9)[:rows]):
        ids[row, :pads] = PAD
        mask[row, :pads] = 0
    return {"input_ids": ids, "attention_mask": mask}


def fast(model: PreTrainedModel, inputs: dict[str, Any], **settings: Any) -> torch.Tensor:
    out = cachelife.generate(model, fallback=False, compile_step=False, **inputs, **settings)
    assert isinstance(out, torch.Tensor)
    return out


def generate(model: PreTrainedModel, inputs: dict[str, Any], **settings: Any) -> torch.Tensor:
    out = model.generate(**inputs, **settings)
    assert isinstance(out, torch.Tensor)
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_left_padded_greedy_equals_generate(name: str) -> None:
    model = build(name)
    inputs = left_padded()
    expected = generate(model, inputs, max_new_tokens=16)
    assert torch.equal(fast(model, inputs, max_new_tokens=16), expected)
    # the padding matters: the same prompts decoded one by one, unpadded, give the same rows
    for row, pads in enumerate((0, 5, 9)):
        alone = {"input_ids": inputs["input_ids"][row : row + 1, pads:]}
        assert torch.equal(generate(model, alone, max_new_tokens=16)[0, -16:], expected[row, -16:]), row


@pytest.mark.parametrize("name", ["llama", "mistral-sliding", "gpt2"])
def test_left_padded_beam_search_with_several_returned_sequences_equals_generate(name: str) -> None:
    model = build(name)
    inputs = left_padded()
    settings: dict[str, Any] = {"max_new_tokens": 10, "num_beams": 3, "num_return_sequences": 2}
    assert torch.equal(fast(model, inputs, **settings), generate(model, inputs, **settings))


def test_a_mask_inferred_from_the_pad_token_is_decoded_like_a_passed_one() -> None:
    model = build("llama")
    inputs = left_padded()
    expected = generate(model, inputs, max_new_tokens=16)
    assert torch.equal(fast(model, {"input_ids": inputs["input_ids"]}, max_new_tokens=16), expected)


def test_left_padded_sampling_with_one_candidate_is_greedy_and_draws_are_reproducible() -> None:
    model = build("qwen2")
    inputs = left_padded()

    def sample(seed: int, **warp: Any) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return fast(model, inputs, max_new_tokens=12, do_sample=True, generator=generator, **warp)

    assert torch.equal(sample(0, top_k=1), generate(model, inputs, max_new_tokens=12))
    assert torch.equal(sample(3, top_k=0), sample(3, top_k=0))


def test_several_steps_per_call_and_rare_checks_keep_left_padded_positions() -> None:
    model = build("llama")
    inputs = left_padded()
    expected = generate(model, inputs, max_new_tokens=13)
    assert torch.equal(fast(model, inputs, max_new_tokens=13, steps_per_call=3, stop_check_every=5), expected)


def test_right_padded_prompts_are_refused_by_name() -> None:
    model = build("llama")
    inputs = left_padded()
    inputs["input_ids"] = inputs["input_ids"].flip(-1)
    inputs["attention_mask"] = inputs["attention_mask"].flip(-1)
    with pytest.raises(UnsupportedGenerationError, match="right-padded prompts"):
        fast(model, inputs, max_new_tokens=4)


@pytest.mark.parametrize("padded", [True, False])
def test_the_eager_step_decodes_past_a_sliding_window(padded: bool) -> None:
    model = MistralForCausalLM(MistralConfig(**GQA, sliding_window=8)).eval()
    model.generation_config.pad_token_id = PAD
    inputs = left_padded() if padded else {"input_ids": left_padded()["input_ids"][:, 9:]}
    assert torch.equal(fast(model, inputs, max_new_tokens=16), generate(model, inputs, max_new_tokens=16))


def test_a_compiled_step_over_sliding_window_layers_is_left_to_transformers() -> None:
    model = build("mistral-sliding")
    inputs = left_padded()
    with pytest.raises(UnsupportedGenerationError, match="sliding-window attention in a compiled step"):
        cachelife.generate(model, fallback=False, **inputs, max_new_tokens=4)


@pytest.mark.slow
def test_the_compiled_step_keeps_left_padded_positions() -> None:
    torch._dynamo.reset()
    model = cachelife.enable(build("qwen2"))
    inputs = left_padded()
    expected = generate(model, inputs, max_new_tokens=16)
    for _ in range(2):
        got = cachelife.generate(model, fallback=False, **inputs, max_new_tokens=16)
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, expected)
