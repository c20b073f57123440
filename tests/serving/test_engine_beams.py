"""Beam search in cachelife.Engine on the CPU: each request's beams are a group of rows, and each request equals
transformers' own beam search for it alone (fp32)."""

from __future__ import annotations

from concurrent.futures import CancelledError
from typing import Any

import pytest
import torch

import cachelife
from cachelife.errors import InvalidArgumentError
from cachelife.generation.beams import BeamPlan, BeamState, beam_step
from cachelife.serving.beam_groups import build_beam_program, start_group
from cachelife.serving.engine import Engine
from cachelife.tools import zoo
from cachelife.tools.recording import RecordingStreamer
from support import until


def build(name: str) -> zoo.ZooModel:
    built = zoo.build(name)
    if name == "whisper":
        zoo.whisper_tiny_generation(built.model.generation_config)
    return built


def beam_requests(built: zoo.ZooModel, count: int, *, whisper: bool = False) -> list[dict[str, Any]]:
    """Requests of different prompt lengths, budgets and beam settings (two programs: 2 and 3 beams)."""
    made = []
    for index in range(count):
        request = {**built.inputs(1, 2 + (5 * index) % 9, index), "max_new_tokens": 3 + (7 * index) % 11}
        request["num_beams"] = 3 if index % 3 else 2
        if index % 4 == 1:
            request.update(length_penalty=0.5, early_stopping=True)
        if index % 4 == 2 and not whisper:  # Whisper returns one sequence per input
            request["num_return_sequences"] = 2
        made.append(request)
    return made


@pytest.mark.parametrize(("name", "options"), [("llama", {}), ("whisper", {}), ("t5", {"encoder_length": 16})])
def test_beam_requests_each_equal_transformers_beam_search_alone(name: str, options: dict[str, Any]) -> None:
    built = build(name)
    requests = beam_requests(built, 8, whisper=name == "whisper")
    # 7 rows: two groups of 3 (one row no group holds) or three groups of 2.
    with Engine(built.model, rows=7, max_length=40, compile_step=False, **options) as engine:
        futures = [engine.submit(**request) for request in requests]
        results = [future.result(timeout=300) for future in futures]
        stats = engine.stats()
    # Whisper's generate may decode a request more than once (here: 2 beams, where its seek loop goes on).
    assert stats.joins == len(requests) if name != "whisper" else stats.joins >= len(requests)
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        expected = built.model.generate(**request)
        assert isinstance(expected, torch.Tensor)
        assert result.shape == expected.shape, index
        assert torch.equal(result, expected), index


@pytest.mark.slow
@pytest.mark.exhaustive
def test_beam_groups_under_the_compiled_step_with_joins_at_every_step_and_moves() -> None:
    llama = build("llama")
    requests = [
        {**llama.inputs(1, 2 + (5 * index) % 9, index), "max_new_tokens": 2 + (3 * index) % 7, "num_beams": 2}
        for index in range(7)
    ]
    with Engine(llama.model, rows=4, max_length=20) as engine:
        futures = [engine.submit(**request) for request in requests]
        results = [future.result(timeout=600) for future in futures]
        stats = engine.stats()
    assert stats.moves > 0
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        expected = cachelife.generate(llama.model, fallback=False, **request)
        assert isinstance(expected, torch.Tensor)
        assert torch.equal(result, expected), index


def test_beam_sampling_with_a_seed_equals_generate_with_that_seed() -> None:
    llama = build("llama")
    sampling = {"do_sample": True, "top_k": 0, "temperature": 0.8, "num_beams": 2}
    requests = [
        {**llama.inputs(1, 3 + index, index), "max_new_tokens": 4 + 2 * index, **sampling} for index in range(4)
    ]
    with Engine(llama.model, rows=4, max_length=40, compile_step=False) as engine:
        futures = [
            engine.submit(**request, generator=torch.Generator().manual_seed(seed))
            for seed, request in enumerate(requests)
        ]
        results = [future.result(timeout=120) for future in futures]
    for seed, (request, result) in enumerate(zip(requests, results, strict=True)):
        torch.manual_seed(seed)  # generate's sampling draws from the global generator with this seed
        expected = cachelife.generate(
            llama.model, fallback=False, compile_step=False, generator=torch.Generator().manual_seed(seed), **request
        )
        assert isinstance(expected, torch.Tensor)
        assert torch.equal(result, expected), seed


