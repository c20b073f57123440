"""Shared fixtures: small models from cachelife.tools.zoo, an encoder forward held while other calls arrive, and
the skip rule for GPU tests."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings
from transformers import PreTrainedModel

import cachelife
from support import HeldFirstForward, first_layer

# Stateful property tests: `ci` runs in every `nox -s tests` and `nox -s full`; `nox -s fuzz` selects `fuzz`.
settings.register_profile(
    "ci", max_examples=60, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "fuzz", max_examples=1500, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _quiet_transformers() -> Iterator[None]:
    # transformers logs generation-config advice at WARNING on every generate call of the tiny models.
    logger = logging.getLogger("transformers")
    previous = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(previous)


@pytest.fixture(autouse=True)
def _no_debug_handler() -> Iterator[None]:
    yield
    cachelife.disable_debug_logging()


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the marks added here count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:  # a test's model families beyond its `ci_families` are `exhaustive`
        families = item.get_closest_marker("ci_families")
        callspec = getattr(item, "callspec", None)
        if families is not None and callspec is not None and callspec.params.get("name") not in families.args:
            item.add_marker(pytest.mark.exhaustive)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: no CUDA device here (GPU tests are skipped, not passed)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def as_if_traced(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """A call that makes this thread's eager code look traced by dynamo, until `monkeypatch.undo()`: torch's
    compiling flag and a tracing context of this thread (what `cachelife.core.tracing.tracing_here` asks)."""

    def patch() -> None:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        monkeypatch.setattr(torch._guards.TracingContext, "try_get", staticmethod(object))

    return patch


@pytest.fixture
def held_encoder() -> Iterator[Callable[[PreTrainedModel], HeldFirstForward]]:
    """`held_encoder(model)` holds the first forward through the model's encoder (`support.HeldFirstForward`);
    every hold is released and removed after the test."""
    made: list[HeldFirstForward] = []

    def hold(model: PreTrainedModel) -> HeldFirstForward:
        made.append(HeldFirstForward(first_layer(model)))
        return made[-1]

    yield hold
    for held in made:
        held.release()
        held.remove()
