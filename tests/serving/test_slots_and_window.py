"""The engine's row lifecycle and its placement arithmetic, as properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachelife.errors import IllegalSlotTransitionError
from cachelife.serving.slots import TRANSITIONS, Decoding, Finished, Free, Prefilling, Slot, SlotEvent, SlotState
from cachelife.serving.window import Occupant, fits_at_all, place

EVENTS: tuple[SlotEvent, ...] = ("admit", "start", "fail", "finish", "free")
STATES: tuple[SlotState, ...] = (Free(), Prefilling(1), Decoding(1, 0), Finished(1))


@given(st.lists(st.tuples(st.sampled_from(EVENTS), st.sampled_from(STATES)), max_size=40))
def test_a_slot_moves_only_as_the_table_says(moves: list[tuple[SlotEvent, SlotState]]) -> None:
    slot = Slot(0)
    for event, new in moves:
        before = slot.state
        legal = TRANSITIONS.get((type(before), event)) is type(new)
        if legal:
            slot.move(event, new)
            assert slot.state == new
        else:
            with pytest.raises(IllegalSlotTransitionError, match="not a legal move"):
                slot.move(event, new)
            assert slot.state == before


def test_a_row_goes_round_its_cycle() -> None:
    slot = Slot(3)
    for event, new in (("admit", Prefilling(7)), ("start", Decoding(7, 2)), ("finish", Finished(7)), ("free", Free())):
        slot.move(event, new)  # type: ignore[arg-type]
    slot.move("admit", Prefilling(8))
    slot.move("fail", Free())
    assert slot.state == Free()


@st.composite
def batches(draw: st.DrawFn) -> tuple[int, int, int, list[Occupant], int, int]:
    width = draw(st.integers(4, 60))
    spc = draw(st.integers(1, 4))
    slot = draw(st.integers(0, width))
    occupants = []
    for _ in range(draw(st.integers(0, 4))):
        start = draw(st.integers(0, slot))
        end = draw(st.integers(slot, max(slot, width - spc)))
        occupants.append(Occupant(start, end))
    return width, spc, slot, occupants, draw(st.integers(1, width)), draw(st.integers(0, width))


def _valid(
    width: int, spc: int, slot: int, occupants: list[Occupant], *, prompt: int, remaining: int, new: int
) -> bool:
    shift = new - slot
    return (
        new >= prompt
        and new + remaining + spc <= width
        and all(o.start + shift >= 0 and o.end + shift + spc <= width for o in occupants)
    )


@given(batches())
def test_a_placement_keeps_every_row_whole_and_is_found_when_one_exists(
    batch: tuple[int, int, int, list[Occupant], int, int],
) -> None:
    width, spc, slot, occupants, prompt, remaining = batch
    placement = place(slot=slot, width=width, reserve=spc, occupants=occupants, prompt=prompt,
                      remaining=remaining)  # fmt: skip
    if not occupants:
        fits = fits_at_all(width=width, reserve=spc, prompt=prompt, remaining=remaining)
        assert (placement is not None) == fits
        if placement is not None:
            assert (placement.slot, placement.shift) == (prompt, 0)
        return
    needs = {"prompt": prompt, "remaining": remaining}
    possible = [new for new in range(width + 1) if _valid(width, spc, slot, occupants, **needs, new=new)]
    if placement is None:
        assert possible == []
        return
    assert _valid(width, spc, slot, occupants, prompt=prompt, remaining=remaining, new=placement.slot)
    assert placement.shift == placement.slot - slot
    if slot in possible:
        assert placement.shift == 0  # nothing moves when nothing has to
