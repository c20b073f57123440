"""The processors behind min_p, typical_p, epsilon_cutoff, eta_cutoff, encoder_no_repeat_ngram_size and
exponential_decay_length_penalty: each equals transformers' own on the same scores, decodes on the fast path
(`fallback=False`), and changes the output.

Sampling draws differ from `generate`'s multinomial ones by design (an exponential race from the caller's
generator), so the sampling warpers are compared with transformers' processors score by score, and end to end
through settings that leave one candidate (sampling then equals greedy search) and settings that change draws.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers.generation import logits_process as lp

import cachelife
from cachelife.generation.processors import tensor_processors, unsupported_processor
from cachelife.tools import zoo

NEW = 12
VOCAB = 50


def scores_and_tokens(seed: int, rows: int = 4, length: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, VOCAB, generator=generator) * 3
    scores[0, :10] = -float("inf")  # some tokens already removed
    tokens = torch.randint(0, 6, (rows, length), generator=generator)  # few ids: n-grams repeat
    return scores, tokens


def as_buffer(tokens: torch.Tensor, width: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast loop's view: a fixed-width token buffer (garbage past the length) and a 0-dim length."""
    buffer = torch.full((tokens.shape[0], width), 3, dtype=torch.long)
    buffer[:, : tokens.shape[1]] = tokens
    return buffer, torch.tensor(tokens.shape[1])


PROCESSORS: dict[str, Callable[[], lp.LogitsProcessor]] = {
    "min_p": lambda: lp.MinPLogitsWarper(0.2, min_tokens_to_keep=2),
    "typical_p": lambda: lp.TypicalLogitsWarper(0.6, min_tokens_to_keep=1),
    "epsilon_cutoff": lambda: lp.EpsilonLogitsWarper(0.02, min_tokens_to_keep=1),
    "eta_cutoff": lambda: lp.EtaLogitsWarper(0.05, min_tokens_to_keep=1, device="cpu"),
    "exponential_decay_length_penalty": lambda: lp.ExponentialDecayLengthPenalty((2, 1.7), [4, 9], 3),
}


@pytest.mark.parametrize("name", sorted(PROCESSORS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_processor_equals_transformers_own_on_the_same_scores(name: str, seed: int) -> None:
    processor = PROCESSORS[name]()
    assert unsupported_processor([processor]) is None
    (converted,) = tensor_processors([processor], vocab_size=VOCAB, device=torch.device("cpu"))
    scores, tokens = scores_and_tokens(seed)
    for length in (2, 5, 7):  # exponential decay starts after 3 + 2 tokens
        expected = processor(tokens[:, :length], scores.clone())
        buffer, at = as_buffer(tokens[:, :length])
        got = converted(buffer, at, scores.clone())
        # Exact, NaN included: transformers 5.17's length penalty turns an end token's -inf into NaN.
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True, msg=f"{name} at {length}")
    assert not torch.equal(processor(tokens, scores.clone()), scores), "the processor changed nothing here"


@pytest.mark.parametrize("beams", [1, 2])
def test_encoder_no_repeat_ngrams_equal_transformers_own_for_every_row(beams: int) -> None:
    generator = torch.Generator().manual_seed(5)
    encoder_ids = torch.randint(0, 6, (2, 9), generator=generator)
    processor = lp.EncoderNoRepeatNGramLogitsProcessor(3, encoder_ids)  # type: ignore[arg-type]  # a long tensor
    (converted,) = tensor_processors([processor], vocab_size=VOCAB, device=torch.device("cpu"))
    scores = torch.randn(2 * beams, VOCAB, generator=generator)
    tokens = torch.randint(0, 6, (2 * beams, 8), generator=generator)
    for length in (1, 2, 3, 6, 8):
        expected = processor(tokens[:, :length], scores.clone())
        buffer, at = as_buffer(tokens[:, :length])
        assert torch.equal(converted(buffer, at, scores.clone()), expected), length


def build(name: str) -> zoo.ZooModel:
    built = zoo.build(name)
    config = built.model.generation_config
    if name == "bart":
        config.forced_eos_token_id = None
        config.eos_token_id = None
    return built


def ours(built: zoo.ZooModel, **settings: Any) -> torch.Tensor:
    out = cachelife.generate(built.model, compile_step=False, fallback=False, **built.inputs(2, 9, 1), **settings)
    assert isinstance(out, torch.Tensor)
    return out


def theirs(built: zoo.ZooModel, **settings: Any) -> torch.Tensor:
    return zoo.generate_tokens(built.model, built.inputs(2, 9, 1), **settings)


@pytest.mark.parametrize(("name", "beams"), [("t5", 1), ("bart", 1), ("t5", 3)])
def test_encoder_no_repeat_ngram_size_equals_generate_and_changes_the_output(name: str, beams: int) -> None:
    built = build(name)
    inputs = built.inputs(2, 9, 1)
    free = zoo.generate_tokens(built.model, inputs, max_new_tokens=NEW, num_beams=beams)
    for row in range(2):  # the input now holds the tokens the model produces, which the setting then bans
        produced = sorted(set(free[row, 1:].tolist()))[:6]
        inputs["input_ids"][row, 9 - len(produced) :] = torch.tensor(produced)
    settings: dict[str, Any] = {"max_new_tokens": NEW, "num_beams": beams, "encoder_no_repeat_ngram_size": 1}
    expected = zoo.generate_tokens(built.model, inputs, **settings)
    got = cachelife.generate(built.model, compile_step=False, fallback=False, **inputs, **settings)
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got, expected)
    without = zoo.generate_tokens(built.model, inputs, **{**settings, "encoder_no_repeat_ngram_size": 0})
    assert not torch.equal(without, expected), "the setting changed nothing"


