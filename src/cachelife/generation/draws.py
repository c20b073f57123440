"""Where a sampling request leaves its generator: one draw per token step.

A sampled token is chosen with one draw of exponential noise from the request's `torch.Generator`, but the
loops draw ahead of the steps that use the draws (a call's steps at once, and calls that run while the host
has not yet seen that the request ended). How many draws ran ahead differs between `cachelife.generate` and the
engine's rows, and so would the generator's state after a request: the next pass of the same request
(Whisper's next segment or its temperature fallback) or the caller's next request on that generator would draw
other noise. So both record the generator's state before each draw and, once the request has its tokens, put
the generator back to the state after the draws its token steps used: one per new token (for several
sequences, per step of the longest).
"""

from __future__ import annotations

import torch
from attrs import define, field


@define
class DrawStates:
    """A generator's state before each draw of one request, in the order the steps use the draws."""

    _before: list[torch.Tensor] = field(factory=list, alias="before")

    def draw(self, buffer: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `buffer` (the rows' noise for one step) with the generator's next draw, its state recorded."""
        self._before.append(generator.get_state())
        buffer.exponential_(generator=generator)

    def rewind(self, generator: torch.Generator, steps: int) -> None:
        """Put `generator` back to its state after the first `steps` draws (as it is, if it drew no more)."""
        if 0 <= steps < len(self._before):
            generator.set_state(self._before[steps])
        self._before.clear()
