"""cachelife.Engine on the CPU: concurrent requests, each equal to its own `cachelife.generate` call."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError, Future
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import MistralConfig, MistralForCausalLM

import cachelife
from cachelife.errors import (
    EngineClosedError,
    InvalidArgumentError,
    QueueFullError,
    RequestTimeoutError,
    UnsupportedGenerationError,
)
from cachelife.generation import steps as loop_steps
from cachelife.serving import prefill as prefill_module
from cachelife.serving.engine import Engine
from cachelife.serving.row_ngrams import LONGEST_NGRAM
from cachelife.serving.row_writes import RowWrites
from cachelife.tools import zoo
from cachelife.tools.recording import RecordingStreamer
from support import alone, several_sequence_requests, stand_in_graphs, until


def build(name: str) -> zoo.ZooModel:
    built = zoo.build(name)
    if name == "whisper":
        zoo.whisper_tiny_generation(built.model.generation_config)
    return built


@pytest.fixture(scope="module")
def llama() -> zoo.ZooModel:
    return build("llama")


def requests_of(built: zoo.ZooModel, count: int) -> Iterator[dict[str, Any]]:
    """Requests of different prompt lengths and budgets."""
    for index in range(count):
        inputs = built.inputs(1, 2 + (5 * index) % 9, index)
        yield {**inputs, "max_new_tokens": 2 + (7 * index) % 11}


@pytest.mark.parametrize(("name", "options"), [("llama", {}), ("whisper", {}), ("t5", {"encoder_length": 16})])
def test_concurrent_requests_each_equal_their_own_generate(name: str, options: dict[str, Any]) -> None:
    built = build(name)
    requests = list(requests_of(built, 7))
    if name == "whisper":  # other languages: other decoder prompts, one program
        for index, request in enumerate(requests):
            request["language"] = ("en", "de", "fr")[index % 3]
    with Engine(built.model, rows=3, max_length=40, compile_step=False, **options) as engine:
        futures = [engine.submit(**request) for request in requests]
        results = [future.result(timeout=120) for future in futures]
        stats = engine.stats()
    assert stats.joins == len(requests)
    assert 0 < stats.prefill_seconds < stats.join_seconds  # a join also places the prompt and picks a token
    assert 0 < stats.collect_seconds < stats.step_seconds
    for request, result in zip(requests, results, strict=True):
        assert torch.equal(result, alone(built.model, **request))
        assert torch.equal(result, zoo.generate_tokens(built.model, request))


def test_the_compiled_step_with_joins_at_every_step_and_moves(llama: zoo.ZooModel) -> None:
    # Two rows and a short cache: newcomers join at every step position of the other row, and the rows'
    # content is moved to make room for longer prompts. Whether a round moves anything depends on the order in
    # which the requests' threads hand them over (a first round waits for the step's compilation): the rounds
    # go on until one has.
    requests = list(requests_of(llama, 9))
    expected = [zoo.generate_tokens(llama.model, request) for request in requests]
    with Engine(llama.model, rows=2, max_length=24) as engine:
        for _ in range(4):
            futures = [engine.submit(**request) for request in requests]
            results = [future.result(timeout=300) for future in futures]
            for want, got in zip(expected, results, strict=True):
                assert torch.equal(got, want)
            if engine.stats().moves > 0:
                break
        assert engine.stats().moves > 0


@pytest.fixture(name="stand_in_graphs")
def stand_in_graphs_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graphs "captured" on the CPU: the warm-up runs one step, every replay runs the captured calls."""
    stand_in_graphs(monkeypatch)


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.usefixtures("stand_in_graphs")
def test_graphs_of_several_steps_keep_every_row_on_its_own_draws(llama: zoo.ZooModel) -> None:
    # A graph's first call runs one step, its replays three: each sampling row's k-th token still uses its
    # generator's k-th draw, as in cachelife.generate alone.
    requests = list(requests_of(llama, 6))
    for request in requests[1::2]:
        request.update(do_sample=True, top_k=0, temperature=0.7)

    def seeded(index: int) -> torch.Generator:
        return torch.Generator().manual_seed(index)

    with Engine(llama.model, rows=3, max_length=40, steps_per_call=3) as engine:
        futures = [engine.submit(**request, generator=seeded(i)) for i, request in enumerate(requests)]
        results = [future.result(timeout=120) for future in futures]
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        expected = cachelife.generate(llama.model, fallback=False, steps_per_call=3, generator=seeded(index), **request)
        assert isinstance(expected, torch.Tensor)
        assert torch.equal(result, expected), index


