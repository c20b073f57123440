"""What greedy search and sampling do on the host at each check: stream tokens and apply host-side stops.

The compiled step never leaves the device; the host looks at the state every `stop_check_every` steps (and once
at the end). `HostChecks.check` then reads the tokens produced since the last look and goes through them
position by position as transformers' `_sample` goes through its steps: the stopping criteria that only the
host can evaluate (`stop_strings`, `max_time`, custom `stopping_criteria`) see the sequences up to that
position, a row they stop gets the pad token from the next position on (when an end token is set, as
`_sample` pads), and the streamer gets each position's tokens in order; positions past the step where every
row had ended are discarded, never streamed. So a streamer receives what `model.generate` gives it, a check
later; `stop_check_every=1` streams every token as soon as it is chosen (one host sync per token).
`MaxTimeCriteria` is read at the checks, so it stops at the first position of the check at which the time was up.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from cachelife.generation.greedy import Choice, GreedyState

ON_DEVICE = (MaxLengthCriteria, EosTokenCriteria)


def host_criteria(criteria: Sequence[StoppingCriteria]) -> tuple[StoppingCriteria, ...]:
    """The criteria the compiled step does not evaluate itself (all but the length and end-token ones)."""
    return tuple(criterion for criterion in criteria if not isinstance(criterion, ON_DEVICE))


class HostChecks:
    """Streaming and host-side stops for one greedy or sampling call (see the module docstring)."""

    def __init__(
        self,
        state: GreedyState,
        choice: Choice,
        criteria: Sequence[StoppingCriteria],
        streamer: BaseStreamer | None,
        prompt_length: int,
    ) -> None:
        self.state = state
        self.choice = choice
        self.criteria = tuple(criteria)
        self.streamer = streamer
        self.seen = prompt_length  # positions up to this one were streamed and checked
        self.open = torch.ones_like(state.unfinished)  # the rows still open at position `seen`

    @property
    def needed(self) -> bool:
        return bool(self.criteria) or self.streamer is not None

    def check(self) -> bool:
        """Go through the positions produced since the last check; whether decoding goes on."""
        if self.needed:
            self._catch_up()
        return bool(self.state.running(self.choice))

    def finish(self) -> None:
        """The last look, after the last step: the remaining positions, then the streamer's `end()`."""
        if self.needed:
            self._catch_up()
        if self.streamer is not None:
            self.streamer.end()

    def _catch_up(self) -> None:
        state, choice = self.state, self.choice
        length = int(state.length)
        for position in range(self.seen + 1, length + 1):
            token = state.tokens[:, position - 1]
            if choice.eos is not None:  # as the compiled step closes rows, position by position
                self.open &= ~torch.isin(token, choice.eos)
            if self.criteria:
                stopped = self._stopped(state.tokens[:, :position].clone()) & self.open  # the buffer is reused
                if bool(stopped.any()) and choice.eos is not None:
                    # `_sample` pads a row from the step after the one that stopped it.
                    state.tokens[:, position:].masked_fill_(stopped[:, None], choice.pad)
                self.open &= ~stopped
            if self.streamer is not None:
                self.streamer.put(token.to("cpu", copy=True))  # a copy: the buffer is reused
            if not bool(self.open.any()):
                state.length.fill_(position)  # later positions were decoded after the end: discarded
                length = position
                break
        self.seen = length
        state.unfinished.copy_(self.open)

    def _stopped(self, sequences: torch.Tensor) -> torch.Tensor:
        stopped = torch.zeros(sequences.shape[0], dtype=torch.bool, device=sequences.device)
        for criterion in self.criteria:
            stopped |= criterion(sequences, None).to(stopped.device)
        return stopped
