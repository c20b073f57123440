"""Zoo models for the benchmarks that time `cachelife.decode`'s step.

`cachelife.decode` refuses generation configs whose logits processors it does not apply, and the zoo's
real-checkpoint shapes (whisper-large-v3) ship such a config, so these benchmarks cut it to what decode runs,
and take fixed lengths: every call decodes exactly the tokens it asks for.
"""

from __future__ import annotations

import torch

from cachelife.tools import zoo


def for_decode(name: str, device: torch.device, dtype: torch.dtype) -> zoo.ZooModel:
    """The zoo model `name`, without an end token, suppress lists or forced end token."""
    built = zoo.build(name, device=device, dtype=dtype)
    config = built.model.generation_config
    config.eos_token_id = config.forced_eos_token_id = None
    config.suppress_tokens = config.begin_suppress_tokens = None
    return built