@pytest.mark.parametrize("steps_per_call", [1, 3])
@pytest.mark.parametrize(("name", "options"), [("whisper", {}), ("t5", {"encoder_length": 16})])
def test_encoder_decoder_prefills_replay_one_graph_per_prompt_shape(
    name: str, options: dict[str, Any], steps_per_call: int, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    # Under (stand-in) graphs an encoder-decoder model's prefill is captured once per decoder prompt shape
    # and replayed for every later newcomer, never through transformers' eager `_prefill`, and so are the
    # writes of its keys and values into its row; each request still equals its own generate, so the replays
    # write the self- and cross-attention keys and values anew, in the newcomer's row.
    built = build(name)
    requests = list(requests_of(built, 6))
    if name == "whisper":
        for index, request in enumerate(requests):
            request["language"] = ("en", "de", "fr")[index % 3]
    expected = [alone(built.model, **request, steps_per_call=steps_per_call) for request in requests]
    captured: list[object] = []
    stand_in_graphs(monkeypatch, captured)

    def no_eager_prefill(*args: object, **kwargs: object) -> object:
        raise AssertionError("the engine ran transformers' eager prefill")

    monkeypatch.setattr(type(built.model), "_prefill", no_eager_prefill)
    with Engine(built.model, rows=2, max_length=40, steps_per_call=steps_per_call, **options) as engine:
        results = [future.result(timeout=120) for future in [engine.submit(**request) for request in requests]]
    # The decoding step's graph, one prefill graph (one decoder prompt length), the row writes' graph and the
    # row starts' (the newcomer's rows, settings and first token: `serving.row_starts`).
    assert len(captured) == 4
    # The engine's caches are its own for its whole life: no advice to enable the model for a cache pool.
    assert not [record for record in caplog.records if "not enabled" in record.getMessage()]
    for want, got in zip(expected, results, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("together", [False, True])
def test_decoder_only_prefills_replay_one_graph_per_group_size_and_prompt_bucket(
    llama: zoo.ZooModel, together: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under (stand-in) graphs a decoder-only model's newcomers, alone or several at one boundary, are prefilled
    # from a graph of their group size and prompt bucket (prompts padded to a power of two), never by the
    # compiled forward without graphs or by transformers' eager prefill; each request still equals its own
    # generate, so the replays read each group's own prompts and write each newcomer's own row.
    lengths = (3, 5, 8, 6, 11, 16, 9, 20)  # buckets 8, 8, 8, 8, 16, 16, 16, 32
    requests = [{**llama.inputs(1, length, index), "max_new_tokens": 3 + index % 4}
                for index, length in enumerate(lengths)]  # fmt: skip
    expected = [alone(llama.model, **request) for request in requests]
    captured: list[object] = []
    stand_in_graphs(monkeypatch, captured)

    def refused(*args: object, **kwargs: object) -> object:
        raise AssertionError("a newcomer was prefilled without a graph")

    monkeypatch.setattr(type(llama.model), "_prefill", refused)
    monkeypatch.setattr(prefill_module.Prefill, "_compiled_forward", refused)
    with Engine(llama.model, rows=4, max_length=40) as engine:
        if together:  # pairs at one boundary each: groups of two, of one bucket each
            results = []
            for first in range(0, len(requests), 2):
                pair = engine._gate.at_once(functools.partial(submitted_all, engine, requests[first : first + 2]))
                results += [future.result(timeout=120) for future in pair]
        else:
            results = [engine.submit(**request).result(timeout=120) for request in requests]
        prefills = engine.stats().prefills
    # The step's graph, the row writes of the one-row (two-row) scratch, the row starts', and a prefill graph per
    # bucket: alone
    # 8, 16 and 32, prompts that fill their bucket (8, 16) included (their mask is built in the graph, as for the
    # padded ones: transformers' eager preparation would drop it); in pairs the buckets of (3, 5), (8, 6),
    # (11, 16), (9, 20).
    assert len(captured) == 6
    assert prefills == (len(requests) if not together else len(requests) // 2)
    for index, (want, got) in enumerate(zip(expected, results, strict=True)):
        assert torch.equal(got, want), index


@pytest.mark.slow
def test_a_new_prompt_bucket_captures_without_compiling_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each prompt bucket's graph reads static twins of its inputs, new tensors for every bucket. Compiled for real,
    # under stand-in graphs: once two buckets have made the prompt length dynamic, a third bucket's capture
    # compiles nothing (a guard on the twins' identity would compile the forward again for every bucket).
    built = zoo.build("llama")
    stand_in_graphs(monkeypatch, compiled=True)
    requests = [{**built.inputs(1, length, length), "max_new_tokens": 3} for length in (3, 12, 20)]  # 8, 16, 32
    with Engine(built.model, rows=2, max_length=40) as engine:
        results = [engine.submit(**request).result(timeout=600) for request in requests[:2]]
        compiled = counters["stats"]["unique_graphs"]
        results.append(engine.submit(**requests[2]).result(timeout=600))
        assert counters["stats"]["unique_graphs"] == compiled
    for request, result in zip(requests, results, strict=True):
        assert torch.equal(result, zoo.generate_tokens(built.model, request))


def submitted_all(engine: Engine, requests: list[dict[str, Any]]) -> list[Future[Any]]:
    return [engine.submit(**request) for request in requests]


def test_sampling_with_a_seed_equals_generate_with_that_seed(llama: zoo.ZooModel) -> None:
    sampling = {"do_sample": True, "top_k": 0, "temperature": 0.8}
    requests = [{**request, **sampling} for request in requests_of(llama, 4)]
    with Engine(llama.model, rows=2, max_length=40, compile_step=False) as engine:
        futures = [
            engine.submit(**request, generator=torch.Generator().manual_seed(seed))
            for seed, request in enumerate(requests)
        ]
        results = [future.result(timeout=120) for future in futures]
    for seed, (request, result) in enumerate(zip(requests, results, strict=True)):
        expected = alone(llama.model, **request, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(result, expected)


@pytest.mark.parametrize("name", ["llama", "whisper"])
def test_streamers_get_what_generate_gives_them(name: str) -> None:
    # The prompt first (transformers' generate puts it), then one tensor per new token, then one end():
    # what cachelife.generate (and model.generate) give a streamer for the same request alone.
    built = build(name)
    requests = [{**request, "max_new_tokens": 4 + 3 * index} for index, request in enumerate(requests_of(built, 4))]
    streamers = [RecordingStreamer() for _ in requests]
    with Engine(built.model, rows=2, max_length=40, compile_step=False) as engine:
        futures = [engine.submit(**request, streamer=one) for request, one in zip(requests, streamers, strict=True)]
        results = [future.result(timeout=120) for future in futures]
    for request, streamer, result in zip(requests, streamers, results, strict=True):
        expected = RecordingStreamer()
        alone(built.model, **request, streamer=expected)
        assert streamer.ends == expected.ends == 1
        assert len(streamer.values) == len(expected.values)
        for got, want in zip(streamer.values, expected.values, strict=True):
            assert torch.equal(got, want)
        streamed = torch.cat([value.reshape(1, -1) for value in streamer.values], dim=1)
        assert torch.equal(streamed[:, -result.shape[1] :], result)  # Whisper returns less than its prompt


def test_a_caller_may_reuse_its_input_tensors_once_submit_returns(llama: zoo.ZooModel) -> None:
    # One row and one request thread: the second request is prepared only after the first has ended, long
    # after its caller wrote the next prompt into the tensors it had submitted.
    first = {**llama.inputs(1, 6, 0), "max_new_tokens": 8}
    second = llama.inputs(1, 6, 1)
    expected = alone(llama.model, **{name: value.clone() for name, value in second.items()}, max_new_tokens=8)
    with Engine(llama.model, rows=1, max_length=40, prepare_ahead=0, compile_step=False) as engine:
        engine.submit(**first)
        reused = engine.submit(**second, max_new_tokens=8)
        for name, value in llama.inputs(1, 6, 2).items():
            second[name].copy_(value)
        result = reused.result(timeout=120)
    assert torch.equal(result, expected)


def test_a_streamer_slower_than_its_row_gets_its_own_tokens_after_the_row_is_reused(llama: zoo.ZooModel) -> None:
    # The first request's streamer holds its first new token until the second request, which takes the
    # same row once the first has ended, is done: what it is given then must still be the first's tokens.
    second_done = threading.Event()

    def hold(count: int) -> None:
        if count == 2:  # the prompt came first
            second_done.wait(timeout=60)

    first = {**llama.inputs(1, 4, 0), "max_new_tokens": 6}
    second = {**llama.inputs(1, 7, 1), "max_new_tokens": 9}
    streamer = RecordingStreamer(hold)
    with Engine(llama.model, rows=1, max_length=40, compile_step=False) as engine:
        first_future = engine.submit(**first, streamer=streamer)
        second_future = engine.submit(**second)
        second_future.add_done_callback(lambda _: second_done.set())
        result = first_future.result(timeout=120)
    assert second_done.is_set()
    assert torch.equal(result, alone(llama.model, **first))
    streamed = torch.cat([value.reshape(1, -1) for value in streamer.values], dim=1)
    assert torch.equal(streamed, result)


def test_new_tokens_reach_the_streamer_while_the_row_decodes(llama: zoo.ZooModel) -> None:
    decoding_at_first_new_token: list[int] = []
    engine = Engine(llama.model, rows=1, max_length=256, compile_step=False)

    def on_put(count: int) -> None:
        if count == 2:  # the prompt came first
            decoding_at_first_new_token.append(engine.stats().decoding)

    with engine:
        request = {**llama.inputs(1, 4, 0), "max_new_tokens": 200, "min_new_tokens": 200}
        engine.submit(**request, streamer=RecordingStreamer(on_put)).result(timeout=120)
    assert decoding_at_first_new_token == [1]


def test_a_failing_streamer_fails_its_request_alone(llama: zoo.ZooModel) -> None:
    def fail(count: int) -> None:
        if count == 3:
            raise RuntimeError("the client went away")

    steady = {**llama.inputs(1, 5, 1), "max_new_tokens": 12}
    with Engine(llama.model, rows=2, max_length=64, compile_step=False) as engine:
        failing = engine.submit(**llama.inputs(1, 4, 0), max_new_tokens=30, min_new_tokens=30,
                                streamer=RecordingStreamer(fail))  # fmt: skip
        other = engine.submit(**steady)
        with pytest.raises(RuntimeError, match="the client went away"):
            failing.result(timeout=120)
        assert torch.equal(other.result(timeout=120), alone(llama.model, **steady))
        until(lambda: engine.stats().held == 0 and engine.stats().decoding == 0)


def test_requests_of_other_settings_wait_for_their_own_batch(llama: zoo.ZooModel) -> None:
    requests = list(requests_of(llama, 6))
    for index, request in enumerate(requests):
        if index % 2:
            request.update(repetition_penalty=1.5, min_new_tokens=2)
    with Engine(llama.model, rows=3, max_length=40, compile_step=False) as engine:
        results = [future.result(timeout=120) for future in [engine.submit(**r) for r in requests]]
    for request, result in zip(requests, results, strict=True):
        assert torch.equal(result, alone(llama.model, **request))


def test_async_requests(llama: zoo.ZooModel) -> None:
    requests = list(requests_of(llama, 4))

    async def main(engine: Engine) -> list[Any]:
        return list(await asyncio.gather(*(engine.generate(**request) for request in requests)))

    with Engine(llama.model, rows=2, max_length=40, compile_step=False) as engine:
        results = asyncio.run(main(engine))
    for request, result in zip(requests, results, strict=True):
        assert torch.equal(result, alone(llama.model, **request))


@pytest.mark.parametrize("name", ["llama", "whisper"])
def test_async_streams_yield_the_new_tokens_as_they_come(name: str) -> None:
    built = build(name)
    requests = [{**request, "max_new_tokens": 3 + 4 * index} for index, request in enumerate(requests_of(built, 3))]

    async def collect(engine: Engine, request: dict[str, Any]) -> list[int]:
        return [token async for token in engine.stream(**request)]

    async def main(engine: Engine) -> list[list[int]]:
        return list(await asyncio.gather(*(collect(engine, request) for request in requests)))

    with Engine(built.model, rows=2, max_length=40, compile_step=False) as engine:
        streamed = asyncio.run(main(engine))
    for request, tokens in zip(requests, streamed, strict=True):
        expected = RecordingStreamer()
        alone(built.model, **request, streamer=expected)
        assert tokens == [int(value) for value in torch.cat(expected.values[1:])]


def test_leaving_a_stream_early_cancels_its_request(llama: zoo.ZooModel) -> None:
    long = {**llama.inputs(1, 4, 0), "max_new_tokens": 200, "min_new_tokens": 200}

    async def first_three_then_wait(engine: Engine) -> list[int]:
        tokens = []
        async with contextlib.aclosing(engine.stream(**long)) as stream:
            async for token in stream:
                tokens.append(token)
                if len(tokens) == 3:
                    break
        # The loop stays alive (a request that went on would still stream): the row must leave by itself.
        deadline = time.monotonic() + 60
        while engine.stats().held or engine.stats().decoding:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        return tokens

    with Engine(llama.model, rows=1, max_length=256, compile_step=False) as engine:
        assert len(asyncio.run(first_three_then_wait(engine))) == 3
        assert engine.stats().steps < 150  # the row left long before its 200 tokens
        with pytest.raises(InvalidArgumentError, match="brings its own streamer"):
            engine.stream(**long, streamer=RecordingStreamer())


def test_a_failing_request_fails_alone(llama: zoo.ZooModel, monkeypatch: pytest.MonkeyPatch) -> None:
    good = list(requests_of(llama, 3))
    bad: dict[str, Any] = {"input_ids": torch.tensor([[7] * 13]), "max_new_tokens": 4}  # its prefill fails
    prefill = prefill_module.Prefill.__call__

    def failing_for_the_bad_one(self: Any, input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        if input_ids.shape[1] == 13:
            raise IndexError("index out of range in self")
        return prefill(self, input_ids, *args)

    joint = prefill_module.Prefill.joint

    def joint_failing_with_the_bad_one(self: Any, input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        # The bad prompt (padded to its bucket with copies of its first token) in a prefill, alone or with others:
        # it fails, and each newcomer goes alone.
        if bool(((input_ids == 7).sum(dim=1) >= 13).any()):
            raise IndexError("index out of range in self")
        return joint(self, input_ids, *args)

    monkeypatch.setattr(prefill_module.Prefill, "__call__", failing_for_the_bad_one)
    monkeypatch.setattr(prefill_module.Prefill, "joint", joint_failing_with_the_bad_one)
    with Engine(llama.model, rows=2, max_length=40, compile_step=False) as engine:
        futures = [engine.submit(**good[0]), engine.submit(**bad), engine.submit(**good[1]), engine.submit(**good[2])]
        with pytest.raises(IndexError):
            futures[1].result(timeout=120)
        results = [futures[index].result(timeout=120) for index in (0, 2, 3)]
        assert engine.stats().held == 0
    for request, result in zip(good, results, strict=True):
        assert torch.equal(result, alone(llama.model, **request))


def test_a_cancelled_request_leaves_its_row(llama: zoo.ZooModel) -> None:
    long = {**llama.inputs(1, 4, 0), "max_new_tokens": 200, "min_new_tokens": 200}  # no early end
    short = {**llama.inputs(1, 5, 1), "max_new_tokens": 3}
    with Engine(llama.model, rows=1, max_length=256, compile_step=False) as engine:
        first = engine.submit(**long)
        until(lambda: engine.stats().decoding == 1)
        assert first.cancel()
        second = engine.submit(**short)
        assert torch.equal(second.result(timeout=120), alone(llama.model, **short))
        until(lambda: engine.stats().held == 0)
        assert engine.stats().decoding == 0
    with pytest.raises(CancelledError):
        first.result()


def test_a_request_past_its_timeout_fails_with_a_timeout(llama: zoo.ZooModel) -> None:
    # The only row is busy for a few hundred steps: the late request is still waiting at its first check.
    with Engine(llama.model, rows=1, max_length=256, compile_step=False) as engine:
        blocking = engine.submit(**llama.inputs(1, 4, 0), max_new_tokens=250, min_new_tokens=250)
        until(lambda: engine.stats().decoding == 1)
        late = engine.submit(**llama.inputs(1, 4, 1), max_new_tokens=4, timeout=0.01)
        with pytest.raises(RequestTimeoutError, match=r"timeout of 0\.01 s"):
            late.result(timeout=120)
        blocking.result(timeout=120)


def test_a_full_queue_refuses_at_once(llama: zoo.ZooModel) -> None:
    gate = threading.Event()
    with Engine(llama.model, rows=1, max_length=40, queue_size=0, prepare_ahead=0, compile_step=False) as engine:
        engine._workers.submit(gate.wait)  # the only worker is busy: the first request stays held
        held = engine.submit(**llama.inputs(1, 4, 0), max_new_tokens=2)
        with pytest.raises(QueueFullError, match="holds 1 requests"):
            engine.submit(**llama.inputs(1, 4, 1), max_new_tokens=2)
        gate.set()
        held.result(timeout=120)


def test_close_fails_what_waits_and_finishes_what_decodes(llama: zoo.ZooModel) -> None:
    long = {**llama.inputs(1, 4, 0), "max_new_tokens": 200, "min_new_tokens": 200}  # no early end
    engine = Engine(llama.model, rows=1, max_length=256, compile_step=False)
    decoding = engine.submit(**long)
    until(lambda: engine.stats().decoding == 1)
    waiting = engine.submit(**llama.inputs(1, 4, 1), max_new_tokens=4)
    until(lambda: engine.stats().waiting == 1)
    engine.close()
    assert torch.equal(decoding.result(timeout=60), alone(llama.model, **long))
    with pytest.raises(EngineClosedError, match="before the request got a row"):
        waiting.result(timeout=60)
    with pytest.raises(EngineClosedError, match="takes no new requests"):
        engine.submit(**llama.inputs(1, 4, 2), max_new_tokens=2)


@pytest.mark.parametrize(
    ("request_kwargs", "error", "match"),
    [
        ({"max_new_tokens": 2, "input_ids": torch.ones(2, 3, dtype=torch.long)}, InvalidArgumentError, "batch of 2"),
        ({"max_new_tokens": 2}, InvalidArgumentError, "needs input_ids"),
        ({"max_new_tokens": 2, "input_ids": torch.ones(1, 3, dtype=torch.long), "steps_per_call": 2},
         InvalidArgumentError, "the engine's settings"),
        ({"max_new_tokens": 2, "input_ids": torch.ones(1, 3, dtype=torch.long), "output_attentions": True,
          "return_dict_in_generate": True}, UnsupportedGenerationError, "output_attentions"),
        ({"input_ids": torch.tensor(5)}, InvalidArgumentError, r"shape \(1, length\), got shape \(\)"),
        ({"input_ids": torch.tensor([5, 6])}, InvalidArgumentError, r"shape \(1, length\), got shape \(2,\)"),
        ({"input_ids": torch.ones(1, 0, dtype=torch.long)}, InvalidArgumentError, r"got shape \(1, 0\)"),
        ({"input_ids": torch.ones(1, 3)}, InvalidArgumentError, "as torch.long .* got torch.float32"),
        ({"input_ids": torch.tensor([[5, 320]])}, InvalidArgumentError, r"ids from 0 to 319 .* got 5\.\.320"),
        ({"input_ids": torch.tensor([[-1, 5]])}, InvalidArgumentError, r"got -1\.\.5"),
        ({"input_ids": torch.ones(1, 3, dtype=torch.long), "max_new_tokens": -1}, InvalidArgumentError,
         "generation settings are invalid: `max_new_tokens` must be greater than 0, but is -1"),
    ],
)  # fmt: skip
def test_bad_requests_are_refused_before_any_work(
    llama: zoo.ZooModel, request_kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with Engine(llama.model, rows=1, max_length=16, compile_step=False) as engine:
        with pytest.raises(error, match=match):
            engine.submit(**request_kwargs)
        assert engine.stats().held == 0


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"num_beams": 2}, InvalidArgumentError, "num_beams=2, which takes 2 of the engine's rows; the engine has 1"),
        ({"max_new_tokens": 60}, InvalidArgumentError, r"max_length is 64 \(prompt 4 \+ new tokens\); the engine"),
        ({"max_length": 30}, InvalidArgumentError, r"max_length is 30 \(prompt 4"),
        ({"encoder_no_repeat_ngram_size": 2}, UnsupportedGenerationError, "encoder_no_repeat_ngram_size"),
        ({"exponential_decay_length_penalty": (2, 1.5)}, UnsupportedGenerationError,
         "exponential_decay_length_penalty"),
        ({"do_sample": True, "num_return_sequences": 2}, InvalidArgumentError,
         "num_return_sequences=2, which takes 2 of the engine's rows; the engine has 1"),
        ({"return_dict_in_generate": True}, UnsupportedGenerationError, "return_dict_in_generate=True"),
    ],
)  # fmt: skip
def test_what_the_engine_does_not_decode_is_refused_at_submit_by_name(
    llama: zoo.ZooModel, settings: dict[str, Any], error: type[Exception], match: str
) -> None:
    with Engine(llama.model, rows=1, max_length=16, compile_step=False) as engine:
        budget = {} if "max_length" in settings else {"max_new_tokens": 4}
        with pytest.raises(error, match=match):
            engine.submit(**llama.inputs(1, 4, 0), **{**budget, **settings})
        assert engine.stats().held == 0


def test_several_sequences_of_a_whisper_request_are_refused_at_submit_by_name() -> None:
    # Whisper's generate decodes them as a batch of copies of the audio (before, the request's future failed
    # once generate had prepared it, naming "3 sequences for one request of 1 row(s)").
    built = build("whisper")
    with Engine(built.model, rows=4, max_length=16, compile_step=False) as engine:
        with pytest.raises(UnsupportedGenerationError, match="num_return_sequences=3 for Whisper"):
            engine.submit(**built.inputs(1, 0, 0), max_new_tokens=3, do_sample=True, num_return_sequences=3)
        assert engine.stats().held == 0


def test_a_request_leaves_its_generator_where_its_own_generate_leaves_it(llama: zoo.ZooModel) -> None:
    """One draw per token step, whatever the rows drew ahead: a caller that reuses its generator for its next
    request draws what it would after `cachelife.generate` (before, the engine's rows drew more: a call past
    the row's end, which the host sees a call later)."""
    ends = list(range(40, 200, 10))
    requests = [{**llama.inputs(1, 4, index), "max_new_tokens": 10, "do_sample": True, "top_k": 3,
                 "eos_token_id": ends, **({"num_return_sequences": 2} if index % 2 else {})}
                for index in range(4)]  # fmt: skip
    mine = [torch.Generator().manual_seed(index) for index in range(4)]
    with Engine(llama.model, rows=3, max_length=32, compile_step=False) as engine:
        for future in [engine.submit(**request, generator=mine[index]) for index, request in enumerate(requests)]:
            future.result(timeout=120)
    for index, request in enumerate(requests):
        theirs = torch.Generator().manual_seed(index)
        alone(llama.model, generator=theirs, **request)
        assert torch.equal(mine[index].get_state(), theirs.get_state()), index


def test_sampled_whisper_segments_decode_as_their_own_generate() -> None:
    """A sampled Whisper request with timestamps decodes a second pass (its next segment) from the generator
    its first pass left, as its own `generate` does (before, that pass drew other noise: other tokens)."""
    built = build("whisper")
    request = {**built.inputs(1, 0, 0), "max_new_tokens": 7, "return_timestamps": True, "do_sample": True}
    with Engine(built.model, rows=2, max_length=32, compile_step=False) as engine:
        futures = [engine.submit(**request, generator=torch.Generator().manual_seed(seed)) for seed in range(6)]
        results = [future.result(timeout=120) for future in futures]
    for seed, got in enumerate(results):
        assert torch.equal(got, alone(built.model, generator=torch.Generator().manual_seed(seed), **request)), seed


def test_what_generate_prepares_past_the_rows_fails_the_request_by_name() -> None:
    # Whisper's decoder prompt is known once its generate prepared it: a request whose prompt and new tokens
    # pass the engine's max_length fails its future, naming both.
    built = build("whisper")
    with Engine(built.model, rows=1, max_length=12, compile_step=False) as engine:
        future: Future[Any] = engine.submit(**built.inputs(1, 0, 0), max_new_tokens=11)
        with pytest.raises(InvalidArgumentError, match="the engine's max_length is 12"):
            future.result(timeout=120)


def test_models_whose_caches_the_rows_cannot_share_are_refused() -> None:
    sliding = MistralConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=8,
    )  # fmt: skip
    with pytest.raises(UnsupportedGenerationError, match="sliding-window attention layers"):
        Engine(MistralForCausalLM(sliding).eval(), compile_step=False)
    with pytest.raises(InvalidArgumentError, match="pass encoder_length"):
        Engine(zoo.build("t5").model)


def test_engine_sizes_past_the_models_positions_or_the_devices_memory_are_refused_before_allocating() -> None:
    with pytest.raises(InvalidArgumentError, match="max_length=257 is past LlamaForCausalLM's 256 positions"):
        Engine(zoo.build("llama").model, max_length=257, compile_step=False)
    t5 = zoo.build("t5").model  # relative positions: no bound but the memory
    with pytest.raises(InvalidArgumentError, match=r"rows=8 and 100000000\d positions would take .* GiB free"):
        Engine(t5, max_length=10**9, encoder_length=16, compile_step=False)


def test_a_failure_after_the_prefill_fails_the_batch_and_the_engine_goes_on(
    llama: zoo.ZooModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = RowWrites.write
    failures = iter([RuntimeError("a copy failed")])

    def failing_once(self: RowWrites, *args: Any) -> None:
        error = next(failures, None)
        if error is not None:
            raise error
        write(self, *args)

    monkeypatch.setattr(RowWrites, "write", failing_once)
    later = {**llama.inputs(1, 5, 1), "max_new_tokens": 3}
    with Engine(llama.model, rows=2, max_length=40, compile_step=False) as engine:
        with pytest.raises(RuntimeError, match="a copy failed"):
            engine.submit(**llama.inputs(1, 4, 0), max_new_tokens=3).result(timeout=60)
        assert torch.equal(engine.submit(**later).result(timeout=60), alone(llama.model, **later))
        until(lambda: engine.stats().held == 0)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_decoder_only_prefills_run_one_compiled_forward_for_every_prompt_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With a compiled step a decoder-only newcomer's prefill is a compiled forward, never transformers' eager
    # `_prefill`, and prompts of six lengths take at most three compilations (the first length, then the length
    # as a dynamic size, under a recompile limit that six static ones would pass); each request still equals its
    # own generate.
    built = build("llama")
    requests = list(requests_of(built, 6))
    assert len({request["input_ids"].shape[1] for request in requests}) == 6
    expected = [cachelife.generate(built.model, fallback=False, **request) for request in requests]

    def no_eager_prefill(*args: object, **kwargs: object) -> object:
        raise AssertionError("the engine ran transformers' eager prefill")

    monkeypatch.setattr(type(built.model), "_prefill", no_eager_prefill)
    with torch._dynamo.config.patch(recompile_limit=3), Engine(built.model, rows=2, max_length=40) as engine:
        results = [future.result(timeout=300) for future in [engine.submit(**request) for request in requests]]
    for want, got in zip(expected, results, strict=True):
        assert isinstance(want, torch.Tensor)
        assert torch.equal(got, want)


def test_a_prefill_that_does_not_compile_falls_back_to_the_eager_one_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    built = build("llama")
    requests = list(requests_of(built, 3))
    expected = [alone(built.model, **request) for request in requests]

    def uncompilable(model: object, name: str, function: Any, mode: str, options: object, *, kind: object) -> Any:
        if not name.startswith("engine prefill"):
            return function

        def fails(**arguments: Any) -> None:
            function(**arguments)  # as a failed compilation may leave the scratch cache half written
            raise RuntimeError("stands in for a compilation error")

        return fails

    monkeypatch.setattr(prefill_module, "compiled_step", uncompilable)
    monkeypatch.setattr(loop_steps, "compiled_step", uncompilable)
    with caplog.at_level(logging.WARNING, logger="cachelife"), Engine(built.model, rows=2, max_length=40) as engine:
        results = [future.result(timeout=120) for future in [engine.submit(**request) for request in requests]]
    assert sum("failed to compile" in record.getMessage() for record in caplog.records) == 1
    for want, got in zip(expected, results, strict=True):
        assert torch.equal(got, want)


def left_padded_requests(built: zoo.ZooModel) -> list[dict[str, Any]]:
    """What a tokenizer with `padding=True` hands a client, one row each: prompts left-padded with their mask,
    the same without the mask (`generate` infers it from the pad token), and unpadded prompts beside them; two
    beam requests, one padded."""
    requests: list[dict[str, Any]] = []
    for index in range(6):
        padded = zoo.left_padded(built.inputs(1, 5 + index, index), 1 + index % 4, pad_token_id=0)
        if index % 2:
            del padded["attention_mask"]
        requests.append({**padded, "max_new_tokens": 4 + index})
        requests.append({**built.inputs(1, 3 + index, 10 + index), "max_new_tokens": 3 + index})
    requests[4].update(num_beams=2, max_new_tokens=12)
    requests[5].update(num_beams=2)
    return requests


@pytest.mark.parametrize(
    "compile_step",
    [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.exhaustive])],
    ids=["eager-step", "compiled-step"],
)
def test_left_padded_prompts_decode_as_generate_decodes_them(llama: zoo.ZooModel, compile_step: bool) -> None:
    """Each row's positions count from its first token and its mask leaves its pads out, as `generate`'s
    (before, positions counted from the row's start and the pads were attended: other tokens from the fourth
    new one on)."""
    model = llama.model
    assert model.generation_config.pad_token_id == 0
    requests = left_padded_requests(llama)
    expected = [zoo.generate_tokens(model, request) for request in requests]
    with Engine(model, rows=4, max_length=32, compile_step=compile_step) as engine:
        greedy = [r for r in requests if "num_beams" not in r]
        beams = [r for r in requests if "num_beams" in r]
        results = {id(r): engine.submit(**r) for r in greedy}
        results |= {id(r): engine.submit(**r) for r in beams}  # their own program, after the greedy ones
        for request, want in zip(requests, expected, strict=True):
            got = results[id(request)].result(timeout=300)
            assert torch.equal(got, want), request
            assert torch.equal(got, alone(model, **request))


@pytest.mark.parametrize(
    "settings",
    [
        {"do_sample": True, "num_return_sequences": 3},  # the per-row pipeline
        {"num_beams": 3, "num_return_sequences": 2},  # a beam program
        # programs of their own processors
        {"do_sample": True, "num_return_sequences": 2, "eta_cutoff": 0.03},
        {"do_sample": True, "num_return_sequences": 2, "epsilon_cutoff": 0.03},
    ],
    ids=["sampled-sequences", "beams", "eta-program", "epsilon-program"],
)
def test_a_repetition_penalty_skips_the_pads_of_a_request_of_several_rows(
    llama: zoo.ZooModel, settings: dict[str, Any]
) -> None:
    """`generate` gives the penalty one padding length per sequence of a left-padded prompt; the rows take the
    one length they share (before, a request of several rows failed as it joined, its lengths against the
    engine's rows: 'The size of tensor a (4) must match the size of tensor b (3)')."""
    model = llama.model
    requests = [
        {**zoo.left_padded(llama.inputs(1, 9, index), 2 + index, pad_token_id=0), "max_new_tokens": 5 + index,
         "repetition_penalty": 0.8 if index else 1.3, **settings}
        for index in range(2)
    ]  # fmt: skip

    def seeded(index: int) -> torch.Generator | None:
        return torch.Generator().manual_seed(index) if settings.get("do_sample") else None

    with Engine(model, rows=4, max_length=32, compile_step=False) as engine:
        futures = [engine.submit(**request, generator=seeded(index)) for index, request in enumerate(requests)]
        results = [future.result(timeout=120) for future in futures]
    for index, (request, got) in enumerate(zip(requests, results, strict=True)):
        assert torch.equal(got, alone(model, generator=seeded(index), **request)), index
        if not settings.get("do_sample"):
            assert torch.equal(got, zoo.generate_tokens(model, request))


def test_a_place_is_free_before_the_future_resolves(llama: zoo.ZooModel) -> None:
    """A caller that submits again the moment it has its result (here: in the future's callback, which runs
    as the future resolves) finds its place free, round after round."""
    rounds: list[torch.Tensor] = []
    failures: list[BaseException] = []
    request = {**llama.inputs(1, 4, 0), "max_new_tokens": 2}
    with Engine(llama.model, rows=1, max_length=16, queue_size=0, prepare_ahead=0, compile_step=False) as engine:
        done = threading.Event()

        def again(future: Future[Any]) -> None:
            rounds.append(future.result())
            if len(rounds) == 5:
                done.set()
                return
            try:
                engine.submit(**request).add_done_callback(again)
            except QueueFullError as error:
                failures.append(error)
                done.set()

        engine.submit(**request).add_done_callback(again)
        assert done.wait(120)
    assert failures == []
    assert len(rounds) == 5


def test_cancelled_and_expired_requests_give_their_places_back_while_waiting_for_a_thread(
    llama: zoo.ZooModel,
) -> None:
    gate = threading.Event()
    with Engine(llama.model, rows=1, max_length=16, queue_size=1, prepare_ahead=0, compile_step=False) as engine:
        engine._workers.submit(gate.wait)  # the only request thread is busy: requests wait for it
        try:
            first = engine.submit(**llama.inputs(1, 4, 0), max_new_tokens=2)
            second = engine.submit(**llama.inputs(1, 4, 1), max_new_tokens=2)
            with pytest.raises(QueueFullError):
                engine.submit(**llama.inputs(1, 4, 2), max_new_tokens=2)
            assert second.cancel()
            third = engine.submit(**llama.inputs(1, 4, 2), max_new_tokens=2, timeout=0.05)  # the place is free
            with pytest.raises(RequestTimeoutError, match=r"timeout of 0\.05 s"):
                third.result(timeout=10)  # failed by its deadline, not when a thread takes it up
            assert engine.stats().held == 1
        finally:
            gate.set()
        assert torch.equal(first.result(timeout=120), alone(llama.model, **llama.inputs(1, 4, 0), max_new_tokens=2))
    assert engine.stats().held == 0


def test_close_without_waiting_leaves_no_thread_behind(llama: zoo.ZooModel) -> None:
    before = set(threading.enumerate())
    engine = Engine(llama.model, rows=2, max_length=16, compile_step=False)
    engine.submit(**llama.inputs(1, 4, 0), max_new_tokens=4, timeout=30).result(timeout=120)
    started = set(threading.enumerate()) - before  # the scheduler, a request thread, the deadlines' watch
    assert len(started) >= 2
    engine.close(wait=False)
    until(lambda: not any(thread.is_alive() for thread in started), seconds=30)


@pytest.mark.parametrize("compile_step", [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.exhaustive])])
def test_a_mix_of_settings_decodes_together_each_as_its_own_generate(llama: zoo.ZooModel, compile_step: bool) -> None:
    # Every request's settings are values in its row: all of them share the per-row pipeline (its variants with
    # and without sampling and n-gram bans), and each request equals its own cachelife.generate with the same seed.
    pairs = zip(requests_of(llama, 11), zoo.mixed_settings(), strict=True)
    requests = [{**request, **settings} for request, settings in pairs]

    def seeded(index: int) -> torch.Generator:
        return torch.Generator().manual_seed(100 + index)

    with Engine(llama.model, rows=4, max_length=40, compile_step=compile_step) as engine:
        futures = [engine.submit(**request, generator=seeded(i)) for i, request in enumerate(requests)]
        results = [future.result(timeout=300) for future in futures]
        programs = engine.stats().programs
    assert programs <= 4
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        assert torch.equal(result, alone(llama.model, **request, generator=seeded(index))), (index, request)
        if not request.get("do_sample"):
            assert torch.equal(result, zoo.generate_tokens(llama.model, request)), (index, request)


