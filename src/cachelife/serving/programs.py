"""The programs an engine's batch keeps: a bounded cache, the least recently used dropped first.

A program is what one compiled step (and its captured graphs) runs: the per-row pipeline's variants, which
every everyday request shares and which are always kept, and programs of their own (a request whose processors
are not all row values, a beam search), of which at most `KEPT_PROGRAMS` are kept. Dropping one drops the
batch's step for it and its beam state; its graphs stay in the model's runtime, which keeps the most recently
used ones, and a later request of that program builds it again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from cachelife.generation.beams import BeamState
from cachelife.serving.beam_groups import BeamProgram
from cachelife.serving.rows import PER_ROW, Program

KEPT_PROGRAMS: Final = 8

Key = tuple[object, ...]
Entry = tuple[Program | BeamProgram, Callable[[], int]]  # the program and what runs its next steps


class Programs:
    """The batch's programs by key (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[Key, Entry] = OrderedDict()
        self.beam_states: dict[Key, BeamState] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, key: Key) -> Entry:
        return self._entries[key]

    def get(self, key: Key) -> Entry | None:
        """The program of `key` if kept (now the most recently used), else None."""
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def add(self, key: Key, entry: Entry, *, running: Key | None) -> None:
        """Keep `entry` under `key`; past `KEPT_PROGRAMS` programs of their own, drop the least recently used
        that is not `running`."""
        if key[0] != PER_ROW:
            own = [kept for kept in self._entries if kept[0] != PER_ROW]
            droppable = [kept for kept in own if kept != running]
            for dropped in droppable[: max(len(own) + 1 - KEPT_PROGRAMS, 0)]:
                del self._entries[dropped]
                self.beam_states.pop(dropped, None)
        self._entries[key] = entry
