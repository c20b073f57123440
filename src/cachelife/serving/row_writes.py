"""Putting a newcomer's prefill into its row of the engine's cache, in kernels that serve every row and start.

One row of a scratch cache (`source`: a one-row prefill's, or one prompt of a joint prefill's) goes into the
row: its self-attention keys and values shifted by the row's first slot, `start`, scratch slot `s` to row slot
`(start + s) % width`, the whole width at once. The prompt lands at
`start .. start + prompt`; what else the scratch holds lands before `start`, which the row masks, or from the
batch's write slot on, which no query reads before a step overwrites it. Cross-attention keys and values go
into the row whole, and every self-attention layer's position counter is set to the batch's write slot. The
row, start, slot and source are one device tensor, so the same kernels serve every newcomer: under cachelife's CUDA
graphs they are captured once and replayed per newcomer. `roll_rows` moves every row's content along the cache
when a newcomer needs room on the left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from cachelife.core.cache_lifecycle import lifecycle
from cachelife.core.layer_lifecycle import LayerLifecycle
from cachelife.errors import UnsupportedGenerationError
from cachelife.generation.graphs import GraphedSteps
from cachelife.generation.loop_settings import LoopSettings
from cachelife.generation.steps import uses_own_graphs
from cachelife.serving.host_values import copy_values

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (the batch's tensor, the scratch cache's)


def write_row(
    *,
    where: torch.Tensor,
    self_attention: Pairs,
    cross_attention: Pairs,
    positions: Sequence[torch.Tensor],
    grids: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """`where` is (row, start, slot, source); `grids[(heads, width)]` holds, for every head `h` and scratch slot
    `s` in order, `h * width` and `s`."""
    row, start, slot, source = where[0], where[1], where[2], where[3:]
    indices: dict[tuple[int, int], torch.Tensor] = {}
    for into, out_of in self_attention:
        rows, heads, width, size = into.shape
        key = (heads, width)
        if key not in indices:
            head_offsets, slots = grids[key]
            indices[key] = row * (heads * width) + head_offsets + torch.remainder(slots + start, width)
        written = out_of.index_select(0, source).reshape(heads * width, size)
        into.view(rows * heads * width, size).index_copy_(0, indices[key], written)
    for into, out_of in cross_attention:
        into.index_copy_(0, where[:1], out_of.index_select(0, source))
    for length in positions:
        length.copy_(slot)


class RowWrites:
    """The engine's row writes (see the module docstring), replayed from a graph on CUDA with cachelife's
    graphs, run as they are elsewhere."""

    def __init__(self, model: PreTrainedModel, cache: object, scratch: object, settings: LoopSettings) -> None:
        mine, theirs = lifecycle(cache), lifecycle(scratch)
        self_attention = _pairs(mine.self_attention, theirs.self_attention)
        cross_attention = _pairs(mine.cross_attention, theirs.cross_attention)
        device = model.device
        self.where = torch.zeros(4, dtype=torch.long, device=device)
        grids: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for into, _ in self_attention:
            heads, width = int(into.shape[1]), int(into.shape[2])
            if (heads, width) not in grids:
                flat = torch.arange(heads * width, device=device)
                grids[heads, width] = (flat - flat % width, flat % width)
        self.arguments: dict[str, Any] = {
            "where": self.where, "self_attention": self_attention, "cross_attention": cross_attention,
            "positions": [layer.layer.cumulative_length for layer in mine.self_attention], "grids": grids,
        }  # fmt: skip
        self._run: Callable[[], int] = self._eager
        if uses_own_graphs(settings, device):
            graphed = GraphedSteps(
                model=model,
                name="engine row writes",
                call=lambda index, settings: write_row(**self.arguments),
                calls=1,
                in_place=(cache, scratch, self.arguments),
                settings=(),
                device=device,
            )
            self._run = graphed.advance

    def write(self, row: int, start: int, slot: int, source: int = 0) -> None:
        """Row `source` of the scratch cache into `row`, its first slot at `start`; the batch writes at `slot`."""
        copy_values(self.where, (row, start, slot, source))
        self._run()

    def _eager(self) -> int:
        write_row(**self.arguments)
        return 1


def roll_rows(cache: object, shift: int) -> None:
    """Move every row's self-attention keys and values `shift` slots along the cache, wrapping at its width."""
    for layer in lifecycle(cache).self_attention:
        for tensor in layer_tensors(layer):
            tensor.copy_(torch.roll(tensor, shift, dims=2))


def _pairs(mine: Sequence[LayerLifecycle], theirs: Sequence[LayerLifecycle]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        pair
        for target, source in zip(mine, theirs, strict=True)
        for pair in zip(layer_tensors(target), layer_tensors(source), strict=True)
    ]


def layer_tensors(layer: LayerLifecycle) -> tuple[torch.Tensor, torch.Tensor]:
    """A pinned layer's keys and values (pinned layers hold both)."""
    keys, values = layer.layer.keys, layer.layer.values
    if keys is None or values is None:
        msg = f"{layer.describe()} holds no keys or values"
        raise UnsupportedGenerationError(msg)
    return keys, values
