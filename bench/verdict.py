"""A benchmark figure's verdict against transformers: does the decoding it timed compute what transformers does?

float32: the tokens equal `model.generate`'s (the benchmark compares them itself). Other dtypes round otherwise
when compiled, so tokens may part at near ties; the verdict then teacher-forces transformers along the decoded
sequence: one eager forward of the model over the whole sequence gives every step's logits, in float32 (a
float32 copy of the model: the reference) and in the run's dtype (transformers' own rounding error). Both run on
a copy of the model with cachelife's rewrites undone (`cachelife.disable`): transformers' own modules, whatever
levers the run had on.

- `logits_agree_with_transformers` (when the run returned its logits, `output_logits=True`): the run's logits are
  at most `BOUND` times as far from the float32 reference as transformers' own bf16 logits are (relative RMS
  distance over every step, row and token), or within `FLOAT32_TOLERANCE` of it (a float32 run: transformers'
  own distance is then 0, and summing in another order is not an error).
- `tokens_agree_with_transformers` (greedy decoding whose processors leave the best raw logit best: no suppressed
  tokens): at every step each row's token is the reference's best, or within the rounding margin of it (twice
  the largest difference between transformers' bf16 and float32 logits of that row and step).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

import cachelife

BOUND = 2.0
FLOAT32_TOLERANCE = 1e-5


def sequence_logits(
    model: PreTrainedModel, inputs: dict[str, Any], sequences: torch.Tensor, prompt_width: int
) -> torch.Tensor:
    """(batch, new, vocab) float32: the logits that predict each new token of `sequences` (prompt, then new
    tokens), from one forward over the whole sequence; a left-padded prompt keeps its mask and positions."""
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            encoder = {name: value for name, value in inputs.items() if name in ("input_ids", "input_features",
                                                                                  "attention_mask")}  # fmt: skip
            encoder = {n: v.to(model.dtype) if v.is_floating_point() else v for n, v in encoder.items()}
            logits: torch.Tensor = model(**encoder, decoder_input_ids=sequences[:, :-1]).logits
            logits = logits[:, prompt_width - 1 :]
        else:
            prompt_mask = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"]))
            new = sequences.shape[1] - prompt_mask.shape[1]
            mask = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], new)], dim=1)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=sequences, attention_mask=mask, position_ids=positions).logits
            logits = logits[:, prompt_width - 1 : -1]
    return logits.float()


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative RMS distance of `logits` from `reference`."""
    return float((logits.float() - reference).norm() / reference.norm())


def unrewritten(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of `model` with transformers' own modules: cachelife's rewrites of an enabled model undone."""
    twin = copy.deepcopy(model)
    if cachelife.is_enabled(twin):
        cachelife.disable(twin)
    return twin


def judge(
    model: PreTrainedModel, inputs: dict[str, Any], sequences: torch.Tensor, prompt_width: int, *,
    logits: torch.Tensor | None = None, raw_greedy: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """The verdict (module docstring) on `sequences`, which the run decoded from `inputs` with `model`
    (`logits`: its (batch, new, vocab) logits, if it returned them)."""
    plain = unrewritten(model)
    exact = copy.deepcopy(plain).float()
    reference = sequence_logits(exact, inputs, sequences, prompt_width)
    del exact
    rounded = sequence_logits(plain, inputs, sequences, prompt_width)
    del plain
    own = relative_error(rounded, reference)
    verdict: dict[str, Any] = {"bound": BOUND, "transformers_logit_error": round(own, 6)}
    if logits is not None:
        error = relative_error(logits, reference)
        verdict["logit_error"] = round(error, 6)
        verdict["logits_agree_with_transformers"] = error <= max(BOUND * own, FLOAT32_TOLERANCE)
    if raw_greedy:
        tokens = sequences[:, prompt_width:]
        margin = 2 * (rounded - reference).abs().amax(dim=-1)
        gap = reference.amax(dim=-1) - reference.gather(-1, tokens[..., None])[..., 0]
        verdict["largest_gap_over_margin"] = round(float((gap - margin).max()), 4)
        verdict["tokens_agree_with_transformers"] = bool((gap <= margin).all())
    return verdict


def judge_requests(model: PreTrainedModel, decoded: Sequence[tuple[dict[str, Any], torch.Tensor]]) -> dict[str, Any]:
    """The token verdict over several greedy requests of a decoder-only model, each (its inputs with
    `input_ids`, the sequence decoded from them): how many were judged, whether every one agrees, and the
    largest gap over the margin among them."""
    verdicts = [judge(model, inputs, tokens, int(inputs["input_ids"].shape[1])) for inputs, tokens in decoded]
    return {
        "requests": len(verdicts),
        "tokens_agree_with_transformers": all(v["tokens_agree_with_transformers"] for v in verdicts),
        "largest_gap_over_margin": max(v["largest_gap_over_margin"] for v in verdicts),
    }
