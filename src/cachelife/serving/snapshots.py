"""The rows' state as the host reads it `READ_LAG` calls late, so that the device never waits for the host.

After each call of the step the batch copies the rows' lengths, end flags and (while a row streams or has stops
that only the host reads) tokens into host buffers, without waiting (`non_blocking` into pinned memory on
CUDA), and marks the copy with an event. It reads that copy `READ_LAG` step boundaries later, after it has
launched the calls since: the host hands tokens over and ends rows while the device runs the calls after, and
with two calls queued a host that is late by up to a call's time (the scheduler thread waiting for Python's
lock while a request's thread prepares its request) leaves the device no gap. `READ_LAG + 1` sets of buffers
take turns, so that a copy is never overwritten before it is read. A row the copy shows ended has run
`READ_LAG` more calls, which change nothing (the step leaves rows that do not run as they are).
"""

from __future__ import annotations

from typing import Final

import torch
from attrs import define, frozen

from cachelife.serving.rows import Rows

READ_LAG: Final = 2
"""Step calls between a call and the host's read of the rows' state after it."""


@frozen(kw_only=True)
class Snapshot:
    """The rows' state after the step call numbered `taken` (`Batch.calls`)."""

    taken: int
    length: torch.Tensor
    unfinished: torch.Tensor
    tokens: torch.Tensor | None  # None when no row needed its tokens
    copied: torch.cuda.Event | None

    def wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()


@define
class Snapshots:
    """`READ_LAG + 1` sets of host buffers for the rows' state, taken in turn."""

    buffers: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]
    cuda: bool
    turn: int = 0

    @classmethod
    def allocate(cls, rows: Rows) -> Snapshots:
        cuda = rows.length.device.type == "cuda"

        def host(like: torch.Tensor) -> torch.Tensor:
            return torch.empty(like.shape, dtype=like.dtype, pin_memory=cuda)

        sets = READ_LAG + 1
        return cls(tuple((host(rows.length), host(rows.unfinished), host(rows.tokens)) for _ in range(sets)), cuda)

    def take(self, rows: Rows, *, taken: int, tokens: bool) -> Snapshot:
        """Start copying the rows' state (after the step call `taken`); `tokens`: their tokens too."""
        length, unfinished, token_buffer = self.buffers[self.turn]
        self.turn = (self.turn + 1) % len(self.buffers)
        length.copy_(rows.length, non_blocking=self.cuda)
        unfinished.copy_(rows.unfinished, non_blocking=self.cuda)
        if tokens:
            token_buffer.copy_(rows.tokens, non_blocking=self.cuda)
        copied = None
        if self.cuda:
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            copied.record()
        return Snapshot(
            taken=taken, length=length, unfinished=unfinished, tokens=token_buffer if tokens else None, copied=copied
        )
