"""Where a newcomer's prompt goes in the engine's cache: arithmetic on slots, no tensors.

Every row of the batch writes its next key and value at the same cache slot (transformers' static layers
count one position for the whole batch), so rows are aligned at their ends: a row that joins when the write
slot is `g` puts its prompt of `L` tokens at slots `g - L .. g - 1` and masks everything before. A row that
still has `r` tokens to feed writes up to slot `g + r - 1`, and past that the batch keeps `reserve` slots
free: a call of the step writes `steps_per_call` slots however many of them a row uses, and `READ_LAG` more
calls run before the host reads that the row ended (`snapshots`), so the batch's reserve is `1 + READ_LAG`
calls' slots.
When the newcomer does not fit where the rows are, all rows are moved together (the cache rolled along its
positions by `shift`), which keeps every row's content and distances.
"""

from __future__ import annotations

from collections.abc import Sequence

from attrs import frozen


@frozen
class Occupant:
    """A row in use: its first prompt token's slot, and the slot after its last possible write."""

    start: int
    end: int


@frozen
class Placement:
    """The write slot after the move, and how far the rows' content rolls (0: nothing to roll)."""

    slot: int
    shift: int


def fits_at_all(*, width: int, reserve: int, prompt: int, remaining: int) -> bool:
    """Whether a request fits in an empty batch: its prompt and every token it may feed, plus the reserve."""
    return prompt + remaining + reserve <= width


def place(
    *, slot: int, width: int, reserve: int, occupants: Sequence[Occupant], prompt: int, remaining: int
) -> Placement | None:
    """A write slot for a newcomer with `prompt` tokens and `remaining` tokens to feed, given the current write
    slot and the rows in use, or None while it does not fit (a row must leave first)."""
    if not fits_at_all(width=width, reserve=reserve, prompt=prompt, remaining=remaining):
        return None
    if not occupants:  # nothing to keep: the write slot moves, no content does
        return Placement(prompt, 0)
    low = max(prompt, slot - min(occupant.start for occupant in occupants))
    high = min(width - reserve - remaining, slot + width - reserve - max(o.end for o in occupants))
    if low > high:
        return None
    chosen = slot if low <= slot <= high else low
    return Placement(chosen, chosen - slot)
