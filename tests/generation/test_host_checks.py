"""Streamers and host-side stops on the fast path: a streamer gets exactly what `model.generate` gives it, in
order, and `end()`; `stop_strings`, `max_time` and custom `stopping_criteria` stop where `generate` stops."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

import cachelife
from cachelife.errors import UnsupportedGenerationError
from cachelife.tools import zoo
from cachelife.tools.recording import RecordingStreamer

NEW = 20


class StopAfterToken(StoppingCriteria):
    """Stops a row once it holds `token` after the prompt (a criterion only the host evaluates)."""

    def __init__(self, token: int, prompt: int) -> None:
        self.token = token
        self.prompt = prompt

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor | None, **kwargs: Any
    ) -> torch.BoolTensor:
        found: torch.BoolTensor = (input_ids[:, self.prompt :] == self.token).any(dim=-1)  # type: ignore[assignment]
        return found


def build(name: str, *, eos: bool) -> zoo.ZooModel:
    built = zoo.build(name)
    config = built.model.generation_config
    config.forced_eos_token_id = None
    if not eos:
        config.eos_token_id = None
    return built


def fast(built: zoo.ZooModel, inputs: dict[str, Any], **settings: Any) -> torch.Tensor:
    out = cachelife.generate(built.model, fallback=False, compile_step=False, **inputs, **settings)
    assert isinstance(out, torch.Tensor)
    return out


@pytest.mark.parametrize("name", ["llama", "t5"])
@pytest.mark.parametrize(("every", "steps"), [(1, 1), (3, 1), (8, 2)])
def test_a_streamer_receives_what_generate_gives_it(name: str, every: int, steps: int) -> None:
    built = build(name, eos=True)
    inputs = built.inputs(1, 9, 1)
    free = zoo.generate_tokens(built.model, inputs, max_new_tokens=NEW)
    built.model.generation_config.eos_token_id = int(free[0, -6])  # the sequence ends before the budget
    theirs, ours = RecordingStreamer(), RecordingStreamer()
    expected = zoo.generate_tokens(built.model, inputs, max_new_tokens=NEW, streamer=theirs)
    got = fast(built, inputs, max_new_tokens=NEW, streamer=ours, stop_check_every=every, steps_per_call=steps)
    assert torch.equal(got, expected)
    assert expected.shape[1] < free.shape[1]  # it did end early: later steps were decoded and not streamed
    assert ours.puts == theirs.puts
    assert (ours.ends, theirs.ends) == (1, 1)


@pytest.mark.parametrize("every", [1, 4])
def test_what_a_streamer_was_given_stays_after_the_next_call(every: int) -> None:
    built = build("llama", eos=False)
    kept = RecordingStreamer()
    first = fast(built, built.inputs(1, 9, 1), max_new_tokens=NEW, streamer=kept, stop_check_every=every)
    fast(built, built.inputs(1, 9, 2), max_new_tokens=NEW, stop_check_every=every)
    assert torch.equal(torch.cat([value.reshape(1, -1) for value in kept.values], dim=1), first)


class KeepingCriterion(StoppingCriteria):
    """Keeps the tensors it is given as they are and never stops (transformers gives a new tensor each step)."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor | None, **kwargs: Any
    ) -> torch.BoolTensor:
        self.seen.append(input_ids)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


@pytest.mark.parametrize("every", [1, 4])
def test_what_a_stopping_criterion_was_given_stays_after_the_next_call(every: int) -> None:
    built = build("llama", eos=False)
    kept = KeepingCriterion()
    criteria = StoppingCriteriaList([kept])
    first = fast(built, built.inputs(1, 9, 1), max_new_tokens=NEW, stopping_criteria=criteria, stop_check_every=every)
    given = [tensor.clone() for tensor in kept.seen]
    fast(built, built.inputs(1, 9, 2), max_new_tokens=NEW, stop_check_every=every)
    assert len(given) == NEW  # once per new token, as `_sample` calls its criteria
    assert torch.equal(given[-1], first)
    assert all(torch.equal(now, then) for now, then in zip(kept.seen, given, strict=True))


