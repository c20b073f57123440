"""cachelife.Engine's scheduler: first come, first served by submission time; a scheduler that fails closes the
engine with every request it holds failed by the cause; stops only the host reads (`stop_strings` with a
tokenizer, custom stopping criteria) end each row where its own `generate` ends; the host reads the rows one
call late, so that the device never waits for it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from cachelife.errors import EngineClosedError, UnsupportedGenerationError
from cachelife.serving import preparation
from cachelife.serving import requests as request_checks
from cachelife.serving.engine import Engine
from cachelife.serving.joint_prefill import joint_groups
from cachelife.serving.rows import Rows
from cachelife.serving.snapshots import Snapshot, Snapshots
from cachelife.tools import zoo
from cachelife.tools.recording import RecordingStreamer
from support import alone, until


@pytest.fixture(scope="module")
def llama() -> zoo.ZooModel:
    return zoo.build("llama")


class Gate:
    """Holds the engine's steps while closed: what is submitted meanwhile waits."""

    def __init__(self, engine: Engine) -> None:
        self.open = threading.Event()
        advance = engine._batch.advance

        def gated() -> None:
            self.open.wait()
            advance()

        engine._batch.advance = gated  # type: ignore[method-assign]


def test_a_request_prepared_later_still_joins_in_its_submission_order(
    llama: zoo.ZooModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared = request_checks.prepared_processors

    def slow_for_the_first(model: Any, input_ids: torch.Tensor, **arguments: Any) -> Any:
        if input_ids.shape[1] == 7:  # the earlier request: its preparation ends after the later one's
            time.sleep(0.5)
        return prepared(model, input_ids, **arguments)

    monkeypatch.setattr(preparation, "prepared_processors", slow_for_the_first)
    ended: list[str] = []
    with Engine(llama.model, rows=1, max_length=64, compile_step=False, prepare_ahead=2) as engine:
        gate = Gate(engine)
        busy = engine.submit(**llama.inputs(1, 4, 0), max_new_tokens=3)
        until(lambda: engine.stats().decoding == 1)
        earlier = engine.submit(**llama.inputs(1, 7, 1), max_new_tokens=3)
        later = engine.submit(**llama.inputs(1, 5, 2), max_new_tokens=3)
        until(lambda: engine.stats().waiting == 2)
        earlier.add_done_callback(lambda _: ended.append("earlier"))
        later.add_done_callback(lambda _: ended.append("later"))
        gate.open.set()
        for future in (busy, earlier, later):
            future.result(timeout=60)
    assert ended == ["earlier", "later"]


def joint_requests(built: zoo.ZooModel) -> list[dict[str, Any]]:
    """Seven newcomers of a boundary: prompts of 2 to 11 tokens, two left-padded (mask passed, mask inferred),
    one sampling with a seed, one with a repetition penalty."""
    requests: list[dict[str, Any]] = [
        {**built.inputs(1, length, 20 + length), "max_new_tokens": 3 + length % 4} for length in (2, 11, 6, 9, 4)
    ]
    padded = zoo.left_padded(built.inputs(1, 8, 40), 3, pad_token_id=0)
    requests.append({**padded, "max_new_tokens": 5})
    inferred = zoo.left_padded(built.inputs(1, 7, 41), 2, pad_token_id=0)
    del inferred["attention_mask"]
    requests.append({**inferred, "max_new_tokens": 6})
    requests[2].update(do_sample=True, temperature=0.7, top_k=20)
    requests[3].update(repetition_penalty=1.3)
    return requests


@pytest.mark.parametrize(
    "compile_step",
    [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.exhaustive])],
    ids=["eager-step", "compiled-step"],
)
def test_newcomers_of_one_boundary_share_one_prefill_and_each_decodes_as_alone(
    llama: zoo.ZooModel, compile_step: bool
) -> None:
    """Seven requests that wait while a step runs join at the next boundary through one forward (padded to the
    joint prefill's eight rows); each decodes as its own `cachelife.generate` and `generate` would (before, each
    had a forward of its own)."""
    model = llama.model
    requests = joint_requests(llama)
    seeds = {2: 5}
    with Engine(model, rows=8, max_length=48, compile_step=compile_step) as engine:
        gate = Gate(engine)
        busy = engine.submit(**llama.inputs(1, 5, 0), max_new_tokens=4)
        until(lambda: engine.stats().decoding == 1)
        futures = [
            engine.submit(**request, generator=torch.Generator().manual_seed(seeds[index]) if index in seeds else None)
            for index, request in enumerate(requests)
        ]
        until(lambda: engine.stats().waiting == len(requests))
        gate.open.set()
        results = [future.result(timeout=300) for future in futures]
        busy.result(timeout=60)
        stats = engine.stats()
    assert (stats.joins, stats.prefills) == (8, 2)
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        generator = torch.Generator().manual_seed(seeds[index]) if index in seeds else None
        assert torch.equal(result, alone(model, generator=generator, **request)), index
        if index not in seeds:
            assert torch.equal(result, zoo.generate_tokens(model, request)), index


