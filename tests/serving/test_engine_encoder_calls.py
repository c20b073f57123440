"""Newcomers' encoders run together (`cachelife.serving.encoder_calls`): the encoder calls of requests that arrive
while an encoder forward runs are gathered into one forward, and each request gets what its own call gives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from cachelife.serving.encoder_calls import RIGHT_PADDED, EncoderCalls, gather_encoder_calls
from cachelife.serving.engine import Engine
from cachelife.tools import zoo
from support import HeldFirstForward, family_model, first_layer, in_threads


def encoder_kwargs(inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What transformers' `generate` passes the encoder for greedy search."""
    return {**inputs, "output_attentions": False, "output_hidden_states": False, "return_dict": True}


# Every model type whose prompts are padded on the right to run together, by its transformers class prefix.
PADDED_FAMILIES = {
    "t5": "T5", "mt5": "MT5", "bart": "Bart", "mbart": "MBart", "plbart": "PLBart", "marian": "Marian",
    "pegasus": "Pegasus", "blenderbot": "Blenderbot", "blenderbot-small": "BlenderbotSmall",
}  # fmt: skip


def test_every_padded_model_type_is_tested() -> None:
    assert set(PADDED_FAMILIES) == set(RIGHT_PADDED)


def gathered_run(model: PreTrainedModel, kwargs: list[dict[str, Any]]) -> tuple[list[Any], EncoderCalls]:
    """Each of `kwargs` through the model's encoder from a thread of its own, the first held until every call is
    gathered; the outputs in order, and the gathering (restored)."""
    calls = gather_encoder_calls(model, most=8)
    assert calls is not None
    encoder = model.get_encoder()
    held = HeldFirstForward(first_layer(model))
    outputs: list[Any] = [None] * len(kwargs)

    def run(index: int) -> None:
        with torch.no_grad(), calls.gathering():
            try:
                outputs[index] = encoder(**kwargs[index])
            except Exception as error:  # the test reads it
                outputs[index] = error

    try:
        in_threads(len(kwargs), run, held, lambda: calls.calls)
    finally:
        held.remove()
        calls.restore()
    return outputs, calls


@pytest.mark.parametrize("model_type", sorted(PADDED_FAMILIES))
def test_prompts_of_other_lengths_padded_together_give_each_its_own_encoder_output(model_type: str) -> None:
    model = family_model(PADDED_FAMILIES[model_type])
    assert model.config.model_type == model_type
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (1, length), generator=generator) for length in (5, 3, 9, 1, 7)]
    kwargs = [encoder_kwargs({"input_ids": ids, "attention_mask": torch.ones_like(ids)}) for ids in prompts]
    with torch.no_grad():
        own = [model.get_encoder()(**each).last_hidden_state for each in kwargs]
    outputs, calls = gathered_run(model, kwargs)
    assert (calls.calls, calls.forwards) == (5, 2)  # the first alone, the four that waited in one forward
    for index, (want, got) in enumerate(zip(own, outputs, strict=True)):
        assert got.last_hidden_state.shape == want.shape, index
        torch.testing.assert_close(got.last_hidden_state, want, rtol=0, atol=1e-5)
    assert "forward" not in vars(model.get_encoder())  # the encoder's own forward is back


def test_a_model_type_not_known_to_pad_runs_only_equal_shapes_together() -> None:
    model = family_model("Bart")
    model.config.model_type = "not-known"  # a family whose padding has not been checked
    prompts = [torch.randint(3, 300, (1, length), generator=torch.Generator().manual_seed(length))
               for length in (4, 6, 4, 6, 4)]  # fmt: skip
    kwargs = [encoder_kwargs({"input_ids": ids, "attention_mask": torch.ones_like(ids)}) for ids in prompts]
    with torch.no_grad():
        own = [model.get_encoder()(**each).last_hidden_state for each in kwargs]
    outputs, calls = gathered_run(model, kwargs)
    # The first alone; then the waiting calls of length 6 (the oldest first), then those of length 4.
    assert (calls.calls, calls.forwards) == (5, 3)
    for want, got in zip(own, outputs, strict=True):
        torch.testing.assert_close(got.last_hidden_state, want, rtol=0, atol=1e-5)


def test_a_call_that_breaks_its_group_fails_alone() -> None:
    model = family_model("T5")
    prompts = [torch.randint(3, 300, (1, 4), generator=torch.Generator().manual_seed(seed)) for seed in range(4)]
    prompts[2][0, 1] = 10_000  # past the vocabulary: the embedding fails
    kwargs = [encoder_kwargs({"input_ids": ids, "attention_mask": torch.ones_like(ids)}) for ids in prompts]
    with torch.no_grad():
        own = [model.get_encoder()(**each).last_hidden_state for index, each in enumerate(kwargs) if index != 2]
    outputs, calls = gathered_run(model, kwargs)
    assert isinstance(outputs[2], IndexError)
    for want, got in zip(own, [outputs[0], outputs[1], outputs[3]], strict=True):
        torch.testing.assert_close(got.last_hidden_state, want, rtol=0, atol=1e-5)
    assert calls.forwards == 3  # the first alone; the group failed, and its good calls ran alone


def test_calls_outside_gathering_and_calls_asking_for_more_reach_the_encoders_own_forward() -> None:
    model = family_model("T5")
    calls = gather_encoder_calls(model, most=8)
    assert calls is not None
    ids = torch.randint(3, 300, (1, 4), generator=torch.Generator().manual_seed(0))
    plain = encoder_kwargs({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    with torch.no_grad():
        model.get_encoder()(**plain)  # not inside gathering()
        with calls.gathering():
            output = model.get_encoder()(**{**plain, "output_hidden_states": True})
    calls.restore()
    assert (calls.calls, calls.forwards) == (0, 0)
    assert output.hidden_states is not None


@pytest.mark.parametrize("name", ["t5", "bart", "whisper"])
def test_the_engines_newcomers_encoders_run_together_and_decode_as_model_generate(
    name: str, held_encoder: Callable[[PreTrainedModel], HeldFirstForward]
) -> None:
    built = zoo.build(name)
    batch = [{**built.inputs(1, 2 + (5 * index) % 9, index), "max_new_tokens": 3 + index} for index in range(5)]
    held = held_encoder(built.model)
    encoder_length = None if name == "whisper" else 16
    with Engine(built.model, rows=4, max_length=40, compile_step=False, encoder_length=encoder_length) as engine:
        futures: list[Any] = []

        def submit(index: int) -> None:
            futures.append((index, engine.submit(**batch[index])))

        in_threads(len(batch), submit, held, lambda: engine.stats().encoder_calls)
        results = {index: future.result(timeout=120) for index, future in futures}
        stats = engine.stats()
    assert (stats.encoder_calls, stats.encoder_forwards) == (5, 2)
    assert "forward" not in vars(built.model.get_encoder())  # the engine gave the encoder's forward back
    for index, request in enumerate(batch):
        assert torch.equal(results[index], zoo.generate_tokens(built.model, request)), index
