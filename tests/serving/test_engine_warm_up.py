"""`Engine.warm_up`: copies of an example request reach every prefill the first requests would need, so that
requests after it compile nothing."""

from __future__ import annotations

import functools
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from cachelife.errors import InvalidArgumentError
from cachelife.serving.engine import Engine
from cachelife.tools import zoo


def example(built: zoo.ZooModel, length: int, seed: int) -> dict[str, Any]:
    return {**built.inputs(1, length, seed), "max_new_tokens": 6}


def submitted(engine: Engine, requests: list[dict[str, Any]]) -> list[Future[Any]]:
    return [engine.submit(**request) for request in requests]


def test_the_warm_up_prefills_alone_at_two_lengths_and_every_group_size_at_once() -> None:
    built = zoo.build("llama")
    with Engine(built.model, rows=4, max_length=40, compile_step=False) as engine:
        engine.warm_up(**example(built, 10, 0))
        stats = engine.stats()
    # Alone at 10 and 5 tokens; groups of 2 and of 4: of 10 tokens each, of 10 and 5, of 5 each: 8 forwards over
    # 20 newcomers.
    assert (stats.prefills, stats.joins) == (8, 20)


def test_requests_after_the_warm_up_decode_as_model_generate() -> None:
    built = zoo.build("t5")
    batch = [example(built, 3 + index, index) for index in range(4)]
    with Engine(built.model, rows=2, max_length=40, compile_step=False, encoder_length=16) as engine:
        engine.warm_up(**batch[0])
        results = [future.result(timeout=120) for future in [engine.submit(**request) for request in batch]]
    for index, (request, result) in enumerate(zip(batch, results, strict=True)):
        assert torch.equal(result, zoo.generate_tokens(built.model, request)), index


def test_an_example_the_engine_refuses_is_refused_by_the_warm_up() -> None:
    built = zoo.build("llama")
    with Engine(built.model, rows=2, max_length=40, compile_step=False) as engine:
        with pytest.raises(InvalidArgumentError, match="max_length"):
            engine.warm_up(**{**example(built, 4, 0), "max_length": 12})
        with pytest.raises(InvalidArgumentError, match="num_beams=4"):
            engine.warm_up(**{**example(built, 4, 0), "num_beams": 4})


@pytest.mark.slow
def test_after_the_warm_up_newcomers_alone_and_together_compile_nothing() -> None:
    built = zoo.build("llama")
    with Engine(built.model, rows=2, max_length=40) as engine:
        engine.warm_up(**example(built, 12, 0))
        compiled = counters["stats"]["unique_graphs"]
        for length in (7, 15, 4):
            engine.submit(**example(built, length, length)).result(timeout=300)
            for extras in ((1, 3), (2, 2)):  # prompts of other lengths (one of them left-padded), of one length
                requests = [example(built, length + extra, extra) for extra in extras]
                pair = engine._gate.at_once(functools.partial(submitted, engine, requests))
                for future in pair:
                    future.result(timeout=300)
        stats = engine.stats()
    assert counters["stats"]["unique_graphs"] == compiled
    assert stats.prefills == 5 + 3 * 3  # the warm-up's, and three alone and six pairs in one forward each
