"""Compiled code in other threads keeps its guards while cachelife decodes: dynamo's stances are the whole
process's, so cachelife's compiled steps set none."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import cachelife
from cachelife.generation import steps as loop_steps
from cachelife.tools import zoo


def test_a_compiled_function_in_another_thread_is_guarded_while_a_step_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    scaled = torch.compile(lambda x, n: x * n, fullgraph=True)
    scaled(torch.ones(3), 1)  # compiled for n == 1; n == 2 must fail that graph's guard
    entered, release = threading.Event(), threading.Event()

    def held_open(function: Any) -> Any:  # the step's third call waits, inside whatever the loop set up
        calls = iter(range(1_000_000))

        def step(**kwargs: Any) -> Any:
            if next(calls) == 2:
                entered.set()
                release.wait(60)
            return function(**kwargs)

        return step

    monkeypatch.setattr(loop_steps, "compiled_step", lambda model, name, function, mode, options: held_open(function))
    built = zoo.build("llama")
    inputs = built.inputs(1, 5, 0)
    decoded: dict[str, Any] = {}

    def decode() -> None:
        decoded["tokens"] = cachelife.generate(built.model, fallback=False, max_new_tokens=6, **inputs)

    decoding = threading.Thread(target=decode)
    decoding.start()
    try:
        assert entered.wait(60)
        meanwhile = scaled(torch.ones(3), 2)
    finally:
        release.set()
        decoding.join(60)
    assert torch.equal(meanwhile, torch.full((3,), 2.0))
    assert torch.equal(decoded["tokens"], zoo.generate_tokens(built.model, inputs, max_new_tokens=6))
