"""bench.verdict: a float32 run's logits agree with transformers when they are transformers' up to the order of
summation, and not when they are off."""

from __future__ import annotations

from typing import Any

import torch
from bench.verdict import FLOAT32_TOLERANCE, judge, unrewritten

import cachelife
from cachelife.tools import zoo


def test_a_float32_runs_logits_agree_up_to_float_noise_and_not_beyond() -> None:
    built = zoo.build("llama")
    inputs = built.inputs(1, 6, 0)
    out: Any = built.model.generate(**inputs, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                                    output_logits=True)  # fmt: skip
    logits = torch.stack(out.logits, dim=1)
    width = inputs["input_ids"].shape[1]
    noise = 1e-7 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
    judged = judge(built.model, inputs, out.sequences, width, logits=logits + noise * logits.norm() / logits.numel())
    assert judged["transformers_logit_error"] == 0.0
    assert judged["logits_agree_with_transformers"]
    assert judged["tokens_agree_with_transformers"]
    off = judge(built.model, inputs, out.sequences, width, logits=logits * (1 + 100 * FLOAT32_TOLERANCE))
    assert not off["logits_agree_with_transformers"]


def test_the_reference_runs_transformers_own_modules_and_leaves_the_run_s_model_enabled() -> None:
    """An enabled model (fused projections by default) is judged on a copy with cachelife's rewrites undone;
    the model itself keeps them."""
    model = cachelife.enable(zoo.build("llama").model)
    fused = {name for name, _ in model.named_buffers() if "cachelife_fused" in name}
    plain = unrewritten(model)
    assert fused
    assert not cachelife.is_enabled(plain)
    assert not any("cachelife_fused" in name for name, _ in plain.named_buffers())
    assert all(parameter.untyped_storage().nbytes() == parameter.nbytes for parameter in plain.parameters())
    assert cachelife.is_enabled(model)
    assert fused == {name for name, _ in model.named_buffers() if "cachelife_fused" in name}
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in plain.state_dict().items())
