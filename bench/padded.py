"""The Llama-shaped models the benchmarks build (seeded random weights) and their left-padded prompts.

`llama-3.2-1b` is shaped like Llama-3.2-1B, `tiny` is the same family at toy sizes (a CPU run in seconds), and
the zoo's `llama` and `llama-small` come from `cachelife.tools.zoo`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from cachelife.tools import zoo


def llama_3_2_1b_shaped() -> LlamaConfig:
    """Shaped like Llama-3.2-1B: 16 layers, hidden 2048, MLP 8192, 32 heads of 64 with 8 key/value heads,
    vocab 128256, rope theta 500000 with its llama3 scaling, tied embeddings; its special tokens (begin 128000,
    end 128001) and the pad token its tokenizer ships (128004)."""
    rope = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "high_freq_factor": 4.0,
        "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
    }  # fmt: skip
    return LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=rope, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
        pad_token_id=128004,
    )  # fmt: skip


def llama_3_2_tiny() -> LlamaConfig:
    """The same family at toy sizes: 2 layers, hidden 64, 4 heads of 16 with 1 key/value head (the 4:1 grouping
    of the 1B shape), rope theta 500000, tied embeddings, vocab 512."""
    return LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


CONFIGS: Final[dict[str, Callable[[], LlamaConfig]]] = {"llama-3.2-1b": llama_3_2_1b_shaped, "tiny": llama_3_2_tiny}
ZOO_MODELS: Final[tuple[str, ...]] = ("llama", "llama-small")
MODEL_NAMES: Final[tuple[str, ...]] = (*CONFIGS, *ZOO_MODELS)


def build_model(model_name: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> PreTrainedModel:
    """The named model in eval mode with seeded random weights (initialised on `device`, then cast to `dtype`),
    its generation config holding the config's special tokens. Zoo names build the zoo's model."""
    if model_name in ZOO_MODELS:
        return zoo.build(model_name, device=device, dtype=dtype, seed=seed).model
    config = CONFIGS[model_name]()
    torch.manual_seed(seed)
    with torch.device(device):
        model: PreTrainedModel = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).eval()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, name, getattr(config, name))
    return model


def spread_lengths(batch: int, shortest: int, longest: int) -> list[int]:
    """`batch` prompt lengths spread evenly from `shortest` to `longest`."""
    return [int(length) for length in torch.linspace(shortest, longest, batch).round().tolist()]


def padded_prompts(model: PreTrainedModel, lengths: list[int], seed: int = 0) -> zoo.Inputs:
    """Random token ids (none of the special tokens) of the given lengths, left-padded with the pad token to the
    longest, and their attention mask (0 on the padding), on the model's device."""
    config = model.config
    pad = int(config.pad_token_id)
    specials = [token for token in (config.bos_token_id, config.eos_token_id, pad) if isinstance(token, int)]
    high = min((token for token in specials if token >= 5), default=int(config.vocab_size))
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(5, high, (length,), generator=generator)
        mask[row, width - length :] = 1
    return {"input_ids": ids.to(model.device), "attention_mask": mask.to(model.device)}
