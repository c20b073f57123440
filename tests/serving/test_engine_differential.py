"""cachelife.Engine against `cachelife.generate` and `model.generate` on random mixes of what clients send: prompts
left-padded with or without their mask, sampled sequences and beams, every processor setting the rows take,
end-token sets, bad words, stop strings with a tokenizer and streamers, through engines of 1 to 4 rows. Each
request the engine takes equals its own `cachelife.generate` call (seeded alike), greedy ones and beams also
`model.generate`; what it refuses, it refuses at `submit` by name. The hunt that found a left-padded request of
several rows with a repetition penalty failing as it joined. Eager steps in CI (seconds a model); compiled
steps with the exhaustive tests (`nox -s slow`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cachelife
from cachelife.errors import InvalidArgumentError, UnsupportedGenerationError
from cachelife.serving.engine import Engine
from cachelife.tools import zoo
from cachelife.tools.recording import RecordingStreamer
from support import stand_in_graphs

END = 13
PAD = 0


@pytest.fixture(scope="module", params=["llama", "t5"])
def built(request: pytest.FixtureRequest) -> zoo.ZooModel:
    model = zoo.build(request.param)
    model.model.generation_config.eos_token_id = END
    return model


@st.composite
def client_requests(draw: st.DrawFn, vocab: int, decoder_only: bool) -> dict[str, Any]:
    """One request's settings (its prompt is made from them by `prompt_of`)."""

    def maybe(strategy: st.SearchStrategy[Any]) -> Any:
        return draw(st.none() | strategy)

    request: dict[str, Any] = {"length": draw(st.integers(1, 9)), "max_new_tokens": draw(st.integers(1, 10))}
    request["pads"] = draw(st.integers(0, request["length"] - 1)) if decoder_only else 0
    request["mask"] = draw(st.booleans())
    search = draw(st.sampled_from(["greedy", "sample", "sequences", "beams"]))
    if search in ("sample", "sequences"):
        request["do_sample"] = True
        request["temperature"] = maybe(st.sampled_from([0.5, 1.3]))
        request["top_k"] = maybe(st.sampled_from([0, 5, 40]))
        request["top_p"] = maybe(st.sampled_from([0.5, 0.9]))
        request["min_p"] = maybe(st.sampled_from([0.05, 0.2]))
        request["typical_p"] = maybe(st.just(0.9))
        request["eta_cutoff"] = maybe(st.just(0.03))
        if search == "sequences":
            request["num_return_sequences"] = draw(st.integers(2, 3))
    if search == "beams":
        request["num_beams"] = draw(st.integers(2, 3))
        request["num_return_sequences"] = draw(st.integers(1, request["num_beams"]))
        request["length_penalty"] = maybe(st.sampled_from([0.5, 2.0]))
        request["early_stopping"] = maybe(st.sampled_from([True, False, "never"]))
    request["min_new_tokens"] = maybe(st.integers(0, request["max_new_tokens"]))
    request["repetition_penalty"] = maybe(st.sampled_from([0.8, 1.3]))
    request["no_repeat_ngram_size"] = maybe(st.integers(1, 3))
    token = st.integers(0, vocab - 1)
    request["suppress_tokens"] = maybe(st.lists(token, min_size=1, max_size=3))
    request["begin_suppress_tokens"] = maybe(st.lists(token, min_size=1, max_size=2))
    request["eos_token_id"] = maybe(st.tuples(st.just(END), token).map(list))
    request["forced_eos_token_id"] = maybe(st.just(END))
    request["bad_words_ids"] = maybe(st.lists(st.lists(token, min_size=1, max_size=2), min_size=1, max_size=2))
    request["sequence_bias"] = maybe(st.dictionaries(st.tuples(token), st.just(5.0), min_size=1, max_size=1))
    if search != "beams" and decoder_only:
        request["stop_strings"] = maybe(st.lists(st.sampled_from(["a", "b", "<1", "2>", "<3"]), min_size=1, max_size=2))
        request["streamed"] = search != "sequences" and draw(st.booleans())
    return {name: value for name, value in request.items() if value is not None}