def test_ngram_bans_of_each_rows_own_size_decode_as_generate(llama: zoo.ZooModel) -> None:
    # Greedy rows of n-gram sizes 0 to 4 in one batch, each equal to model.generate; the bans change the tokens
    # (the tiny model repeats itself without them). Sizes up to LONGEST_NGRAM are row values of the per-row
    # pipeline; a longer one runs a program of its own.
    sizes = [2, 0, 3, 1, 4, LONGEST_NGRAM + 1, 2]
    requests = [{**llama.inputs(1, 3 + index, index), "max_new_tokens": 24, "min_new_tokens": 24,
                 "no_repeat_ngram_size": size} for index, size in enumerate(sizes)]  # fmt: skip
    with Engine(llama.model, rows=3, max_length=40, compile_step=False) as engine:
        results = [future.result(timeout=120) for future in [engine.submit(**request) for request in requests]]
        programs = engine.stats().programs
    assert programs <= 3  # the greedy variants, with and without the bans, and the longer n-grams' own
    changed = 0
    for request, result in zip(requests, results, strict=True):
        assert torch.equal(result, zoo.generate_tokens(llama.model, request)), request
        unbanned = zoo.generate_tokens(llama.model, {**request, "no_repeat_ngram_size": 0})
        changed += int(not torch.equal(result, unbanned))
    assert changed >= 2


