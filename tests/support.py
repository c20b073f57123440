"""Helpers the tests share: waiting for an engine's state, and one request decoded alone."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

import cachelife


def until(condition: Callable[[], bool], seconds: float = 60.0) -> None:
    """Wait until `condition()` holds; fail the test after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("the engine did not get there in time")
        time.sleep(0.01)


def alone(model: PreTrainedModel, **kwargs: Any) -> torch.Tensor:
    """`cachelife.generate` of one request with an eager step, no fallback: what an engine's request equals."""
    tokens = cachelife.generate(model, compile_step=False, fallback=False, **kwargs)
    assert isinstance(tokens, torch.Tensor)
    return tokens
