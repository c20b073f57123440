"""The batch's program cache: programs of their own are bounded, the per-row pipeline's and the running one kept."""

from __future__ import annotations

import torch

from cachelife.serving.programs import KEPT_PROGRAMS, Programs
from cachelife.serving.rows import PER_ROW, Program


def _entry(key: tuple[object, ...]) -> tuple[Program, object]:
    return Program(key=key, processors=(), rows=(), do_sample=False, eos=None, pad=0), lambda: 1


def test_the_least_recently_used_program_of_its_own_is_dropped_past_the_bound() -> None:
    programs = Programs()
    for sampling in (False, True):
        programs.add((PER_ROW, sampling), _entry((PER_ROW, sampling)), running=None)  # type: ignore[arg-type]
    own = [(f"program {index}",) for index in range(KEPT_PROGRAMS + 3)]
    for index, key in enumerate(own):
        programs.add(key, _entry(key), running=own[0])  # type: ignore[arg-type]
        programs.beam_states[key] = torch.zeros(1)  # type: ignore[assignment]
        if index == 4:
            assert programs.get(own[1]) is not None  # used again: now the most recent
    assert len(programs) == 2 + KEPT_PROGRAMS
    kept = {key for key in own if programs.get(key) is not None}
    # The running one and the one used again stay; the oldest others went, with their beam states.
    assert own[0] in kept
    assert own[1] in kept
    assert own[2] not in kept
    assert own[2] not in programs.beam_states
    assert programs.get((PER_ROW, False)) is not None
    assert programs.get((PER_ROW, True)) is not None