@pytest.mark.parametrize(("name", "beams"), [("llama", 1), ("t5", 1), ("llama", 2)])
def test_exponential_decay_length_penalty_equals_generate_and_changes_the_output(name: str, beams: int) -> None:
    built = build(name)
    free = theirs(built, max_new_tokens=NEW, num_beams=beams)
    end = int(free[0, -4])  # a token the model produces late: a growing bonus makes it end earlier
    built.model.generation_config.eos_token_id = end
    settings: dict[str, Any] = {"max_new_tokens": NEW, "num_beams": beams}
    decayed = {**settings, "exponential_decay_length_penalty": (1, 3.0)}
    expected = theirs(built, **decayed)
    assert torch.equal(ours(built, **decayed), expected)
    assert not torch.equal(theirs(built, **settings), expected), "the setting changed nothing"


@pytest.mark.parametrize(
    "warp",
    [{"min_p": 1.0}, {"epsilon_cutoff": 0.9}],
    ids=["min_p", "epsilon_cutoff"],
)
def test_a_warper_that_leaves_one_candidate_samples_the_greedy_tokens(warp: dict[str, Any]) -> None:
    built = build("llama")
    greedy = theirs(built, max_new_tokens=NEW, do_sample=False)
    generator = torch.Generator().manual_seed(0)
    sampled = ours(built, max_new_tokens=NEW, do_sample=True, top_k=0, generator=generator, **warp)
    assert torch.equal(sampled, greedy)


@pytest.mark.parametrize("warp", [{"min_p": 0.5}, {"typical_p": 0.5}, {"epsilon_cutoff": 0.01}, {"eta_cutoff": 0.9}])
def test_a_warper_changes_what_is_drawn_from_the_same_generator(warp: dict[str, Any]) -> None:
    built = build("llama")

    def sample(**more: Any) -> torch.Tensor:
        generator = torch.Generator().manual_seed(3)
        return ours(built, max_new_tokens=NEW, do_sample=True, top_k=0, generator=generator, **more)

    assert not torch.equal(sample(**warp), sample())
    assert torch.equal(sample(**warp), sample(**warp))
