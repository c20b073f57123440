"""Debug logging: silent by default, no handler unless asked, CACHELIFE_LOG honoured."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

import pytest
import torch
from transformers.cache_utils import StaticLayer

import cachelife
from cachelife.core.buffers import PinSpec
from cachelife.core.layer_lifecycle import LayerLifecycle
from cachelife.log import configure_from_environment

SPEC = PinSpec(
    batch_size=1, num_kv_heads=2, key_head_dim=4, value_head_dim=4, dtype=torch.float32, device=torch.device("cpu")
)


def test_no_handler_and_no_level_by_default() -> None:
    logger = logging.getLogger("cachelife")
    assert logger.handlers == []
    assert logger.level == logging.NOTSET


def test_enable_debug_logging_writes_one_line_per_transition() -> None:
    stream = io.StringIO()
    cachelife.enable_debug_logging(stream=stream)
    layer = StaticLayer(max_cache_len=3)
    LayerLifecycle.adopt(layer, index=2, role="self").pin(SPEC)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert "DEBUG cachelife.core.layer_lifecycle: layer=2 role=self pin: Unallocated -> Pinned" in lines[0]
    cachelife.disable_debug_logging()
    assert logging.getLogger("cachelife").handlers == []


def test_a_second_enable_replaces_the_handler() -> None:
    first = cachelife.enable_debug_logging(stream=io.StringIO())
    second = cachelife.enable_debug_logging(stream=io.StringIO())
    assert logging.getLogger("cachelife").handlers == [second]
    assert first is not second


@pytest.mark.parametrize(("value", "expect"), [("debug", "layer=0 role=self pin"), ("warning", "")])
def test_environment_variable(value: str, expect: str) -> None:
    code = (
        "import torch, cachelife\n"
        "from transformers.cache_utils import StaticLayer\n"
        "from cachelife.core.layer_lifecycle import LayerLifecycle\n"
        "from cachelife.core.buffers import PinSpec\n"
        "layer = StaticLayer(max_cache_len=2)\n"
        "spec = PinSpec(batch_size=1, num_kv_heads=1, key_head_dim=2, value_head_dim=2, dtype=torch.float32,\n"
        "               device=torch.device('cpu'))\n"
        "LayerLifecycle.adopt(layer, index=0, role='self').pin(spec)\n"
    )
    env = {**os.environ, "CACHELIFE_LOG": value}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    if expect:
        assert expect in done.stderr
    else:
        assert "cachelife" not in done.stderr


def test_unknown_level_warns_and_stays_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHELIFE_LOG", "chatty")
    with pytest.warns(UserWarning, match="CACHELIFE_LOG='chatty' is not a logging level"):
        configure_from_environment()
    assert logging.getLogger("cachelife").handlers == []
