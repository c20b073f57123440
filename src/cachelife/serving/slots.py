"""The lifecycle of one row (slot) of an engine's batch: its states, its transitions, and nothing else.

A slot is `Free` (no request; its cache row holds nothing anyone reads), `Prefilling` (a request's prompt is
being written into its cache row), `Decoding` (every replay of the step appends to it), `Finished` (its request
ended: end token, length, cancellation or timeout; its tokens are being handed over) and `Free` again. The
legal moves are the table `TRANSITIONS`; any other raises `IllegalSlotTransitionError` and changes nothing.
A prefill that fails goes straight back to `Free` (the request fails alone).
"""

from __future__ import annotations

from typing import Final, Literal, TypeAlias

from attrs import frozen
from typing_extensions import TypeIs

from cachelife.errors import IllegalSlotTransitionError


@frozen
class Free:
    """No request: the row's tokens are ignored, its mask attends everywhere (no empty softmax)."""


@frozen
class Prefilling:
    """A request's prompt is being run and written into the row (at a step boundary)."""

    request: int


@frozen
class Decoding:
    """The row takes part in every step: `start` is the cache slot of its first prompt token."""

    request: int
    start: int


@frozen
class Finished:
    """The request ended; its tokens are read before the row is freed."""

    request: int


SlotState: TypeAlias = Free | Prefilling | Decoding | Finished
SlotEvent: TypeAlias = Literal["admit", "start", "fail", "finish", "free"]

TRANSITIONS: Final[dict[tuple[type[SlotState], SlotEvent], type[SlotState]]] = {
    (Free, "admit"): Prefilling,
    (Prefilling, "start"): Decoding,
    (Prefilling, "fail"): Free,
    (Decoding, "finish"): Finished,
    (Finished, "free"): Free,
}


def is_decoding(state: SlotState) -> TypeIs[Decoding]:
    return isinstance(state, Decoding)


class Slot:
    """One row of the batch; its state changes only through `move`."""

    def __init__(self, row: int) -> None:
        self.row = row
        self._state: SlotState = Free()

    @property
    def state(self) -> SlotState:
        return self._state

    def __repr__(self) -> str:
        return f"Slot({self.row}, {self._state!r})"

    def move(self, event: SlotEvent, new: SlotState) -> None:
        """Take `event` to `new`, which must be the state the table names for it."""
        allowed = TRANSITIONS.get((type(self._state), event))
        if allowed is None or type(new) is not allowed:
            legal = sorted(e for (kind, e) in TRANSITIONS if kind is type(self._state))
            msg = (
                f"row {self.row} is {self._state!r}: {event!r} to {type(new).__name__} is not a legal move "
                f"(from {type(self._state).__name__}: {', '.join(legal) or 'none'})"
            )
            raise IllegalSlotTransitionError(msg)
        self._state = new
