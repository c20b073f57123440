"""What `return_dict_in_generate` asks a search to keep: each step's scores and logits, in static buffers.

Both searches write a step's processed scores (greedy search and sampling: the processed logits; beam search:
the processed log-probabilities of every beam) and raw logits at the column of the length the step started
from, inside the compiled step, so that nothing is copied to the host per step; the host cuts the kept columns
into the per-step tuples `generate` returns once the search has ended.
"""

from __future__ import annotations

import torch
from attrs import frozen


@frozen
class ScoreRecord:
    """Static buffers `(rows, width, vocab)` float32 that keep each step's processed scores and raw logits at
    the column of the token they chose, for `return_dict_in_generate` (None: not asked for)."""

    scores: torch.Tensor | None
    logits: torch.Tensor | None

    @classmethod
    def allocate(
        cls, rows: int, width: int, vocab: int, device: torch.device, *, scores: bool, logits: bool
    ) -> ScoreRecord:
        def buffer(wanted: bool) -> torch.Tensor | None:
            if not wanted:
                return None
            made = torch.zeros(rows, width, vocab, device=device)
            torch._dynamo.mark_static_address(made)
            return made

        return cls(buffer(scores), buffer(logits))

    def keep(self, length: torch.Tensor, running: torch.Tensor, scores: torch.Tensor, logits: torch.Tensor) -> None:
        """Write this step's scores and logits at column `length` (0-dim long: the length before the step's
        token) of the rows' buffers, where the search is still `running`."""
        for buffer, value in ((self.scores, scores), (self.logits, logits)):
            if buffer is None:
                continue
            column = length.clamp(max=buffer.shape[1] - 1).view(1)
            kept = torch.where(running, value, buffer.index_select(1, column).squeeze(1))
            buffer.index_copy_(1, column, kept.unsqueeze(1))

    def steps(self, buffer: torch.Tensor | None, start: int, end: int) -> tuple[torch.Tensor, ...] | None:
        """The kept rows of columns `start` to `end` (the new tokens), one tensor per step, as `_sample` returns."""
        return None if buffer is None else tuple(buffer[:, column].clone() for column in range(start, end))
