"""A newcomer's rows start in one call: its prompt, lengths and limits, its per-row settings and its first token.

What a join writes into the rows is staged in buffers of their own first (`StagedStart`): one copy from the
host of the rows it takes and its prompt, two of its per-row settings' values (and one write of its token
masks), one of its prefill's last logits and, for a request with a generator, its first draw. Then one call,
`start_rows`, writes the newcomer's rows from them (`Rows.start`, `RowSettings.write_staged`) and picks each
row's first token as the step picks the next ones (`rows.choose`, only those rows taking part). The call
touches every row with the same kernels whatever the newcomer, so under cachelife's CUDA graphs it is captured
once per program and replayed at every join: a join launches a handful of copies and one graph, where
row-by-row writes launched a few hundred kernels from the scheduler's thread while the device waited for the
next step. Elsewhere it runs as it is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Final

import torch
from attrs import frozen
from transformers import PreTrainedModel

from cachelife.generation.draws import DrawStates
from cachelife.generation.graphs import GraphedSteps
from cachelife.generation.loop_settings import LoopSettings
from cachelife.generation.steps import uses_own_graphs
from cachelife.serving.host_values import copy_values
from cachelife.serving.row_settings import PerRow, StagedSettings
from cachelife.serving.rows import Program, Rows, choose

# Starts kept ready, each for one program (or for a beam search's rows, which pick no first token here).
_KEPT: Final = 16


@frozen(kw_only=True)
class StagedStart:
    """A newcomer's values on the device, read by `start_rows`."""

    head: torch.Tensor  # (6 + width,) long: first row, rows, prompt length, max length, padding, first slot; prompt
    logits: torch.Tensor  # (vocab,) float32: the prefill's last
    noise: torch.Tensor  # (rows, vocab) float32: the last draw of a generator in each row (only sampling rows read it)
    settings: StagedSettings

    @classmethod
    def allocate(cls, rows: int, width: int, vocab: int, device: torch.device) -> StagedStart:
        return cls(
            head=torch.zeros(6 + width, dtype=torch.long, device=device),
            logits=torch.zeros(vocab, dtype=torch.float32, device=device),
            noise=torch.ones(rows, vocab, dtype=torch.float32, device=device),
            settings=StagedSettings.allocate(vocab, device),
        )


def start_rows(rows: Rows, staged: StagedStart, program: Program | None) -> None:
    """The staged newcomer's rows start (see the module docstring); with `program` None (a beam search) only
    their tokens, lengths and masks are written."""
    first, count = staged.head[0], staged.head[1]
    indices = torch.arange(rows.length.shape[0], device=rows.length.device)
    among = (indices >= first) & (indices < first + count)
    rows.start(among, staged.head[6:], staged.head[2:6])
    if program is None:
        return
    if program.settings is not None:
        program.settings.write_staged(among, staged.settings)
    logits = staged.logits.expand(rows.length.shape[0], -1).contiguous()
    choose(rows, logits, staged.noise, program, among)


class RowStarts:
    """The batch's starts of newcomers' rows (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, rows: Rows, vocab: int, settings: LoopSettings) -> None:
        self.model, self.rows = model, rows
        count, width = rows.tokens.shape
        self.staged = StagedStart.allocate(int(count), int(width), vocab, model.device)
        self._graphed = uses_own_graphs(settings, model.device)
        self._starts: OrderedDict[tuple[object, ...] | None, tuple[Program | None, Callable[[], int]]] = OrderedDict()

    def start(
        self, first: int, *, prompt: torch.Tensor, count: int, max_length: int, first_slot: int, padding: int,
        logits: torch.Tensor, program: Program | None, per_row: PerRow | None = None,
        generator: torch.Generator | None = None, draws: DrawStates | None = None,
    ) -> None:  # fmt: skip
        """Rows `first` to `first + count` start the request of `prompt` (1, n), whose first `padding` tokens are
        left padding, from cache slot `first_slot`, and pick their first tokens from `logits` (vocab,) with
        `program` and the request's `per_row` values (where the program is the per-row pipeline) and its
        `generator`'s first draw (recorded in `draws`); with `program` None, they pick none."""
        staged = self.staged
        width = int(staged.head.shape[0]) - 6
        length = int(prompt.shape[1])
        copy_values(staged.head, [first, count, length, max_length, padding, first_slot, *[0] * width])
        staged.head[6 : 6 + length].copy_(prompt[0])  # on the device already: no read on the host
        if program is not None:
            staged.logits.copy_(logits)
            if per_row is not None:
                staged.settings.stage(per_row)
            if generator is not None and draws is not None:
                draws.draw(staged.noise[first : first + count], generator)
        self._start(program)()

    def _start(self, program: Program | None) -> Callable[[], int]:
        """The start for `program`'s rows: kept by the program's key, and made anew for a program built again."""
        key = None if program is None else program.key
        found = self._starts.get(key)
        if found is not None and found[0] is program:
            self._starts.move_to_end(key)
            return found[1]

        def eager() -> int:
            start_rows(self.rows, self.staged, program)
            return 1

        made = eager
        if self._graphed:
            made = GraphedSteps(
                model=self.model,
                name="engine row starts",
                call=lambda index, settings: start_rows(
                    self.rows, self.staged, settings if isinstance(settings, Program) else None
                ),
                calls=1,
                in_place=(self.rows, self.staged),
                settings=program,
                device=self.model.device,
                live_settings=True,  # joins write the program's per-row tensors
            ).advance
        self._starts[key] = (program, made)
        self._starts.move_to_end(key)
        while len(self._starts) > _KEPT:
            self._starts.popitem(last=False)
        return made
