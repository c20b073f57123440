"""Who joins the batch at a step boundary: a pure plan over the waiting requests and the batch's rows.

First come, first served by submission time: the waiting requests are taken in the order they were submitted
(their preparation may end in another order), each while it fits, and the first that does not fit stops the
plan, so that no later request overtakes it. A request fits when it finds free neighbouring rows for its beams
(or sampled sequences), runs the batch's program (or the per-row pipeline alongside it), and finds room in the
cache's window (`window.place`). Each admission is planned on the batch as the ones before it leave it.
"""

from __future__ import annotations

from collections.abc import Sequence

from attrs import evolve, frozen

from cachelife.serving.rows import shares_batch
from cachelife.serving.window import Occupant, Placement, place


@frozen(kw_only=True)
class Candidate:
    """A waiting request as admission sees it."""

    number: int  # its submission order
    rows: int  # the rows it takes (its beams, or its sampled sequences)
    key: tuple[object, ...]  # its program's
    prompt: int
    remaining: int  # tokens still to feed after its prompt's first pick


@frozen(kw_only=True)
class BatchView:
    """The batch as admission sees it."""

    free: tuple[bool, ...]  # per row
    program: tuple[object, ...] | None  # the running program's key while any row decodes
    occupants: tuple[Occupant, ...]
    slot: int  # the rows' shared write slot
    width: int
    reserve: int  # slots kept free past a row's last feed (`window`)


@frozen(kw_only=True)
class Admission:
    number: int
    first: int  # the first of its rows
    placement: Placement


def plan(waiting: Sequence[Candidate], batch: BatchView) -> list[Admission]:
    """The admissions at this boundary, in submission order (see the module docstring)."""
    admissions: list[Admission] = []
    for candidate in sorted(waiting, key=lambda candidate: candidate.number):
        admission = _admit(candidate, batch)
        if admission is None:
            break
        admissions.append(admission)
        batch = _after(batch, candidate, admission)
    return admissions


def _admit(candidate: Candidate, batch: BatchView) -> Admission | None:
    first = free_rows(batch.free, candidate.rows)
    if first is None:
        return None
    if batch.occupants and batch.program is not None and not shares_batch(candidate.key, batch.program):
        return None
    placement = place(
        slot=batch.slot, width=batch.width, reserve=batch.reserve, occupants=batch.occupants,
        prompt=candidate.prompt, remaining=candidate.remaining,
    )  # fmt: skip
    return None if placement is None else Admission(number=candidate.number, first=first, placement=placement)


def _after(batch: BatchView, candidate: Candidate, admission: Admission) -> BatchView:
    """The batch once `admission` joined: its rows taken, every occupant moved by the placement's shift."""
    shift, slot = admission.placement.shift, admission.placement.slot
    taken = range(admission.first, admission.first + candidate.rows)
    newcomer = Occupant(slot - candidate.prompt, slot + candidate.remaining)
    return evolve(
        batch,
        free=tuple(free and row not in taken for row, free in enumerate(batch.free)),
        program=candidate.key,
        occupants=(*(Occupant(o.start + shift, o.end + shift) for o in batch.occupants), newcomer),
        slot=slot,
    )


def free_rows(free: Sequence[bool], size: int) -> int | None:
    """The first row of `size` free neighbouring rows at a multiple of `size`, or None."""
    for first in range(0, len(free) - size + 1, size):
        if all(free[first : first + size]):
            return first
    return None
