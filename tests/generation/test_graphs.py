"""cachelife's own graphs of the decoding step (`cachelife.generation.graphs`), on the CPU.

A stand-in for `torch.cuda.CUDAGraph` records the captured calls and replays them with the objects of the
call that captured them, as a CUDA graph replays with the addresses it captured. A later `generate` call
that reuses the graph must therefore pass the same buffers and have its settings' values copied into the
captured ones, or its tokens differ from `generate`'s: these tests check the graph keys, the reuse and the
copying where no GPU is. `test_gpu.py` runs the real capture.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import cachelife
from cachelife.generation import graphs
from cachelife.generation import steps as loop_steps
from cachelife.integration.runtime import runtime_of
from cachelife.tools import zoo

NEW = 12


class Recorded:
    """Replays the recorded calls; counts its replays."""

    def __init__(self, calls: Callable[[], None]) -> None:
        self.calls = calls
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.calls()


RECORDED: list[Recorded] = []


def record(warm_up: Callable[[], None], calls: Callable[[], None], device: torch.device, pool: object) -> Recorded:
    warm_up()
    RECORDED.append(Recorded(calls))
    return RECORDED[-1]


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Graphs captured on the CPU by the stand-in; the step runs eagerly unless a test compiles it."""
    monkeypatch.setattr(graphs, "capture", record)
    monkeypatch.setattr(graphs, "CAPTURING_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(loop_steps, "compiled_step", lambda model, name, function, mode, options, kind: function)
    RECORDED.clear()
    yield
    RECORDED.clear()


def whisper() -> zoo.ZooModel:
    built = zoo.build("whisper")
    zoo.whisper_tiny_generation(built.model.generation_config)
    cachelife.enable(built.model)  # its pool lends each call the same cache buffers: the graph's addresses
    return built


def bart() -> zoo.ZooModel:
    built = zoo.build("bart")
    config = built.model.generation_config
    config.eos_token_id = config.forced_eos_token_id = None  # the tiny BART would end every sequence at once
    cachelife.enable(built.model)
    return built


def check(built: zoo.ZooModel, *, steps: int = 1, **settings: Any) -> torch.Tensor:
    """cachelife.generate's tokens, checked equal to generate's."""
    inputs = built.inputs(2, 9, 1)
    got = cachelife.generate(built.model, fallback=False, steps_per_call=steps, **inputs, **settings)
    assert isinstance(got, torch.Tensor)
    expected = zoo.generate_tokens(built.model, inputs, **settings)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert torch.equal(got, expected), settings
    return got


WHISPER: dict[str, Any] = {
    "max_new_tokens": NEW, "language": "de", "task": "translate", "no_repeat_ngram_size": 2,
    "repetition_penalty": 1.3, "min_new_tokens": 4, "bad_words_ids": [[5], [6, 7]],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.usefixtures("recorded")
def test_greedy_graph_is_reused_with_the_settings_of_each_call() -> None:
    built = whisper()
    record = runtime_of(built.model)
    for steps in (1, 3):
        free = check(built, steps=steps, **WHISPER)
        captured = record.captures
        replays = sum(graph.replays for graph in RECORDED)
        check(built, steps=steps, **WHISPER)
        # Other values of the same settings, copied into the captured ones: a stale copy would show in the tokens
        # (a 0-dim max_length the last replay runs past: 1 + 3 + 3 + 3 steps for 8; a banned token it produced).
        check(built, steps=steps, **{**WHISPER, "max_new_tokens": NEW - 4})
        banned = check(built, steps=steps, **{**WHISPER, "bad_words_ids": [[int(free[0, -3])], [9, 10]]})
        assert not torch.equal(banned, free)
        stronger = check(built, steps=steps, **{**WHISPER, "min_new_tokens": 6, "repetition_penalty": 2.0})
        assert not torch.equal(stronger, free)  # values held as 0-dim tensors: copied, not recompiled
        assert record.captures == captured
        assert sum(graph.replays for graph in RECORDED) > replays
    assert record.captures == 2  # one graph per steps_per_call
    check(built, **{**WHISPER, "repetition_penalty": None})  # another processor list: another graph
    assert record.captures == 3
    check(built, **{**WHISPER, "no_repeat_ngram_size": 3})  # n shapes the step: another graph
    assert record.captures == 4


@pytest.mark.usefixtures("recorded")
def test_beam_graph_is_reused_across_lengths() -> None:
    built = bart()
    record = runtime_of(built.model)
    settings: dict[str, Any] = {
        "max_new_tokens": NEW, "num_beams": 3, "num_return_sequences": 2, "length_penalty": 2.0,
        "no_repeat_ngram_size": 2, "early_stopping": True,
    }  # fmt: skip
    for steps in (1, 3):
        check(built, steps=steps, **settings)
        captured = record.captures
        check(built, steps=steps, **{**settings, "max_new_tokens": NEW - 4, "length_penalty": 0.5})
        check(built, steps=steps, **{**settings, "early_stopping": "never"})  # a constant: another graph
        assert record.captures == captured + 1
    assert all(graph.replays > 0 for graph in RECORDED)


@pytest.mark.usefixtures("recorded")
def test_other_buffers_get_their_own_graph_and_old_graphs_are_dropped() -> None:
    first, second = whisper(), whisper()
    runtime_of(first.model).graphs.limit = 2
    check(first, max_new_tokens=NEW)
    check(second, max_new_tokens=NEW)  # other parameters and caches: not the first model's graph
    assert (runtime_of(first.model).captures, runtime_of(second.model).captures) == (1, 1)
    for rows in (1, 3):  # other shapes: other state buffers
        inputs = first.inputs(rows, 9, 1)
        got = cachelife.generate(first.model, fallback=False, max_new_tokens=NEW, **inputs)
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, zoo.generate_tokens(first.model, inputs, max_new_tokens=NEW))
    assert runtime_of(first.model).captures == 3
    assert len(runtime_of(first.model).graphs) == 2


@pytest.mark.usefixtures("recorded")
def test_a_step_compiled_with_other_options_gets_its_own_graph() -> None:
    built = whisper()
    inputs, record = built.inputs(2, 9, 1), runtime_of(built.model)
    expected = zoo.generate_tokens(built.model, inputs, max_new_tokens=NEW)
    for options, captures in ((None, 1), (cachelife.FAST_KERNELS, 2), (None, 2), (cachelife.FAST_KERNELS, 2)):
        got = cachelife.generate(built.model, fallback=False, compile_options=options, max_new_tokens=NEW, **inputs)
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, expected)
        assert record.captures == captures, options


