"""cachelife and compiled code in other threads: dynamo's stances and its "compiling" flag are the whole
process's, so cachelife's compiled steps set no stance, and its eager checks ask whether this thread traces."""

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

    monkeypatch.setattr(
        loop_steps, "compiled_step", lambda model, name, function, mode, options, kind: held_open(function)
    )
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


@pytest.mark.parametrize("call", ["cachelife.generate", "enabled generate"])
def test_decoding_while_another_thread_compiles(call: str) -> None:
    # torch.compiler.is_compiling() is True in every thread while one compiles; pinning refused to run then
    # ("inside a compiled region") and an enabled model's hooks skipped their work.
    entered, release = threading.Event(), threading.Event()

    def held_open_backend(graph: torch.fx.GraphModule, inputs: Any) -> Any:
        entered.set()
        release.wait(60)
        return graph

    compiling = threading.Thread(
        target=lambda: torch.compile(lambda x: x * 3, backend=held_open_backend)(torch.ones(2))
    )
    built = zoo.build("llama")
    cachelife.enable(built.model)
    inputs = built.inputs(2, 7, 0)
    expected = zoo.generate_tokens(built.model, inputs, max_new_tokens=6)
    compiling.start()
    try:
        assert entered.wait(60)
        assert torch.compiler.is_compiling()  # torch's flag, seen from this thread
        if call == "cachelife.generate":
            got = cachelife.generate(built.model, fallback=False, compile_step=False, max_new_tokens=6, **inputs)
        else:
            got = zoo.generate_tokens(built.model, inputs, max_new_tokens=6, cache_implementation="static")
    finally:
        release.set()
        compiling.join(60)
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got, expected)