def test_bad_words_and_sequence_biases_read_each_rows_own_tokens_as_generate(llama: zoo.ZooModel) -> None:
    # A ban or bias of several tokens applies where a row's own last tokens are its prefix: each row reads its
    # own length (before: refused by name, as the rule read one length for the whole batch).
    plain = [{**llama.inputs(1, 3 + index, index), "max_new_tokens": 12} for index in range(6)]
    greedy = [zoo.generate_tokens(llama.model, request)[0].tolist() for request in plain]
    requests = []
    for index, (request, tokens) in enumerate(zip(plain, greedy, strict=True)):
        prompt = request["input_ids"].shape[1]
        first, second = tokens[prompt + 1], tokens[prompt + 2]  # the row's own second and third new tokens
        if index % 3 == 0:
            requests.append({**request, "bad_words_ids": [[first, second], [7]]})
        elif index % 3 == 1:
            requests.append({**request, "sequence_bias": {(first, second): -50.0, (11,): 2.0}})
        else:
            requests.append(request)
    with Engine(llama.model, rows=3, max_length=40, compile_step=False) as engine:
        results = [future.result(timeout=120) for future in [engine.submit(**request) for request in requests]]
    changed = 0
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        assert torch.equal(result, zoo.generate_tokens(llama.model, request)), index
        changed += int(result[0].tolist() != greedy[index])
    assert changed >= 3  # the bans and biases took effect where the rows' own tokens matched