def prompt_of(built: zoo.ZooModel, drawn: dict[str, Any], index: int) -> dict[str, Any]:
    """The request `generate` takes: its prompt (left-padded as a tokenizer pads it, the mask passed or left
    for `generate` to infer) and its settings."""
    settings = {k: v for k, v in drawn.items() if k not in ("length", "pads", "mask", "streamed")}
    inputs = built.inputs(1, drawn["length"], index)
    if drawn["pads"]:
        inputs = zoo.left_padded(inputs, drawn["pads"], pad_token_id=PAD)
        if not drawn["mask"]:
            del inputs["attention_mask"]
    if "stop_strings" in settings:
        settings["tokenizer"] = zoo.letters_tokenizer(built.model.config.vocab_size)
    return {**inputs, **settings}


def seeded(request: dict[str, Any], index: int) -> torch.Generator | None:
    return torch.Generator().manual_seed(100 + index) if request.get("do_sample") else None


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), rows=st.integers(1, 4), steps_per_call=st.integers(1, 3))
def test_every_request_the_engine_takes_decodes_as_its_own_generate(
    built: zoo.ZooModel, data: st.DataObject, rows: int, steps_per_call: int
) -> None:
    check_mix(built, data, rows=rows, steps_per_call=steps_per_call, compile_step=False)


@pytest.mark.slow
@pytest.mark.exhaustive
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_request_the_compiled_engine_takes_decodes_as_its_own_generate(
    built: zoo.ZooModel, data: st.DataObject
) -> None:
    check_mix(built, data, rows=3, steps_per_call=2, compile_step=True)


def check_mix(built: zoo.ZooModel, data: st.DataObject, *, rows: int, steps_per_call: int, compile_step: bool) -> None:
    """Requests drawn from `data`, each equal to its own `cachelife.generate` (the same step, eager or
    compiled) and, greedy ones and beams, to `model.generate`; refusals at submit, by name."""
    model = built.model
    decoder_only = not model.config.is_encoder_decoder
    strategy = client_requests(int(model.config.vocab_size), decoder_only)
    drawn = data.draw(st.lists(strategy, min_size=2, max_size=6))
    requests = [prompt_of(built, one, index) for index, one in enumerate(drawn)]
    streamers = [RecordingStreamer() if one.get("streamed") else None for one in drawn]
    encoder_length = None if decoder_only else 16
    taken: dict[int, Any] = {}
    refusals: list[str] = []
    with Engine(
        model, rows=rows, max_length=32, steps_per_call=steps_per_call, compile_step=compile_step,
        encoder_length=encoder_length,
    ) as engine:  # fmt: skip
        for index, request in enumerate(requests):
            try:
                taken[index] = engine.submit(**request, generator=seeded(request, index), streamer=streamers[index])
            except (InvalidArgumentError, UnsupportedGenerationError) as error:  # refused at submit
                refusals.append(str(error))
        results = {index: future.result(timeout=600) for index, future in taken.items()}
    # More rows than the engine has, what the rows do not decode, or settings transformers' own checks refuse.
    named = ("engine's rows", "the engine does not decode", "generation settings are invalid")
    assert all(any(reason in why for reason in named) for why in refusals), refusals
    for index, got in results.items():
        request = requests[index]
        want = cachelife.generate(
            model, fallback=False, compile_step=compile_step, steps_per_call=steps_per_call,
            generator=seeded(request, index), **request,
        )  # fmt: skip
        assert isinstance(want, torch.Tensor)
        assert torch.equal(got, want), (index, drawn[index])
        if not request.get("do_sample"):
            assert torch.equal(got, zoo.generate_tokens(model, request)), (index, drawn[index])
        streamer = streamers[index]
        if streamer is not None:  # the prompt, then each new token
            assert torch.equal(torch.cat([value.reshape(1, -1) for value in streamer.values], dim=1), got)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), rows=st.integers(1, 4))
def test_every_request_the_engine_takes_under_graphs_decodes_as_its_own_generate(
    built: zoo.ZooModel, data: st.DataObject, rows: int
) -> None:
    """Under stand-in graphs: every replay of the graphs of a join (its rows' start, settings and first token,
    `serving.row_starts`) reads that newcomer's staged values."""
    with pytest.MonkeyPatch.context() as patch:
        stand_in_graphs(patch)
        check_mix(built, data, rows=rows, steps_per_call=1, compile_step=False)