@pytest.mark.parametrize("every", [1, 8])
def test_the_first_token_is_streamed_right_after_the_prefill(every: int) -> None:
    """Time to first token: the prefill's token reaches the streamer before any decoding step runs, whatever
    `stop_check_every` is; later tokens at each host check."""
    built = build("llama", eos=False)
    forwards: list[int] = []
    built.model.register_forward_hook(lambda module, args, output: forwards.append(1))

    class Counting(RecordingStreamer):
        def __init__(self) -> None:
            super().__init__()
            self.forwards_at_put: list[int] = []

        def put(self, value: torch.Tensor) -> None:
            super().put(value)
            self.forwards_at_put.append(len(forwards))

    streamer = Counting()
    fast(built, built.inputs(1, 9, 1), max_new_tokens=NEW, streamer=streamer, stop_check_every=every)
    assert streamer.forwards_at_put[1] == 1  # the prompt's put, then the first token's after the prefill alone
    assert streamer.forwards_at_put[2] == 1 + every


@pytest.mark.parametrize("eos", [True, False])
@pytest.mark.parametrize("every", [1, 4])
def test_custom_stopping_criteria_stop_each_row_where_generate_stops_it(eos: bool, every: int) -> None:
    built = build("llama", eos=eos)
    if eos:
        built.model.generation_config.eos_token_id = 3  # not produced here: the criterion does the stopping
    inputs = built.inputs(2, 9, 1)
    free = zoo.generate_tokens(built.model, inputs, max_new_tokens=NEW)
    criteria = StoppingCriteriaList([StopAfterToken(int(free[0, 13]), 9)])  # row 0 stops at its 5th token
    expected = zoo.generate_tokens(built.model, inputs, max_new_tokens=NEW, stopping_criteria=criteria)
    got = fast(built, inputs, max_new_tokens=NEW, stopping_criteria=criteria, stop_check_every=every)
    assert torch.equal(got, expected)
    assert not torch.equal(free, expected) or not eos  # with an end token, row 0 is padded after its stop


def test_a_criterion_that_stops_every_row_ends_the_call_there() -> None:
    built = build("llama", eos=False)
    inputs = built.inputs(2, 9, 1)
    free = zoo.generate_tokens(built.model, inputs, max_new_tokens=NEW)
    both = StoppingCriteriaList([StopAfterToken(int(free[0, 12]), 9), StopAfterToken(int(free[1, 12]), 9)])
    expected = zoo.generate_tokens(built.model, inputs, max_new_tokens=NEW, stopping_criteria=both)
    got = fast(built, inputs, max_new_tokens=NEW, stopping_criteria=both, stop_check_every=8)
    assert torch.equal(got, expected)
    assert got.shape[1] < free.shape[1]


def test_stop_strings_with_a_tokenizer_stop_where_generate_stops() -> None:
    built = build("llama", eos=True)
    built.model.generation_config.eos_token_id = 3
    built.model.generation_config.pad_token_id = 0
    inputs = built.inputs(2, 9, 1)
    tokenizer = zoo.letters_tokenizer(int(built.model.config.vocab_size))
    free = zoo.generate_tokens(built.model, inputs, max_new_tokens=NEW)
    stop = tokenizer.decode([int(free[1, 14])])
    settings: dict[str, Any] = {"max_new_tokens": NEW, "stop_strings": [stop], "tokenizer": tokenizer}
    expected = zoo.generate_tokens(built.model, inputs, **settings)
    assert not torch.equal(expected, free)
    assert torch.equal(fast(built, inputs, **settings, stop_check_every=5), expected)


def test_max_time_is_read_at_host_checks() -> None:
    built = build("llama", eos=False)
    inputs = built.inputs(2, 9, 1)
    expected = zoo.generate_tokens(built.model, inputs, max_new_tokens=NEW, max_time=1e-9)
    got = fast(built, inputs, max_new_tokens=NEW, max_time=1e-9, stop_check_every=4)
    assert torch.equal(got, expected)  # both stop at the first token: the time was up before it
    assert got.shape[1] == 10
    assert torch.equal(
        fast(built, inputs, max_new_tokens=NEW, max_time=600.0),
        zoo.generate_tokens(built.model, inputs, max_new_tokens=NEW),
    )


def test_host_criteria_with_beam_search_fall_back_by_name() -> None:
    built = build("t5", eos=True)
    criteria = StoppingCriteriaList([StopAfterToken(5, 1)])
    with pytest.raises(UnsupportedGenerationError, match=r"stopping_criteria \(a StopAfterToken\) with beam"):
        fast(built, built.inputs(2, 9, 1), max_new_tokens=6, num_beams=2, stopping_criteria=criteria)