def test_marians_checkpoint_settings_decode_in_the_engine_as_generate() -> None:
    # Marian's checkpoints ban the pad token (bad_words_ids [[pad]]) and search 4 beams.
    built = zoo.build("marian")
    requests = [{**built.inputs(1, 3 + (4 * index) % 7, index), "max_new_tokens": 4 + index} for index in range(5)]
    with Engine(built.model, rows=4, max_length=40, compile_step=False, encoder_length=16) as engine:
        results = [future.result(timeout=120) for future in [engine.submit(**request) for request in requests]]
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        assert torch.equal(result, zoo.generate_tokens(built.model, request)), index


def test_the_step_compiles_with_the_options_the_model_was_enabled_with(monkeypatch: pytest.MonkeyPatch) -> None:
    built = zoo.build("llama")
    cachelife.enable(built.model, options=cachelife.Options(compile_options={"epilogue_fusion": False}))
    compiled_with: list[dict[str, Any]] = []

    def recording_compile(function: Any, **kwargs: Any) -> Any:  # records, and leaves the function eager
        compiled_with.append(kwargs.get("options") or {})
        return function

    monkeypatch.setattr(torch, "compile", recording_compile)
    request = {**built.inputs(1, 5, 0), "max_new_tokens": 4}
    with Engine(built.model, rows=2, max_length=24) as engine:
        result = engine.submit(**request).result(timeout=120)
    assert torch.equal(result, zoo.generate_tokens(built.model, request))
    assert any(options.get("epilogue_fusion") is False for options in compiled_with)