def test_joint_groups_take_neighbours_up_to_the_largest_scratch() -> None:
    class Joint:
        most = 4

        def takes(self, joining: Any) -> bool:
            return bool(joining.groupable)

    class Newcomer:
        def __init__(self, name: str, groupable: bool) -> None:
            self.name, self.groupable = name, groupable

    newcomers = [Newcomer(name, name != "beams") for name in ("a", "b", "beams", "c", "d", "e", "f", "g", "h")]
    groups = joint_groups(newcomers, Joint())  # type: ignore[arg-type]  # stand-ins with what it reads
    assert [[newcomer.name for newcomer in group] for group in groups] == [  # type: ignore[attr-defined]
        ["a", "b"], ["beams"], ["c", "d", "e", "f"], ["g", "h"]
    ]  # fmt: skip


def test_a_failing_scheduler_closes_the_engine_and_fails_every_request_it_holds_with_the_cause(
    llama: zoo.ZooModel, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine(llama.model, rows=1, max_length=64, compile_step=False)
    gate = Gate(engine)
    broken = RuntimeError("the step's buffers are gone")

    def failing(error: BaseException) -> None:  # a step failed, and handing its rows their error fails too
        raise broken

    engine._batch.fail_all = failing  # type: ignore[method-assign]
    engine._batch.collect = lambda: (_ for _ in ()).throw(RuntimeError("a step failed"))  # type: ignore[method-assign]
    decoding = engine.submit(**llama.inputs(1, 4, 0), max_new_tokens=3)
    until(lambda: engine.stats().decoding == 1)
    queued = engine.submit(**llama.inputs(1, 5, 1), max_new_tokens=3)
    until(lambda: engine.stats().waiting == 1)
    gate.open.set()
    for future in (decoding, queued):
        with pytest.raises(EngineClosedError, match=r"scheduler failed .*buffers are gone") as raised:
            future.result(timeout=60)
        assert raised.value.__cause__ is broken
    with pytest.raises(EngineClosedError, match="scheduler failed"):
        engine.submit(**llama.inputs(1, 4, 0), max_new_tokens=3)
    assert engine.stats().held == 0
    engine.close()
    assert "the scheduler failed" in caplog.text
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("cachelife-engine")]


def test_requests_after_a_failed_step_are_still_served(llama: zoo.ZooModel) -> None:
    """A step's failure is its rows' (the engine goes on); only the scheduler's own failure closes it."""
    with Engine(llama.model, rows=1, max_length=64, compile_step=False) as engine:
        advance, failures = engine._batch.advance, iter([RuntimeError("one step failed")])

        def failing_once() -> None:
            error = next(failures, None)
            if error is not None:
                raise error
            advance()

        engine._batch.advance = failing_once  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="one step failed"):
            engine.submit(**llama.inputs(1, 4, 0), max_new_tokens=3).result(timeout=60)
        request = {**llama.inputs(1, 5, 1), "max_new_tokens": 3}
        assert torch.equal(engine.submit(**request).result(timeout=60), alone(llama.model, **request))


