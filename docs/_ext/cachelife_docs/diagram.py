"""A state diagram drawn as text from a transition table, with no layout program.

States stand in one row of boxes, in the order given. A transition to a state further right is an arc above
the boxes, a transition to a state further left an arc below them, and a transition from a state to itself a
short arc above its own box. Each arc runs on the lowest lane where it overlaps no other, with its event
written into it and an arrowhead at its target; where an arc's vertical line passes another arc's lane, the
crossing is drawn. A state without transitions is a box without arcs:

      ┌─ pin ──┐
      │        ▼
    ┌───┐    ┌───┐
    │ A │    │ B │
    └───┘    └───┘
      ▲        │
      └─ drop ─┘
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from attrs import define, frozen

GAP: Final = 2  # columns between boxes, before widening for labels
SLOT: Final = 2  # columns between two arc ends on one box


@frozen
class Edge:
    source: str
    label: str
    target: str


@define
class _Arc:
    edge: Edge
    above: bool
    x_source: int = 0
    x_target: int = 0
    lane: int = 0

    @property
    def left(self) -> int:
        return min(self.x_source, self.x_target)

    @property
    def right(self) -> int:
        return max(self.x_source, self.x_target)


def draw(states: Sequence[str], edges: Sequence[Edge]) -> str:
    """The diagram of `states` (left to right) and `edges` between them, as lines of text."""
    index = {state: position for position, state in enumerate(states)}
    for edge in edges:
        for end in (edge.source, edge.target):
            if end not in index:
                msg = f"transition {edge!r} names {end!r}, which is not one of the states {list(states)!r}"
                raise ValueError(msg)
    arcs = [_Arc(edge, above=index[edge.target] >= index[edge.source]) for edge in edges]
    ends = _ends_per_box(states, arcs, index)
    widths = [_box_width(state, ends[state]) for state in states]
    gaps = [GAP] * max(len(states) - 1, 0)
    while True:
        lefts = _lefts(widths, gaps)
        _place(states, ends, lefts, widths)
        short = _too_short(arcs, index)
        if short is None:
            break
        gap, missing = short
        gaps[gap] += missing
    _assign_lanes([arc for arc in arcs if arc.above])
    _assign_lanes([arc for arc in arcs if not arc.above])
    width = lefts[-1] + widths[-1] if states else 0
    lines = _half(arcs, width, above=True)
    lines += _boxes(states, lefts, widths, width)
    lines += _half(arcs, width, above=False)
    return "\n".join(line.rstrip() for line in lines)


# Each box has arc ends on its top (arcs above) and on its bottom (arcs below). Along each side, the ends of arcs
# that reach to the left come first, nearest first, then both ends of arcs to the box itself, then the ends
# of arcs that reach to the right, farthest first: so arcs that share a box do not cross.
_End = tuple[_Arc, str]  # the arc and which end ("source" or "target")


def _ends_per_box(states: Sequence[str], arcs: list[_Arc], index: dict[str, int]) -> dict[str, list[list[_End]]]:
    ends: dict[str, list[list[_End]]] = {state: [[], []] for state in states}  # [top, bottom]
    for state in states:
        here = index[state]
        for side, above in ((0, True), (1, False)):
            left: list[tuple[int, _End]] = []
            self_loops: list[_End] = []
            right: list[tuple[int, _End]] = []
            for arc in arcs:
                if arc.above is not above:
                    continue
                if arc.edge.source == state == arc.edge.target:
                    self_loops += [(arc, "source"), (arc, "target")]
                    continue
                for end, other in (("source", arc.edge.target), ("target", arc.edge.source)):
                    if getattr(arc.edge, end) != state:
                        continue
                    distance = index[other] - here
                    (left if distance < 0 else right).append((abs(distance), (arc, end)))
            left.sort(key=lambda item: item[0])
            right.sort(key=lambda item: -item[0])
            ends[state][side] = [end for _, end in left] + self_loops + [end for _, end in right]
    return ends


def _box_width(state: str, sides: list[list[_End]]) -> int:
    return max([len(state) + 4, *(_offsets(side)[-1] + 4 for side in sides if side)])


def _offsets(side: list[_End]) -> list[int]:
    """Each arc end's column on one side of a box, from the first end: `SLOT` apart, and a self-loop's two ends
    far enough apart for its label."""
    offsets: list[int] = []
    for position, (arc, end) in enumerate(side):
        if position == 0:
            offsets.append(0)
            continue
        previous_arc, previous_end = side[position - 1]
        loop = previous_arc is arc and previous_end == "source" and end == "target"
        offsets.append(offsets[-1] + (len(arc.edge.label) + 5 if loop else SLOT))
    return offsets


def _lefts(widths: Sequence[int], gaps: Sequence[int]) -> list[int]:
    lefts, x = [], 0
    for position, width in enumerate(widths):
        lefts.append(x)
        x += width + (gaps[position] if position < len(gaps) else 0)
    return lefts


def _place(
    states: Sequence[str],
    ends: dict[str, list[list[_End]]],
    lefts: Sequence[int],
    widths: Sequence[int],
) -> None:
    """Give every arc end its column: each side's ends centred on their box."""
    for position, state in enumerate(states):
        for side in ends[state]:
            offsets = _offsets(side)
            start = lefts[position] + (widths[position] - (offsets[-1] if offsets else 0)) // 2
            for (arc, end), offset in zip(side, offsets, strict=True):
                setattr(arc, f"x_{end}", start + offset)