@pytest.mark.parametrize(("name", "options"), [("llama", {}), ("t5", {"encoder_length": 16})])
def test_several_sampled_sequences_take_a_row_each_and_equal_their_own_generate(
    name: str, options: dict[str, Any]
) -> None:
    # Many end tokens: a request's sequences end at different steps, and the ended ones are padded as generate
    # pads them while the others go on.
    built = build(name)
    requests = several_sequence_requests(built, 6)

    def seeded(index: int) -> torch.Generator:
        return torch.Generator().manual_seed(100 + index)

    with Engine(built.model, rows=4, max_length=40, compile_step=False, **options) as engine:
        futures = [engine.submit(**request, generator=seeded(index)) for index, request in enumerate(requests)]
        results = [future.result(timeout=120) for future in futures]
    padded = 0
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        expected = cachelife.generate(
            built.model, compile_step=False, fallback=False, generator=seeded(index), **request
        )
        assert isinstance(expected, torch.Tensor)
        assert result.shape[0] == request.get("num_return_sequences", 1)
        assert torch.equal(result, expected), index
        ends = [int((row[1:] == 0).nonzero()[0]) if (row[1:] == 0).any() else None for row in result]
        padded += int(result.shape[0] > 1 and any(end is not None for end in ends))
    assert padded >= 1  # a sequence ended while another of its request's went on


