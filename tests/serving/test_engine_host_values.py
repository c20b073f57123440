"""A newcomer's placement builds its tensors of Python values through `serving.host_values.device_tensor`, whose
copy on a GPU waits for nothing queued before it: a `torch.tensor(...)` of its own would be copied from pageable
memory, which synchronises the device's stream with the host (`test_engine_gpu` checks that on a GPU)."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest
import torch

from cachelife.serving.engine import Engine
from cachelife.tools import zoo


@pytest.mark.parametrize("name", ["llama", "whisper", "t5"])
def test_a_placement_builds_tensors_of_python_values_only_through_device_tensor(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = zoo.build(name)
    requests = [{**built.inputs(1, 3 + index, index), "max_new_tokens": 3} for index in range(3)]
    requests[1].update(do_sample=True, top_k=5, suppress_tokens=[4, 9])  # a row with its own settings
    elsewhere: list[str] = []
    tensor, placing = torch.tensor, [0]  # the ident of the thread placing a newcomer (request threads run too)

    def watched_tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        caller = sys._getframe(1).f_globals["__name__"]
        if placing[0] == threading.get_ident() and caller != "cachelife.serving.host_values":
            elsewhere.append(caller)
        return tensor(*args, **kwargs)

    encoder_length = 16 if name == "t5" else None
    with Engine(built.model, rows=2, max_length=40, compile_step=False, encoder_length=encoder_length) as engine:
        place = engine._batch._place

        def watched_place(*args: Any, **kwargs: Any) -> int:
            placing[0] = threading.get_ident()
            try:
                return place(*args, **kwargs)
            finally:
                placing[0] = 0

        engine._batch._place = watched_place  # type: ignore[method-assign]
        monkeypatch.setattr(torch, "tensor", watched_tensor)
        results = [future.result(timeout=120) for future in [engine.submit(**request) for request in requests]]
        joins = engine.stats().joins
    assert joins == len(requests)
    assert all(isinstance(result, torch.Tensor) for result in results)
    assert elsewhere == []