class StopAfter(StoppingCriteria):
    """Stops a row once `token` appears among its new tokens (after a prompt of `prompt` tokens)."""

    def __init__(self, token: int, prompt: int) -> None:
        self.token, self.prompt = token, prompt

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
        return (input_ids[:, self.prompt :] == self.token).any(dim=1)


def test_stop_strings_and_host_criteria_stop_each_request_where_its_own_generate_stops(llama: zoo.ZooModel) -> None:
    model = llama.model
    tokenizer = zoo.letters_tokenizer(int(model.config.vocab_size))
    requests: list[dict[str, Any]] = []
    for index in range(4):
        inputs = llama.inputs(1, 5 + index, index)
        free = alone(model, **inputs, max_new_tokens=12)
        stop_token = int(free[0, inputs["input_ids"].shape[1] + 4])  # the 5th new token
        if index % 2 == 0:
            stops = {"stop_strings": [tokenizer.decode([stop_token])], "tokenizer": tokenizer}
        else:
            stops = {"stopping_criteria": StoppingCriteriaList([StopAfter(stop_token, inputs["input_ids"].shape[1])])}
        requests.append({**inputs, "max_new_tokens": 12, **stops})
    requests.append({**llama.inputs(1, 6, 9), "max_new_tokens": 12})  # no stop: decodes beside the others
    expected = [alone(model, **request) for request in requests]
    streamers = [RecordingStreamer() for _ in requests]
    with Engine(model, rows=3, max_length=64, compile_step=False, steps_per_call=3) as engine:
        futures = [
            engine.submit(**request, streamer=streamer) for request, streamer in zip(requests, streamers, strict=True)
        ]
        got = [future.result(timeout=120) for future in futures]
    for request, mine, theirs, streamer in zip(requests, got, expected, streamers, strict=True):
        assert torch.equal(mine, theirs)
        prompt = request["input_ids"].shape[1]
        assert torch.equal(torch.cat([value.reshape(-1) for value in streamer.values[1:]]), mine[0, prompt:])
    assert all(tokens.shape[1] < requests[0]["input_ids"].shape[1] + 12 for tokens in got[:4])


def test_stop_strings_end_each_of_several_sampled_sequences_where_its_own_generate_ends_it(
    llama: zoo.ZooModel,
) -> None:
    # Thirty one-letter stop strings: each of a request's sequences stops on its own, read by the host a call
    # late; the row decodes no more, and its tokens past the stop are padded as generate pads them.
    model = llama.model
    tokenizer = zoo.letters_tokenizer(int(model.config.vocab_size))
    stops = {"stop_strings": [tokenizer.decode([token]) for token in range(10, 40)], "tokenizer": tokenizer}
    requests = []
    for index in range(6):
        request = {**llama.inputs(1, 3 + (5 * index) % 11, index), "max_new_tokens": 14, "do_sample": True,
                   "top_k": 0, "temperature": 1.3, **stops}  # fmt: skip
        if index % 2 == 0:
            request["num_return_sequences"] = 2 + index % 3
        requests.append(request)

    def seeded(index: int) -> torch.Generator:
        return torch.Generator().manual_seed(100 + index)

    with Engine(model, rows=4, max_length=40, compile_step=False, steps_per_call=2) as engine:
        futures = [engine.submit(**request, generator=seeded(index)) for index, request in enumerate(requests)]
        results = [future.result(timeout=120) for future in futures]
    stopped = 0
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        expected = alone(model, steps_per_call=2, generator=seeded(index), **request)
        assert torch.equal(result, expected), index
        stopped += int(result.shape[0] > 1 and result.shape[1] < request["input_ids"].shape[1] + 14)
    assert stopped >= 1  # a request's every sequence stopped before its budget


