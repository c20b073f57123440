"""Greedy search and sampling as one in-place update of static buffers (the body of the compiled step).

The state is a fixed-size token buffer `(rows, width)` and a 0-dim length tensor, never a growing
`input_ids` or a Python int, so one compiled graph serves every position. Once every row has ended, or the
length reached `max_length`, the update changes nothing: steps run after the end (the host checks only every
few steps) are no-ops, and the buffer holds exactly what transformers' `_sample` returns.
"""

from __future__ import annotations

import torch
from attrs import frozen

from cachelife.generation.processors import TensorProcessor
from cachelife.generation.records import ScoreRecord


@frozen(kw_only=True)
class Choice:
    """How one step picks its token; the same for every step of one call."""

    processors: tuple[TensorProcessor, ...]
    do_sample: bool
    eos: torch.Tensor | None  # (n,) end-of-sequence ids, or None: no end, no padding
    pad: int
    max_length: torch.Tensor  # 0-dim long: not a compile-time constant, so every length shares one graph


@frozen
class GreedyState:
    """Static buffers, mutated in place: tokens so far, their count, which rows are still open."""

    tokens: torch.Tensor  # (rows, width) long
    length: torch.Tensor  # () long
    unfinished: torch.Tensor  # (rows,) bool

    @classmethod
    def allocate(cls, rows: int, width: int, device: torch.device) -> GreedyState:
        state = cls(
            torch.zeros(rows, width, dtype=torch.long, device=device),
            torch.zeros((), dtype=torch.long, device=device),
            torch.zeros(rows, dtype=torch.bool, device=device),
        )
        for tensor in (state.tokens, state.length, state.unfinished):
            torch._dynamo.mark_static_address(tensor)
        return state

    def start(self, prompt: torch.Tensor, pad: int) -> None:
        """Fill with a prompt (rows, prompt length): every row open, the rest of the buffer `pad`."""
        self.tokens.fill_(pad)
        self.tokens[:, : prompt.shape[1]].copy_(prompt)
        self.length.fill_(prompt.shape[1])
        self.unfinished.fill_(True)

    def running(self, choice: Choice) -> torch.Tensor:
        return (self.length < choice.max_length) & self.unfinished.any()

    def last_tokens(self) -> torch.Tensor:
        """The token at `length - 1` of every row, shape (rows, 1): the next step's input."""
        index = (self.length - 1).view(1, 1).expand(self.tokens.shape[0], 1)
        return self.tokens.gather(1, index)


def choose_and_append(
    state: GreedyState, logits: torch.Tensor, noise: torch.Tensor, choice: Choice, record: ScoreRecord | None = None
) -> None:
    """Process `logits` (rows, vocab; float32), pick one token per row (argmax, or an exponential race for
    sampling) and append it, padded for rows that had ended; as `_sample` does, step for step. With a `record`,
    the step's scores and logits are kept too."""
    running = state.running(choice)
    scores = logits
    for processor in choice.processors:
        scores = processor(state.tokens, state.length, scores)
    if record is not None:
        record.keep(state.length, running, scores, logits)
    pick_and_append(
        state.tokens, state.length, state.unfinished, scores, noise=noise, running=running, do_sample=choice.do_sample,
        eos=choice.eos, pad=choice.pad,
    )  # fmt: skip


def pick_and_append(
    tokens: torch.Tensor, length: torch.Tensor, unfinished: torch.Tensor, scores: torch.Tensor, *,
    noise: torch.Tensor, running: torch.Tensor, do_sample: bool, eos: torch.Tensor | None, pad: int,
) -> None:  # fmt: skip
    """Pick a token per row from processed `scores` (argmax, or an exponential race against `noise`), pad it
    for rows that had ended, and write it at `length` where `running`: the rule of `choose_and_append` and of
    the engine's rows, whose `length` and `running` are one per row (0-dim here: the same for every row)."""
    token = (torch.softmax(scores, dim=-1) / noise).argmax(dim=-1) if do_sample else scores.argmax(dim=-1)
    ended = unfinished
    if eos is not None:
        token = torch.where(unfinished, token, pad)
        ended = unfinished & ~torch.isin(token, eos)
    append(tokens, length, unfinished, token, open_after=ended, running=running)


def append(
    tokens: torch.Tensor, length: torch.Tensor, unfinished: torch.Tensor, token: torch.Tensor, *,
    open_after: torch.Tensor, running: torch.Tensor,
) -> None:  # fmt: skip
    """Write each row's picked `token` at its `length` where `running`, and whether the row is still open after
    it (`open_after`), in place."""
    column = torch.arange(tokens.shape[1], device=token.device)[None, :] == length.reshape(-1, 1)
    tokens.copy_(torch.where(column & running.reshape(-1, 1), token[:, None], tokens))
    unfinished.copy_(torch.where(running, open_after, unfinished))
    length.add_(running.long())
