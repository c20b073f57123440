"""The engine's admission as a pure plan: waiting requests and the batch's rows in, admissions out, no model."""

from __future__ import annotations

import pytest
from attrs import evolve
from hypothesis import given
from hypothesis import strategies as st

from cachelife.serving.admission import BatchView, Candidate, plan
from cachelife.serving.rows import PER_ROW, shares_batch
from cachelife.serving.window import Occupant, place

SAMPLING, GREEDY, OWN = (PER_ROW, True), (PER_ROW, False), ("own program", 3)
EMPTY = BatchView(free=(True,) * 4, program=None, occupants=(), slot=0, width=64, reserve=1)


def waiting(*numbers: int, rows: int = 1, key: tuple[object, ...] = GREEDY, prompt: int = 5) -> list[Candidate]:
    return [Candidate(number=n, rows=rows, key=key, prompt=prompt, remaining=10) for n in numbers]


def test_requests_join_in_submission_order_whatever_order_they_were_prepared_in() -> None:
    admissions = plan(waiting(7, 3, 5), evolve(EMPTY, free=(True, False, True, False)))
    assert [(a.number, a.first) for a in admissions] == [(3, 0), (5, 2)]


def test_a_request_that_does_not_fit_is_overtaken_by_none() -> None:
    beams = waiting(1, rows=2)  # two neighbouring rows at an even row: rows 1 and 2 are not
    assert plan([*beams, *waiting(2)], evolve(EMPTY, free=(False, True, True, False))) == []
    assert [
        a.number for a in plan([*waiting(0), *waiting(2, rows=2)], evolve(EMPTY, free=(False, True, True, False)))
    ] == [0]


def test_another_program_waits_for_the_rows_to_empty_and_the_per_row_variants_share_a_batch() -> None:
    running = evolve(EMPTY, free=(False, True, True, True), program=GREEDY, occupants=(Occupant(0, 20),), slot=5)
    assert plan([*waiting(1, key=OWN), *waiting(2)], running) == []
    assert [a.number for a in plan([*waiting(1, key=SAMPLING), *waiting(2, key=OWN)], running)] == [1]
    assert [a.number for a in plan(waiting(1, key=OWN), evolve(EMPTY, program=GREEDY))] == [1]


def test_each_admission_is_placed_on_the_batch_the_ones_before_it_leave() -> None:
    # The first newcomer's long prompt moves the write slot; the second is placed after that move, and the
    # first's remaining tokens bound where it may go.
    first = Candidate(number=0, rows=1, key=GREEDY, prompt=30, remaining=12)
    second = Candidate(number=1, rows=1, key=GREEDY, prompt=4, remaining=10)
    batch = evolve(EMPTY, program=GREEDY, free=(False, True, True, True), occupants=(Occupant(2, 40),), slot=8)
    one, two = plan([second, first], batch)
    assert (one.number, one.placement) == (0, place(slot=8, width=64, reserve=1, occupants=[Occupant(2, 40)],
                                                    prompt=30, remaining=12))  # fmt: skip
    shift = one.placement.shift
    occupants = [Occupant(2 + shift, 40 + shift), Occupant(one.placement.slot - 30, one.placement.slot + 12)]
    expected = place(slot=one.placement.slot, width=64, reserve=1, occupants=occupants, prompt=4, remaining=10)
    assert (two.number, two.first, two.placement) == (1, 2, expected)
    assert shift > 0
    # Planned on the batch as it was, the second would not have fitted where it goes.
    assert place(slot=8, width=64, reserve=1, occupants=[Occupant(2, 40)], prompt=4, remaining=10) != expected


def test_a_request_longer_than_the_window_is_not_planned() -> None:
    assert plan([Candidate(number=0, rows=1, key=GREEDY, prompt=60, remaining=10)], EMPTY) == []


@given(
    free=st.lists(st.booleans(), min_size=1, max_size=8),
    candidates=st.lists(
        st.tuples(st.sampled_from([1, 2]), st.sampled_from([GREEDY, SAMPLING, OWN]), st.integers(1, 20)),
        max_size=8,
    ),
    numbers=st.randoms(use_true_random=False),
)
def test_a_plan_takes_a_prefix_of_the_queue_in_order_into_disjoint_free_rows(
    free: list[bool], candidates: list[tuple[int, tuple[object, ...], int]], numbers: object
) -> None:
    order = list(range(len(candidates)))
    numbers.shuffle(order)  # type: ignore[attr-defined]
    queue = [
        Candidate(number=number, rows=rows, key=key, prompt=prompt, remaining=8)
        for number, (rows, key, prompt) in zip(order, candidates, strict=True)
    ]
    admissions = plan(queue, evolve(EMPTY, free=tuple(free)))
    assert [a.number for a in admissions] == list(range(len(admissions)))
    taken = [row for a in admissions for row in range(a.first, a.first + queue[order.index(a.number)].rows)]
    assert len(taken) == len(set(taken))
    assert all(free[row] for row in taken)
    keys = [queue[order.index(a.number)].key for a in admissions]
    assert all(shares_batch(key, other) for key in keys for other in keys)


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_beam_groups_take_aligned_neighbouring_rows(rows: int) -> None:
    (admission,) = plan(waiting(0, rows=rows), evolve(EMPTY, free=(False,) * rows + (True,) * rows))
    assert admission.first == rows