def test_requests_of_other_temperatures_decode_at_once_in_one_program(llama: zoo.ZooModel) -> None:
    # Twelve temperatures, two rows: no request waits for another's settings (two of 40 new tokens each take
    # about 40 steps together, 80 one after the other), and the batch keeps the per-row pipeline only.
    prompt = llama.inputs(1, 6, 0)
    requests = [{**prompt, "do_sample": True, "top_k": 0, "temperature": 0.5 + index / 10, "max_new_tokens": 40,
                 "min_new_tokens": 40} for index in range(12)]  # fmt: skip
    with Engine(llama.model, rows=2, max_length=60, compile_step=False) as engine:
        first = [engine.submit(**request) for request in requests[:2]]
        for future in first:
            future.result(timeout=120)
        steps = engine.stats().steps
        for future in [engine.submit(**request) for request in requests[2:]]:
            future.result(timeout=120)
        stats = engine.stats()
    assert steps < 60
    assert stats.programs == 1  # the sampling variant alone: no row was greedy


@pytest.mark.parametrize("compile_step", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_whisper_requests_with_timestamps_decode_beside_others_each_as_its_own_generate(compile_step: bool) -> None:
    """Whisper's timestamp rules read each row's own length and decoder prompt (before: refused by name, as their
    rule read one length for the whole batch)."""
    built = build("whisper")
    requests = [{**built.inputs(1, 0, index), "return_timestamps": index % 2 == 0, "max_new_tokens": 10}
                for index in range(5)]  # fmt: skip
    expected = [alone(built.model, **request) for request in requests]
    with Engine(built.model, rows=2, max_length=32, compile_step=compile_step) as engine:
        got = [future.result(timeout=300) for future in [engine.submit(**request) for request in requests]]
    for mine, theirs in zip(got, expected, strict=True):
        assert torch.equal(mine, theirs)
    stamped = [tokens for request, tokens in zip(requests, got, strict=True) if request["return_timestamps"]]
    begin = int(vars(built.model.generation_config)["no_timestamps_token_id"]) + 1  # a field Whisper adds
    assert all(bool((tokens >= begin).any()) for tokens in stamped)  # timestamps were decoded


def test_whispers_long_form_decodes_in_the_engine_window_after_window_as_its_own_generate() -> None:
    """Audio longer than the window, with its mask: Whisper's own loop calls the engine for each window (its
    timestamps decoded per row), and the segments equal `cachelife.generate`'s."""
    built = build("whisper")
    generator = torch.Generator().manual_seed(0)
    requests: list[dict[str, Any]] = [
        {"input_features": torch.randn(1, 16, frames, generator=generator),
         "attention_mask": torch.ones(1, frames, dtype=torch.long), "return_timestamps": True, "return_segments": True}
        for frames in (150, 200)
    ]  # fmt: skip
    expected = [cachelife.generate(built.model, compile_step=False, fallback=False, **r) for r in requests]
    with Engine(built.model, rows=2, max_length=32, compile_step=False) as engine:
        got = [future.result(timeout=300) for future in [engine.submit(**request) for request in requests]]
    for mine, theirs in zip(got, expected, strict=True):
        assert isinstance(mine, dict)
        assert isinstance(theirs, dict)
        assert torch.equal(mine["sequences"], theirs["sequences"])
        windows = [[(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in o["segments"][0]]
                   for o in (mine, theirs)]  # fmt: skip
        assert windows[0] == windows[1]
        assert len(windows[0]) > 1
