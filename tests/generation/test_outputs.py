"""`return_dict_in_generate=True` on the fast path (greedy search and sampling): sequences, scores and logits
as `model.generate` returns them, `compute_transition_scores` on them, and a returned cache that continues
generation as transformers' does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.utils import ModelOutput

import cachelife
from cachelife.tools import zoo

NEW = 10


def build(name: str) -> zoo.ZooModel:
    built = zoo.build(name)
    config = built.model.generation_config
    config.forced_eos_token_id = None
    if name == "whisper":
        zoo.whisper_tiny_generation(config)
    if name == "bart":
        config.eos_token_id = None  # the tiny BART ends every sequence at once
    return built


def both(built: zoo.ZooModel, inputs: dict[str, Any], **settings: Any) -> tuple[ModelOutput, ModelOutput]:
    settings = {"max_new_tokens": NEW, "return_dict_in_generate": True, **settings}
    theirs = built.model.generate(**inputs, **settings)
    ours = cachelife.generate(built.model, fallback=False, compile_step=False, **inputs, **settings)
    assert isinstance(theirs, ModelOutput)
    assert isinstance(ours, ModelOutput)
    assert type(ours) is type(theirs)
    return ours, theirs


def part(output: ModelOutput, name: str) -> Any:
    """A field of a generate output; None when it was not asked for (ModelOutput drops None fields)."""
    return output.get(name)


def assert_steps_close(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...]) -> None:
    assert len(ours) == len(theirs)
    for got, expected in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "t5", "bart", "whisper"])
def test_sequences_scores_and_logits_equal_generate(name: str) -> None:
    built = build(name)
    inputs = built.inputs(2, 9, 1)
    ours, theirs = both(built, inputs, output_scores=True, output_logits=True, repetition_penalty=1.3)
    assert torch.equal(part(ours, "sequences"), part(theirs, "sequences"))
    assert_steps_close(part(ours, "scores"), part(theirs, "scores"))
    assert_steps_close(part(ours, "logits"), part(theirs, "logits"))
    assert not torch.equal(part(ours, "scores")[3], part(ours, "logits")[3])  # the processor acted on the scores


def test_only_what_is_asked_for_is_returned() -> None:
    built = build("llama")
    ours, theirs = both(built, built.inputs(2, 9, 1), output_scores=True)
    assert part(ours, "logits") is None
    assert part(theirs, "logits") is None
    ours, theirs = both(built, built.inputs(2, 9, 1))
    assert part(ours, "scores") is None
    assert part(theirs, "scores") is None
    assert torch.equal(part(ours, "sequences"), part(theirs, "sequences"))


def test_transition_scores_of_our_output_equal_generate_s() -> None:
    built = build("llama")
    ours, theirs = both(built, built.inputs(2, 9, 1), output_scores=True)
    model = built.model
    mine = model.compute_transition_scores(part(ours, "sequences"), part(ours, "scores"), normalize_logits=True)
    expected = model.compute_transition_scores(part(theirs, "sequences"), part(theirs, "scores"), normalize_logits=True)
    torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-5)


def test_sampling_scores_are_the_warped_scores_of_the_drawn_tokens() -> None:
    built = build("llama")
    generator = torch.Generator().manual_seed(2)
    out = cachelife.generate(
        built.model, fallback=False, compile_step=False, **built.inputs(2, 9, 1), max_new_tokens=NEW,
        do_sample=True, top_k=5, temperature=0.7, generator=generator, return_dict_in_generate=True,
        output_scores=True,
    )  # fmt: skip
    assert isinstance(out, ModelOutput)
    drawn = part(out, "sequences")[:, -NEW:]
    for step, scores in enumerate(part(out, "scores")):
        assert int((scores > -float("inf")).sum(dim=-1).max()) <= 5  # top_k=5 left five candidates
        chosen = scores.gather(1, drawn[:, step : step + 1])
        assert bool(torch.isfinite(chosen).all())  # every drawn token was a candidate


def test_the_returned_cache_continues_generation_as_transformers_own() -> None:
    built = build("llama")
    model = cachelife.enable(built.model)
    inputs = built.inputs(1, 9, 1)
    free = zoo.generate_tokens(model, inputs, max_new_tokens=NEW)
    model.generation_config.eos_token_id = int(free[0, 12])  # ends at its 4th token: steps run past the end
    ours, theirs = both(built, inputs)
    assert part(ours, "sequences").shape[1] == 13
    cache_name = "cache" if "cache" in ours else "past_key_values"
    follow = {"input_ids": part(ours, "sequences"), "attention_mask": torch.ones_like(part(ours, "sequences"))}
    continued = zoo.generate_tokens(model, follow, max_new_tokens=4, **{cache_name: ours[cache_name]})
    expected = zoo.generate_tokens(model, follow, max_new_tokens=4, **{cache_name: theirs[cache_name]})
    assert torch.equal(continued, expected)


BEAMS = {"num_beams": 3, "length_penalty": 0.7, "no_repeat_ngram_size": 2}


@pytest.mark.parametrize("name", ["llama", "t5", "bart", "whisper"])
@pytest.mark.parametrize("returned", [1, 2])
def test_beam_search_outputs_equal_generate(name: str, returned: int) -> None:
    """sequences, sequences_scores, per-step scores and logits of every beam, beam_indices."""
    built = build(name)
    settings = {**BEAMS, "num_return_sequences": returned, "output_scores": True, "output_logits": True}
    ours, theirs = both(built, built.inputs(2, 9, 1), **settings)
    assert torch.equal(part(ours, "sequences"), part(theirs, "sequences"))
    assert torch.equal(part(ours, "beam_indices"), part(theirs, "beam_indices"))
    torch.testing.assert_close(part(ours, "sequences_scores"), part(theirs, "sequences_scores"), rtol=1e-5, atol=1e-5)
    assert_steps_close(part(ours, "scores"), part(theirs, "scores"))
    assert_steps_close(part(ours, "logits"), part(theirs, "logits"))


def test_beam_search_returns_only_what_is_asked_for() -> None:
    built = build("t5")
    ours, theirs = both(built, built.inputs(2, 9, 1), **BEAMS)
    for name in ("sequences_scores", "scores", "logits"):
        assert part(ours, name) is None
        assert part(theirs, name) is None
    assert torch.equal(part(ours, "beam_indices"), part(theirs, "beam_indices"))


def test_transition_scores_of_beam_search_equal_generate_s() -> None:
    built = build("bart")
    ours, theirs = both(built, built.inputs(2, 9, 1), **BEAMS, num_return_sequences=2, output_scores=True)
    model = built.model

    def transitions(output: ModelOutput) -> torch.Tensor:
        return model.compute_transition_scores(
            part(output, "sequences"), part(output, "scores"), part(output, "beam_indices"), normalize_logits=False
        )

    torch.testing.assert_close(transitions(ours), transitions(theirs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_the_cache_beam_search_returns_holds_transformers_rows_and_positions(name: str) -> None:
    """The returned cache holds the chosen beams in the order `_beam_search` leaves them (its last reorder
    applied), and as many positions."""
    built = build(name)
    ours, theirs = both(built, built.inputs(2, 9, 1), num_beams=2)
    cache_name = "cache" if "cache" in ours else "past_key_values"
    mine, reference = ours[cache_name], theirs[cache_name]
    length = int(reference.get_seq_length())
    assert int(mine.get_seq_length()) == length
    for ours_layer, theirs_layer in zip(_self_layers(mine), _self_layers(reference), strict=True):
        for field in ("keys", "values"):
            got, expected = getattr(ours_layer, field), getattr(theirs_layer, field)
            torch.testing.assert_close(got[:, :, :length], expected[:, :, :length], rtol=1e-5, atol=1e-5)


def _self_layers(cache: Any) -> list[Any]:
    return list(getattr(cache, "self_attention_cache", cache).layers)


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("beams", [1, 3])
def test_outputs_of_the_compiled_step_equal_generate(beams: int) -> None:
    """The scores are kept inside the compiled step (static buffers written at a tensor column)."""
    built = build("llama")
    settings: dict[str, Any] = {
        "max_new_tokens": NEW, "return_dict_in_generate": True, "output_scores": True, "num_beams": beams
    }  # fmt: skip
    theirs = built.model.generate(**built.inputs(2, 9, 1), **settings)
    ours = cachelife.generate(built.model, fallback=False, steps_per_call=2, **built.inputs(2, 9, 1), **settings)
    assert isinstance(ours, ModelOutput)
    assert isinstance(theirs, ModelOutput)
    assert torch.equal(part(ours, "sequences"), part(theirs, "sequences"))
    assert_steps_close(part(ours, "scores"), part(theirs, "scores"))
    if beams > 1:
        torch.testing.assert_close(part(ours, "sequences_scores"), part(theirs, "sequences_scores"))
