"""Presence and frequency penalties, as OpenAI's API defines them, for `generate` and cachelife alike.

transformers has no processor for them. `OccurrencePenalty` is one (a `LogitsProcessor`: pass it in
`logits_processor=[...]` to `model.generate`, `cachelife.generate` or an engine request): each token's score
less `frequency` times the times it was generated so far and less `presence` if it was generated at all,
counting the tokens after the first `prompt_length` (the prompt's are not counted, as OpenAI counts). Its
arithmetic is `occurrence_penalised`, which the compiled step runs on its fixed-width token buffer
(`generation.processors`) and the engine's rows run with one value per row (`serving.row_settings`).
"""

from __future__ import annotations

import torch
from attrs import frozen
from transformers.generation import logits_process as lp

from cachelife.errors import InvalidArgumentError


def occurrence_penalised(
    tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor, *, presence: torch.Tensor | float,
    frequency: torch.Tensor | float, skip: torch.Tensor | int,
) -> torch.Tensor:  # fmt: skip
    """`scores` (rows, vocab) less the penalties of the tokens in each row's positions [skip, length) of `tokens`
    (rows, width); `length` and `skip` 0-dim or one per row (rows, 1), the penalties numbers or (rows, 1)."""
    vocab = scores.shape[-1]
    positions = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    counted = (positions >= skip) & (positions < length)
    ids = tokens.masked_fill(~counted, vocab).clamp(max=vocab)
    counts = torch.zeros(scores.shape[0], vocab + 1, dtype=scores.dtype, device=scores.device)
    counts = counts.scatter_add(1, ids, torch.ones_like(ids, dtype=scores.dtype))[:, :vocab]
    return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)


class OccurrencePenalty(lp.LogitsProcessor):
    """OpenAI's presence and frequency penalties over the tokens generated after the first `prompt_length`."""

    def __init__(self, *, presence: float = 0.0, frequency: float = 0.0, prompt_length: int) -> None:
        for name, value in (("presence", presence), ("frequency", frequency)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not -2 <= value <= 2:
                msg = f"{name} must be a number in [-2, 2] (OpenAI's range), got {value!r}"
                raise InvalidArgumentError(msg)
        if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or prompt_length < 0:
            msg = f"prompt_length must be an int >= 0, got {prompt_length!r}"
            raise InvalidArgumentError(msg)
        self.presence, self.frequency, self.prompt_length = float(presence), float(frequency), prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.FloatTensor:
        length = torch.tensor(input_ids.shape[1], device=input_ids.device)
        penalised: torch.FloatTensor = occurrence_penalised(  # type: ignore[assignment]  # a float tensor
            input_ids, length, scores, presence=self.presence, frequency=self.frequency, skip=self.prompt_length
        )
        return penalised

    def __repr__(self) -> str:
        values = f"presence={self.presence}, frequency={self.frequency}, prompt_length={self.prompt_length}"
        return f"OccurrencePenalty({values})"


@frozen
class Occurrences:
    """`OccurrencePenalty` in a compiled step: its values as 0-dim tensors, so that other values share the step."""

    presence: torch.Tensor  # float32
    frequency: torch.Tensor  # float32
    skip: torch.Tensor  # long

    @classmethod
    def of(cls, processor: OccurrencePenalty, device: torch.device) -> Occurrences:
        def real(value: float) -> torch.Tensor:
            return torch.tensor(value, dtype=torch.float32, device=device)

        return cls(
            real(processor.presence), real(processor.frequency), torch.tensor(processor.prompt_length, device=device)
        )

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return occurrence_penalised(
            tokens, length, scores, presence=self.presence, frequency=self.frequency, skip=self.skip
        )
