"""OccurrencePenalty (OpenAI's presence and frequency penalties): its arithmetic against the definition counted
by hand, `cachelife.generate` against `model.generate` with it, and engine rows of several penalties at once,
each as its own `cachelife.generate`."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList

from cachelife.errors import InvalidArgumentError
from cachelife.generation.penalties import OccurrencePenalty
from cachelife.serving.engine import Engine
from cachelife.tools import zoo
from support import alone


@pytest.mark.parametrize(("presence", "frequency", "prompt_length"), [(0.5, 0.0, 3), (0.0, 1.25, 0), (-0.7, 0.4, 5)])
def test_each_score_loses_the_penalties_of_its_tokens_generated_after_the_prompt(
    presence: float, frequency: float, prompt_length: int
) -> None:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 12, (3, 10), generator=generator)
    scores = torch.randn(3, 12, generator=generator)
    got = OccurrencePenalty(presence=presence, frequency=frequency, prompt_length=prompt_length)(ids, scores)
    for row in range(3):
        counts = Counter(int(token) for token in ids[row, prompt_length:])
        for token in range(12):
            count = counts.get(token, 0)
            expected = scores[row, token] - torch.tensor(frequency * count) - (presence if count else 0.0)
            assert torch.isclose(got[row, token], expected, rtol=0, atol=1e-6), (row, token, count)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"presence": 2.5, "prompt_length": 0}, r"presence must be a number in \[-2, 2\]"),
        ({"frequency": "high", "prompt_length": 0}, "frequency must be a number"),
        ({"presence": 1.0, "prompt_length": -1}, "prompt_length must be an int >= 0"),
    ],
)
def test_bad_penalties_are_refused_naming_the_value(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        OccurrencePenalty(**arguments)


def penalised(presence: float, frequency: float, prompt: int) -> LogitsProcessorList:
    return LogitsProcessorList([OccurrencePenalty(presence=presence, frequency=frequency, prompt_length=prompt)])


def test_cachelife_generate_with_penalties_equals_model_generate() -> None:
    built = zoo.build("llama")
    inputs = built.inputs(1, 6, 1)
    plain = zoo.generate_tokens(built.model, inputs, max_new_tokens=16, do_sample=False)
    processors = penalised(1.5, 1.0, 6)
    expected = zoo.generate_tokens(built.model, inputs, max_new_tokens=16, do_sample=False, logits_processor=processors)
    assert torch.equal(alone(built.model, **inputs, max_new_tokens=16, logits_processor=processors), expected)
    assert not torch.equal(expected, plain)  # the penalties changed the tokens


def test_engine_rows_of_other_penalties_decode_together_each_as_its_own_generate() -> None:
    built = zoo.build("llama")
    settings = [(0.0, 0.0), (1.5, 0.0), (0.0, 1.0), (-1.0, 0.5), (2.0, 2.0)]
    requests = []
    for index, (presence, frequency) in enumerate(settings):
        inputs = built.inputs(1, 4 + index, index)
        requests.append({**inputs, "max_new_tokens": 12, "logits_processor": penalised(presence, frequency, 4 + index)})
    requests[-1] |= {"do_sample": True, "temperature": 0.8}  # a sampled row beside the greedy ones, seeded
    expected = [
        alone(built.model, **request, generator=torch.Generator().manual_seed(index))
        for index, request in enumerate(requests)
    ]
    with Engine(built.model, rows=len(requests), max_length=64, compile_step=False) as engine:
        futures = [
            engine.submit(**request, generator=torch.Generator().manual_seed(index))
            for index, request in enumerate(requests)
        ]
        got = [future.result(timeout=120) for future in futures]
        assert engine.stats().programs <= 2  # the per-row pipeline's greedy and sampling variants: none of its own
    for mine, theirs in zip(got, expected, strict=True):
        assert torch.equal(mine, theirs)
    assert len({tuple(tokens[0].tolist()) for tokens in got}) == len(got)
