"""bench.verdict: a float32 run's logits agree with transformers when they are transformers' up to the order of
summation, and not when they are off."""

from __future__ import annotations

from typing import Any

import torch
from bench.verdict import FLOAT32_TOLERANCE, judge

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