def test_a_cancelled_beam_request_frees_its_group_for_the_next() -> None:
    llama = build("llama")
    long = {**llama.inputs(1, 4, 0), "max_new_tokens": 200, "min_new_tokens": 200, "num_beams": 2}
    short = {**llama.inputs(1, 5, 1), "max_new_tokens": 5, "num_beams": 2}
    with Engine(llama.model, rows=2, max_length=256, compile_step=False) as engine:
        first = engine.submit(**long)
        until(lambda: engine.stats().decoding == 1)
        assert first.cancel()
        second = engine.submit(**short)
        expected = llama.model.generate(**short)
        assert isinstance(expected, torch.Tensor)
        assert torch.equal(second.result(timeout=120), expected)
        until(lambda: engine.stats().held == 0)
    with pytest.raises(CancelledError):
        first.result()


def test_more_beams_than_rows_are_refused_at_submit_by_name() -> None:
    llama = build("llama")
    with Engine(llama.model, rows=2, max_length=16, compile_step=False) as engine:
        with pytest.raises(
            InvalidArgumentError, match="num_beams=3, which takes 3 of the engine's rows; the engine has 2"
        ):
            engine.submit(**llama.inputs(1, 4, 0), max_new_tokens=4, num_beams=3)
        assert engine.stats().held == 0


def test_per_input_searches_stop_alone_and_one_search_stops_for_all() -> None:
    # Two inputs, the second ends at once (its limit is its prompt + 1): per input, the first goes on; as one
    # search (cachelife.generate's batch), both run while either may improve.
    torch.manual_seed(0)
    vocab, beams = 11, 2
    plan = BeamPlan.make((), None, batch=2, beams=beams, prompt_length=3, max_length=12, early_stopping=False,
                         length_penalty=1.0, device=torch.device("cpu"))  # fmt: skip
    grouped = plan.per_group()
    grouped.prompt.fill_(3)
    grouped.limit.copy_(torch.tensor([12, 4]))
    state = BeamState.allocate(grouped, torch.device("cpu"))
    prompt = torch.arange(3).expand(beams, 3)
    for group in range(2):
        state.start_input(group, prompt, 0)
    noise = torch.ones(2, beams * vocab)
    beam_step(state, torch.randn(2 * beams, vocab), grouped, noise)
    assert state.running.tolist() == [True, False]
    assert state.cur_len.tolist() == [4, 4]
    beam_step(state, torch.randn(2 * beams, vocab), grouped, noise)
    assert state.cur_len.tolist() == [5, 4]  # the ended input's state no longer changes

    single = BeamState.allocate(plan, torch.device("cpu"))
    single.start(torch.arange(3).expand(2 * beams, 3), plan, 0)
    beam_step(single, torch.randn(2 * beams, vocab), plan, noise)
    assert single.running.dim() == 0
    assert bool(single.running)


def test_a_newcomer_group_leaves_the_others_pending_reorder_and_running_flags() -> None:
    vocab, beams = 7, 2
    program = build_beam_program(
        (), ("key",), rows=5, beams=beams, eos=None, fill=0, width=64, early_stopping=False, length_penalty=1.0,
        do_sample=False, device=torch.device("cpu"),
    )  # fmt: skip
    state = BeamState.allocate(program.plan, torch.device("cpu"))
    assert program.plan.batch == 2  # five rows hold two groups of two
    prompt = torch.arange(3).expand(beams, 3)
    start_group(state, program, 0, prompt=prompt, max_length=20, logits=torch.randn(1, vocab),
                noise=torch.ones(beams, vocab))  # fmt: skip
    state.beam_idx[:beams] = torch.tensor([1, 1])  # group 0's reorder, pending for the next step
    start_group(state, program, 1, prompt=prompt, max_length=20, logits=torch.randn(1, vocab),
                noise=torch.ones(beams, vocab))  # fmt: skip
    assert state.beam_idx[:beams].tolist() == [1, 1]
    assert state.beam_idx[beams:].tolist() in ([2, 3], [2, 2], [3, 3], [3, 2])  # within its own group
    assert state.running.tolist() == [True, True]
    assert state.cur_len.tolist() == [4, 4]


def test_streamed_beam_requests_are_refused_before_any_work() -> None:
    llama = build("llama")
    request = {**llama.inputs(1, 4, 0), "max_new_tokens": 4, "num_beams": 2}
    with Engine(llama.model, rows=2, max_length=16, compile_step=False) as engine:
        with pytest.raises(InvalidArgumentError, match="num_beams=2"):
            engine.stream(**request)
        with pytest.raises(InvalidArgumentError, match="streams no tokens"):
            engine.submit(**request, streamer=RecordingStreamer())
        assert engine.stats().held == 0
