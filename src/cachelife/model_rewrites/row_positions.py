"""Row positions for decoders that count positions from the cache: BART's family (BART, mBART, PLBart, Marian,
Pegasus, Blenderbot) takes no `decoder_position_ids` and embeds the positions `cache.get_seq_length()` onwards,
one count for the whole batch. The engine's rows joined at different steps, so each row's next token has a
position of its own. `use_row_positions(model, rows)` puts a `RowPositionTable` in place of the decoder's
`embed_positions`: a (rows, 1) static buffer the engine's step writes each row's position into, read only
while `reading_rows()` holds (the engine's steps, on its scheduler thread); every other call goes to the
model's own table, and `restore()` puts that back.

A table qualifies when it is a lookup table (`nn.Embedding`, learned or sinusoidal) whose forward, given
position ids, embeds `position + offset` (BART's learned tables keep an offset of 2): checked on the model's own
table, with its own forward, before anything changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from attrs import frozen
from torch import nn
from transformers import PreTrainedModel


class RowPositionTable(nn.Module):
    """The decoder's position table, read at each row's own position (`positions`) while `reading_rows()`
    holds, and called as the model's own table otherwise."""

    def __init__(self, table: nn.Embedding, rows: int) -> None:
        super().__init__()
        self.table = table
        self.offset = int(getattr(table, "offset", 0))
        self.register_buffer("positions", torch.zeros(rows, 1, dtype=torch.long, device=table.weight.device))
        torch._dynamo.mark_static_address(self.positions)
        self.reading = False

    positions: torch.Tensor

    @contextlib.contextmanager
    def reading_rows(self) -> Iterator[None]:
        """Within: the table embeds `positions` (rows, 1), whatever the decoder asks for."""
        self.reading = True
        try:
            yield
        finally:
            self.reading = False

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.reading:
            return nn.functional.embedding(self.positions + self.offset, self.table.weight)
        result: torch.Tensor = self.table(*args, **kwargs)
        return result


@frozen
class RowPositions:
    """A decoder's `RowPositionTable`, in place until `restore()`."""

    decoder: nn.Module
    table: RowPositionTable

    @property
    def positions(self) -> torch.Tensor:
        return self.table.positions

    def reading_rows(self) -> contextlib.AbstractContextManager[None]:
        return self.table.reading_rows()

    def restore(self) -> None:
        self.decoder.embed_positions = self.table.table


def position_table(model: PreTrainedModel) -> tuple[nn.Module, nn.Embedding] | None:
    """The decoder and its position table if the table qualifies (see the module docstring), else None."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    table = getattr(decoder, "embed_positions", None)
    if not isinstance(decoder, nn.Module) or not isinstance(table, nn.Embedding) or table.weight.dim() != 2:
        return None
    offset = getattr(table, "offset", 0)
    if not isinstance(offset, int):
        return None
    probe = torch.arange(3, device=table.weight.device)
    try:
        with torch.no_grad():
            embedded = table(None, 0, position_ids=probe)
    except (TypeError, ValueError, RuntimeError, IndexError, AttributeError):
        return None
    expected = table.weight[probe + offset]
    if embedded.numel() != expected.numel() or not torch.equal(embedded.reshape(expected.shape), expected):
        return None
    return decoder, table


def use_row_positions(model: PreTrainedModel, rows: int) -> RowPositions | None:
    """Put a `RowPositionTable` of `rows` rows in place of the decoder's qualifying table (None if it has none)."""
    found = position_table(model)
    if found is None:
        return None
    decoder, table = found
    replacement = RowPositionTable(table, rows)
    decoder.embed_positions = replacement
    return RowPositions(decoder, replacement)
