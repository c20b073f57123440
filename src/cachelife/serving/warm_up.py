"""An engine's warm-up: what the first requests would compile (and on CUDA capture), done before they come.

The engine compiles its programs and prefill forwards when a request first needs them: the step of a request's
kind (greedy, sampling), the prefill at a first and at a second prompt length (dynamo makes the length dynamic
from its second value), and, for a decoder-only model, the prefill newcomers share (`joint_prefill`), at every
group size and prompt bucket (on CUDA a graph each). A request that arrives then waits for the compilation,
seconds to tens of seconds. `warm_up` sends copies of an example request the way traffic reaches each of those:
alone at its own prompt length and at half of it, then, for every group size of the shared prefill from two
rows on, groups of that many copies admitted at one step boundary (the `AdmissionGate` holds admission until all
of them are prepared): at the full length, at the full and the half length (the shorter left-padded: one
bucket), and at the half length (the half length's bucket). Each copy decodes 2 new tokens; their results are
dropped. Prompt buckets the example does not reach are compiled or captured when a request first needs them."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from cachelife.errors import InvalidArgumentError

WARM_UP_TOKENS = 2
"""New tokens each warm-up copy decodes."""


class AdmissionGate:
    """Whether the scheduler admits newcomers; `at_once` closes it until a set of requests all wait."""

    def __init__(self, wake: threading.Condition, waiting: Callable[[], int]) -> None:
        self._wake, self._waiting = wake, waiting
        self.open = True  # read by the scheduler under `wake`'s lock

    def at_once(self, submit_all: Callable[[], list[Future[Any]]]) -> list[Future[Any]]:
        """The requests `submit_all` submits, admitted at one step boundary once every one of them is prepared
        (or one has failed)."""
        with self._wake:
            self.open = False
        try:
            futures = submit_all()
            with self._wake:
                self._wake.wait_for(lambda: self._waiting() >= len(futures) or any(f.done() for f in futures))
        finally:
            with self._wake:
                self.open = True
                self._wake.notify_all()
        return futures


def warm_up(
    submit: Callable[..., Future[Any]], gate: AdmissionGate, *, group_sizes: Sequence[int], example: dict[str, Any]
) -> None:
    """Compile what requests like `example` need before they come (see the module docstring); raises what a
    copy of the example raises."""
    prompt = example.get("input_ids")
    length = int(prompt.shape[1]) if isinstance(prompt, torch.Tensor) and prompt.dim() == 2 else 1
    full = _cut(example, None)
    half = _cut(example, length // 2) if length >= 2 else None
    for copy in (full, half):  # alone: a group of one, where the shared prefill takes the request
        if copy is not None:
            submit(**copy).result()
    for size in (size for size in group_sizes if size > 1):
        groups = [[full] * size]
        if half is not None:  # prompts of other lengths (the shorter left-padded), and the half's bucket
            groups += [[full, *[half] * (size - 1)], [half] * size]
        for group in groups:
            for future in gate.at_once(functools.partial(_submitted, submit, group)):
                future.result()


def _submitted(submit: Callable[..., Future[Any]], requests: Sequence[dict[str, Any]]) -> list[Future[Any]]:
    return [submit(**request) for request in requests]


def _cut(example: dict[str, Any], length: int | None) -> dict[str, Any]:
    """A copy of the example that decodes `WARM_UP_TOKENS` new tokens, its prompt (and mask) cut to its first
    `length` tokens unless None."""
    if "max_length" in example:
        msg = "warm_up takes an example request with max_new_tokens (or none), not max_length"
        raise InvalidArgumentError(msg)
    copy = {**example, "max_new_tokens": WARM_UP_TOKENS, "min_new_tokens": WARM_UP_TOKENS}
    copy.pop("streamer", None)
    if length is not None:
        for name in ("input_ids", "attention_mask"):
            if isinstance(example.get(name), torch.Tensor):
                copy[name] = example[name][:, :length]
    return copy
