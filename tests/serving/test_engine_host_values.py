"""A newcomer's placement builds its tensors of Python values through `serving.host_values.device_tensor`, whose
copy on a GPU waits for nothing queued before it: a `torch.tensor(...)` of its own would be copied from pageable
memory, which synchronises the device's stream with the host (`test_engine_gpu` checks that on a GPU)."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cachelife.generation import graphs
from cachelife.serving.engine import Engine
from cachelife.tools import zoo
from support import stand_in_graphs


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


# Operations that launch no kernel on a GPU: they make views or host tensors.
_NO_LAUNCH = {"alias", "as_strided", "detach", "expand", "lift_fresh", "select", "slice", "squeeze", "unbind",
              "unsqueeze", "view"}  # fmt: skip


class _Launches(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves the mode untyped
    """Counts the operations dispatched, views and host tensors aside, while `counting`."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counting = True
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.counting and func.overloadpacket.__name__ not in _NO_LAUNCH:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["llama", "whisper"])
def test_a_join_launches_a_handful_of_operations_besides_its_graphs(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under (stand-in) graphs, a newcomer's placement writes its rows, settings and first token from one graph
    (`serving.row_starts`): outside the graphs' replays it dispatches a handful of operations (its staged values'
    copies), not one per row field and processor stage (about two hundred before, each a kernel launch on a
    GPU while the next step waits). Greedy requests and sampling ones, one sequence or two."""
    built = zoo.build(name)
    stand_in_graphs(monkeypatch)
    launches = _Launches()
    capture = graphs.capture

    def uncounted_replays(*args: Any) -> Any:
        replayed = capture(*args)
        replay = replayed.replay

        def quiet() -> None:
            launches.counting = False
            try:
                replay()
            finally:
                launches.counting = True

        replayed.replay = quiet  # type: ignore[method-assign]  # a stand-in graph's, wrapped
        return replayed

    monkeypatch.setattr(graphs, "capture", uncounted_replays)
    sampled = {"do_sample": True, "temperature": 0.7, "top_p": 0.9}
    requests = [{**built.inputs(1, 3 + index, index), "max_new_tokens": 2, **(sampled if index % 2 else {})}
                for index in range(6)]  # fmt: skip
    for request in requests[4:]:  # two sampled sequences (Whisper's generate takes one: these sample one)
        request.update(sampled, num_return_sequences=2 if name == "llama" else 1)
    counts: list[int] = []
    with Engine(built.model, rows=2, max_length=40) as engine:
        place = engine._batch._place

        def counted_place(*args: Any, **kwargs: Any) -> int:
            launches.count = 0
            with launches:
                placed = place(*args, **kwargs)
            counts.append(launches.count)
            return placed

        engine._batch._place = counted_place  # type: ignore[method-assign]
        for request in requests:  # one at a time: each its own join
            engine.submit(**request).result(timeout=120)
    # The first greedy join, sampling join and join of two rows capture their graphs; the later ones replay them.
    assert len(counts) == len(requests)
    assert max(counts[2:4] + counts[5:]) <= 12, counts
