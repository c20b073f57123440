"""Beam sampling (`num_beams > 1` with `do_sample=True`) on the fast path: candidates drawn without
replacement by an exponential race, ordered as the installed transformers orders its draws."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

import cachelife
from cachelife.tools import zoo

BEAM_SAMPLING = {"num_beams": 3, "do_sample": True}


def build(name: str) -> zoo.ZooModel:
    built = zoo.build(name)
    config = built.model.generation_config
    config.forced_eos_token_id = None
    if name == "whisper":
        zoo.whisper_tiny_generation(config)
    return built


def ours(built: zoo.ZooModel, inputs: dict[str, Any], seed: int, **settings: Any) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    out = cachelife.generate(built.model, fallback=False, compile_step=False, generator=generator, **inputs, **settings)
    assert isinstance(out, torch.Tensor)
    return out


@pytest.mark.parametrize("name", ["llama", "t5", "whisper"])
def test_nearly_deterministic_beam_sampling_equals_generate(name: str) -> None:
    """At a temperature that leaves one likely draw, beam sampling is beam search on the warped scores: the
    draws, the finished beams and the length penalty all as `generate`'s."""
    built = build(name)
    inputs = built.inputs(2, 9, 1)
    settings = {**BEAM_SAMPLING, "temperature": 0.002, "max_new_tokens": 10, "length_penalty": 0.7}
    torch.manual_seed(0)
    expected = zoo.generate_tokens(built.model, inputs, **settings)
    assert torch.equal(ours(built, inputs, 1, **settings), expected)


def test_the_draws_follow_generate_s_distribution() -> None:
    """One new token from 2 beams among the top 12 candidates, for 4000 copies of one prompt in one call: how
    often each token wins is within sampling error of `generate`'s. The order of the drawn candidates (sorted
    by score, or as drawn: whichever the installed transformers does) decides which of them may finish, and
    the other order gives another distribution."""
    built = build("llama")
    one = built.inputs(1, 5, 3)
    rows = 4000
    inputs = {name: tensor.expand(rows, -1).contiguous() for name, tensor in one.items()}
    settings = {"num_beams": 2, "do_sample": True, "top_k": 12, "temperature": 2.0, "max_new_tokens": 1}
    torch.manual_seed(0)
    theirs = Counter(zoo.generate_tokens(built.model, inputs, **settings)[:, -1].tolist())
    mine = Counter(ours(built, inputs, 1, **settings)[:, -1].tolist())
    assert max(theirs.values()) < 0.8 * rows  # spread: a deterministic choice would fail the comparison
    distance = sum(abs(theirs[token] - mine[token]) for token in theirs | mine) / (2 * rows)
    assert distance < 0.06, (theirs, mine)


def test_beam_sampling_is_reproducible_with_a_generator_and_varies_without_one() -> None:
    built = build("t5")
    inputs = built.inputs(2, 9, 1)
    settings = {**BEAM_SAMPLING, "max_new_tokens": 8, "top_k": 20}
    assert torch.equal(ours(built, inputs, 5, **settings), ours(built, inputs, 5, **settings))
    draws = {tuple(ours(built, inputs, seed, **settings).flatten().tolist()) for seed in range(6)}
    assert len(draws) > 1


@pytest.mark.slow
@pytest.mark.exhaustive
def test_beam_sampling_in_the_compiled_step_is_the_eager_step_s() -> None:
    built = build("llama")
    inputs = built.inputs(2, 9, 1)
    settings: dict[str, Any] = {**BEAM_SAMPLING, "max_new_tokens": 8, "top_k": 20}
    generator = torch.Generator().manual_seed(3)
    compiled = cachelife.generate(built.model, fallback=False, generator=generator, **inputs, **settings)
    assert isinstance(compiled, torch.Tensor)
    assert torch.equal(compiled, ours(built, inputs, 3, **settings))