@pytest.mark.usefixtures("recorded")
@pytest.mark.parametrize("beams", [1, 2])
@pytest.mark.parametrize("steps", [1, 3])
def test_sampling_in_graphs_is_reproducible_and_draws_as_without_graphs(steps: int, beams: int) -> None:
    """The k-th token is drawn with the generator's k-th draw: a graph's first call (one step before its
    capture, then replays) draws as its later calls, as calls without a graph and at any steps per call."""
    built = whisper()
    inputs = built.inputs(2, 9, 1)
    settings: dict[str, Any] = {"max_new_tokens": NEW, "do_sample": True, "temperature": 1.5, "num_beams": beams}

    def sample(seed: int = 7, **more: Any) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        out = cachelife.generate(
            built.model, fallback=False, generator=generator, **inputs, **{"steps_per_call": steps, **settings, **more}
        )
        assert isinstance(out, torch.Tensor)
        return out

    graphed = sample()
    assert runtime_of(built.model).captures == 1
    assert torch.equal(sample(), graphed)
    assert torch.equal(sample(compile_step=False), graphed)  # no graph
    assert torch.equal(sample(compile_step=False, steps_per_call=1), graphed)  # one step per call
    assert not torch.equal(sample(seed=8), graphed)  # the draws matter: not greedy in disguise


@pytest.mark.slow
@pytest.mark.exhaustive
def test_compiled_step_in_recorded_graphs_equals_generate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-step compiled function (inductor) that cachelife's graphs capture, for greedy and beams."""
    monkeypatch.setattr(graphs, "capture", record)
    monkeypatch.setattr(graphs, "CAPTURING_DEVICES", frozenset({"cpu"}))
    torch._dynamo.reset()
    built = whisper()
    for steps in (1, 2):
        check(built, steps=steps, **WHISPER)
        check(built, steps=steps, **{**WHISPER, "max_new_tokens": NEW - 3})
    check(built, steps=2, **WHISPER, num_beams=3)
    assert runtime_of(built.model).captures == 3


@pytest.mark.usefixtures("recorded")
def test_a_model_without_pool_is_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    built = zoo.build("t5")
    with caplog.at_level(logging.WARNING, logger="cachelife"):
        for _ in range(2):
            check(built, max_new_tokens=NEW)
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("cachelife")]
    assert len(warnings) == 1
    assert "is not enabled" in warnings[0]
    cachelife.enable(built.model)
    check(built, max_new_tokens=NEW)
    captured = runtime_of(built.model).captures
    check(built, max_new_tokens=NEW)
    assert runtime_of(built.model).captures == captured  # the pool's buffers: the same addresses, the same graph


@pytest.mark.usefixtures("recorded")
def test_a_graph_with_live_settings_reads_the_settings_its_caller_changes_between_replays() -> None:
    # Two engines' steps over the same state (an engine closed, the next given its addresses): the second
    # changes its settings in place between replays (a newcomer's per-row fields), so it must not replay the
    # first's graph, which reads the first's settings.
    model = zoo.build("llama").model
    state = torch.zeros(2)

    def steps_over(settings: dict[str, torch.Tensor]) -> graphs.GraphedSteps:
        def call(index: int, captured: object) -> None:
            state.add_(captured["add"])  # type: ignore[index]  # the settings dict below

        return graphs.GraphedSteps(
            model=model,
            name="engine",
            call=call,
            calls=1,
            in_place=state,
            settings=settings,
            device=torch.device("cpu"),
            live_settings=True,
        )

    steps_over({"add": torch.ones(2)}).advance()
    second = {"add": torch.full((2,), 2.0)}
    later = steps_over(second)
    later.advance()
    second["add"].fill_(5.0)
    later.advance()
    assert torch.equal(state, torch.full((2,), 1.0 + 2.0 + 5.0))
    assert len(RECORDED) == 2
