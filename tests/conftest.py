"""Shared fixtures: small models from cachelife.zoo, and the skip rule for GPU tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

import cachelife


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: no CUDA device here (GPU tests are skipped, not passed)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
