"""dynamo's guard-skipping stance is the whole process's: compiled steps in other threads wait for it."""

from __future__ import annotations

import threading
from typing import Any

import torch

from cachelife.integration.compiled import call_step


def test_a_compiled_call_in_another_thread_waits_while_a_step_skips_guards() -> None:
    doubled = torch.compile(lambda x: x * 2 + 1, fullgraph=True)
    doubled(torch.ones(2))
    entered, release = threading.Event(), threading.Event()

    def held_open() -> None:  # a step call that skips guards, still running
        entered.set()
        release.wait(30)

    holder = threading.Thread(target=call_step, args=(held_open, False))
    holder.start()
    entered.wait(30)
    result: dict[str, Any] = {}

    def other() -> None:  # new inputs: its guards must be evaluated
        try:
            result["value"] = call_step(doubled, True, torch.ones(3, 3))
        except Exception as error:
            result["error"] = error

    caller = threading.Thread(target=other)
    caller.start()
    caller.join(2.0)
    waited = caller.is_alive()
    release.set()
    holder.join(30)
    caller.join(60)
    assert "error" not in result, result.get("error")
    assert waited
    assert torch.equal(result["value"], torch.full((3, 3), 3.0))
