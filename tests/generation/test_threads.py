"""Concurrent calls on one model: every output equals the same call made alone.

Threads start together (a barrier) and each decodes its own inputs; the expected outputs come from the same
calls made one after another first. The steps run eagerly (`compile_step=False`): the state buffers, the pool,
the static encoder copies and the lock are the same as with a compiled step, without minutes of compilation
(the compiled and CUDA-graph cases run in `tests/test_gpu.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import cachelife
from cachelife.generation.decode import decode as bare_decode
from cachelife.tools import zoo

THREADS = 6


def together(calls: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
    """Run every call in its own thread, all released at once, and return their results in order."""
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], torch.Tensor]) -> torch.Tensor:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def tokens(output: object) -> torch.Tensor:
    assert isinstance(output, torch.Tensor)
    return output


def fast(model: Any, **kwargs: Any) -> Callable[[], torch.Tensor]:
    return lambda: tokens(cachelife.generate(model, fallback=False, compile_step=False, **kwargs))


@pytest.mark.parametrize("enabled", [True, False])
def test_threads_of_one_shape_on_one_llama_each_get_their_own_greedy_tokens(enabled: bool) -> None:
    built = zoo.build("llama")
    model = cachelife.enable(built.model) if enabled else built.model
    inputs = [built.inputs(2, 9, seed) for seed in range(THREADS)]
    settings: dict[str, Any] = {"max_new_tokens": 40, "min_new_tokens": 40}
    expected = [zoo.generate_tokens(model, i, **settings) for i in inputs]
    for _ in range(2):
        got = together([fast(model, **i, **settings) for i in inputs])
        assert [torch.equal(g, e) for g, e in zip(got, expected, strict=True)] == [True] * THREADS


def test_threads_of_t5_beam_search_each_get_their_own_beams() -> None:
    built = zoo.build("t5")
    model = cachelife.enable(built.model)
    inputs = [built.inputs(2, 9, seed) for seed in range(THREADS)]
    settings: dict[str, Any] = {"max_new_tokens": 12, "num_beams": 2}
    expected = [zoo.generate_tokens(model, i, **settings) for i in inputs]
    got = together([fast(model, **i, **settings) for i in inputs])
    assert [torch.equal(g, e) for g, e in zip(got, expected, strict=True)] == [True] * THREADS


def test_threads_with_other_lengths_and_padded_masks_keep_their_encoder_outputs() -> None:
    built = zoo.build("t5")
    model = cachelife.enable(built.model)
    inputs = []
    for seed in range(THREADS):
        one = built.inputs(2, 9, seed)
        one["attention_mask"][1, 9 - 1 - seed % 4 :] = 0  # right padding of another length per thread
        inputs.append(one)
    lengths = [4 + 3 * seed for seed in range(THREADS)]
    expected = [zoo.generate_tokens(model, i, max_new_tokens=n) for i, n in zip(inputs, lengths, strict=True)]
    got = together([fast(model, **i, max_new_tokens=n) for i, n in zip(inputs, lengths, strict=True)])
    assert [torch.equal(g, e) for g, e in zip(got, expected, strict=True)] == [True] * THREADS


def test_threads_sampling_with_their_own_generators_draw_what_they_draw_alone() -> None:
    built = zoo.build("llama")
    model = cachelife.enable(built.model)
    inputs = built.inputs(2, 9, 1)

    def sample(seed: int) -> Callable[[], torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return fast(model, **inputs, max_new_tokens=16, do_sample=True, top_k=0, generator=generator)

    expected = [sample(seed)() for seed in range(THREADS)]
    assert len({tuple(e.flatten().tolist()) for e in expected}) > 1  # the seeds matter
    got = together([sample(seed) for seed in range(THREADS)])
    assert [torch.equal(g, e) for g, e in zip(got, expected, strict=True)] == [True] * THREADS


def test_threads_mixing_cachelife_generate_model_generate_and_decode() -> None:
    built = zoo.build("llama")
    model = cachelife.enable(built.model)
    inputs = [built.inputs(2, 9, seed) for seed in range(THREADS)]
    settings: dict[str, Any] = {"max_new_tokens": 20, "min_new_tokens": 20}
    expected = [zoo.generate_tokens(model, i, **settings) for i in inputs]

    def static(one: dict[str, Any]) -> Callable[[], torch.Tensor]:
        return lambda: zoo.generate_tokens(model, one, **settings, cache_implementation="static")

    def decode(one: dict[str, Any]) -> Callable[[], torch.Tensor]:
        return lambda: bare_decode(model, one, max_new_tokens=20, compile_step=False)

    kinds = [fast(model, **inputs[0], **settings), static(inputs[1]), decode(inputs[2])]
    kinds += [fast(model, **inputs[3], **settings), static(inputs[4]), decode(inputs[5])]
    got = together(kinds)
    # decode has no min_new_tokens: its tokens are generate's up to the first end token, padded after it.
    for index in (2, 5):
        assert torch.equal(got[index], zoo.generate_tokens(model, inputs[index], max_new_tokens=20))
    for index in (0, 1, 3, 4):
        assert torch.equal(got[index], expected[index]), index
