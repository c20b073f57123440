"""A streamer that records what `generate` (or cachelife, or an engine request) hands it: for tests and for
looking at a stream by hand."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.generation.streamers import BaseStreamer


class RecordingStreamer(BaseStreamer):
    """Keeps every tensor `put` is given, as given (each call hands a tensor of its own, which must stay as it
    was), and counts `end` calls; `on_put`, if given, is called with the number of puts so far after each."""

    def __init__(self, on_put: Callable[[int], object] | None = None) -> None:
        self.values: list[torch.Tensor] = []
        self.ends = 0
        self.on_put = on_put

    def put(self, value: torch.Tensor) -> None:
        self.values.append(value)
        if self.on_put is not None:
            self.on_put(len(self.values))

    def end(self) -> None:
        self.ends += 1

    @property
    def puts(self) -> list[list[int]]:
        """Each `put`'s token ids, flattened."""
        return [value.flatten().tolist() for value in self.values]