def _too_short(arcs: list[_Arc], index: dict[str, int]) -> tuple[int, int] | None:
    """The gap to widen, and by how much, for the first arc whose label does not fit between its ends."""
    for arc in arcs:
        room = arc.right - arc.left - 1
        needed = len(arc.edge.label) + 4
        if room < needed and arc.edge.source != arc.edge.target:
            first = min(index[arc.edge.source], index[arc.edge.target])
            return first, needed - room
    return None


def _assign_lanes(arcs: list[_Arc]) -> None:
    """Shortest arcs nearest the boxes; an arc goes to the lowest lane where it overlaps no arc (with a column
    between them)."""
    lanes: list[list[_Arc]] = []
    for arc in sorted(arcs, key=lambda arc: (arc.right - arc.left, arc.left)):
        for number, lane in enumerate(lanes):
            if all(arc.right < other.left - 1 or arc.left > other.right + 1 for other in lane):
                lane.append(arc)
                arc.lane = number
                break
        else:
            arc.lane = len(lanes)
            lanes.append([arc])


def _half(arcs: list[_Arc], width: int, *, above: bool) -> list[str]:
    """The rows above the boxes (lanes from the outermost in, then the arrow row), or below them (mirrored)."""
    mine = [arc for arc in arcs if arc.above is above]
    if not mine:
        return []
    lanes = max(arc.lane for arc in mine) + 1
    # Row 0 is the arrow row next to the boxes; row k + 1 holds lane k.
    grid = [[" "] * width for _ in range(lanes + 1)]
    for arc in mine:
        row = arc.lane + 1
        line = grid[row]
        for x in range(arc.left + 1, arc.right):
            line[x] = "─"
        label = f" {arc.edge.label} "
        start = arc.left + 1 + (arc.right - arc.left - 1 - len(label)) // 2
        for offset, char in enumerate(label):
            line[start + offset] = char
        line[arc.left] = "┌" if above else "└"
        line[arc.right] = "┐" if above else "┘"
    for arc in mine:
        for end, x in (("source", arc.x_source), ("target", arc.x_target)):
            for row in range(arc.lane + 1):
                grid[row][x] = _cross(grid[row][x])
            grid[0][x] = ("▼" if above else "▲") if end == "target" else "│"
    rows = ["".join(line) for line in grid]
    return rows[::-1] if above else rows


def _cross(char: str) -> str:
    return "┼" if char == "─" else "│"


def _boxes(states: Sequence[str], lefts: Sequence[int], widths: Sequence[int], width: int) -> list[str]:
    top, middle, bottom = ([" "] * width for _ in range(3))
    for state, left, box in zip(states, lefts, widths, strict=True):
        top[left : left + box] = "┌" + "─" * (box - 2) + "┐"
        bottom[left : left + box] = "└" + "─" * (box - 2) + "┘"
        middle[left : left + box] = "│" + state.center(box - 2) + "│"
    return ["".join(top), "".join(middle), "".join(bottom)]