def test_host_side_stops_with_beam_search_are_refused_at_submit_by_name(llama: zoo.ZooModel) -> None:
    tokenizer = zoo.letters_tokenizer(int(llama.model.config.vocab_size))
    with Engine(llama.model, rows=2, max_length=64, compile_step=False) as engine:
        with pytest.raises(UnsupportedGenerationError, match="stop_strings with beam search"):
            engine.submit(**llama.inputs(1, 5, 0), num_beams=2, stop_strings=["a"], tokenizer=tokenizer)
        with pytest.raises(UnsupportedGenerationError, match="max_time with beam search"):
            engine.submit(**llama.inputs(1, 5, 0), num_beams=2, max_time=5.0)
        assert engine.stats().held == 0


def test_the_host_reads_each_call_s_rows_after_it_launched_the_next_two(
    llama: zoo.ZooModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device never waits for the host: at each boundary the rows' state of the call two calls before the
    last is read (two calls stay queued), and the tokens handed over still equal each request's own generate."""
    reads: list[tuple[int, int]] = []
    with Engine(llama.model, rows=2, max_length=64, compile_step=False) as engine:
        batch = engine._batch
        wait = Snapshot.wait

        def recorded(snapshot: Snapshot) -> None:
            reads.append((snapshot.taken, batch.calls))
            wait(snapshot)

        monkeypatch.setattr(Snapshot, "wait", recorded)
        requests = [{**llama.inputs(1, 4 + index, index), "max_new_tokens": 5 + 3 * index} for index in range(3)]
        streamers = [RecordingStreamer() for _ in requests]
        pairs = zip(requests, streamers, strict=True)
        got = [future.result(timeout=60) for future in [engine.submit(**r, streamer=s) for r, s in pairs]]
    assert reads
    assert all(taken == calls - 2 for taken, calls in reads)
    for request, tokens, streamer in zip(requests, got, streamers, strict=True):
        assert torch.equal(tokens, alone(llama.model, **request))
        streamed = torch.cat([value.reshape(-1) for value in streamer.values[1:]])
        assert torch.equal(streamed, tokens[0, request["input_ids"].shape[1] :])


def test_snapshots_take_turns_between_three_sets_of_buffers() -> None:
    rows = Rows.allocate(2, 6, 8, torch.device("cpu"))
    snapshots = Snapshots.allocate(rows)
    rows.length.copy_(torch.tensor([3, 4]))
    first = snapshots.take(rows, taken=1, tokens=True)
    rows.length.copy_(torch.tensor([5, 6]))
    rows.tokens[1, 4] = 9
    second = snapshots.take(rows, taken=2, tokens=False)
    rows.length.copy_(torch.tensor([7, 8]))
    third = snapshots.take(rows, taken=3, tokens=False)
    # Two calls after the first, its copy is still whole: the host reads it then.
    assert (first.length.tolist(), second.length.tolist(), third.length.tolist()) == ([3, 4], [5, 6], [7, 8])
    assert first.tokens is not None
    assert int(first.tokens[1, 4]) == 0
    assert second.tokens is None
    fourth = snapshots.take(rows, taken=4, tokens=True)
    assert fourth.length.data_ptr() == first.length.data_ptr()
    assert fourth.tokens is not None
    assert int(fourth.tokens[1, 4]) == 9


def test_rows_that_fill_the_engine_to_its_max_length_leave_room_for_the_call_the_host_runs_late(
    llama: zoo.ZooModel,
) -> None:
    """Requests of the engine's whole `max_length`, at three steps per call: the call that runs after a row's
    last (before the host reads that it ended) still writes inside the cache (before: an index error)."""
    with Engine(llama.model, rows=1, max_length=24, steps_per_call=3, compile_step=False) as engine:
        for prompt in range(3, 9):
            request = {**llama.inputs(1, prompt, prompt), "max_new_tokens": 24 - prompt, "min_new_tokens": 24 - prompt}
            assert torch.equal(engine.submit(**request).result(timeout=60), alone(llama.model, **request))
