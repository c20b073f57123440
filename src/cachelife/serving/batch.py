"""The engine's batch: its pinned caches, its rows and their slots, run by the scheduler thread alone.

`join` writes a newcomer's prompt into a free row at a step boundary: the prefill (`prefill`, or with its
neighbours `joint_prefill`) runs on a pinned scratch cache, whose keys and values are copied into the row so
that the prompt ends just before the batch's write slot (`window`), its encoder keys and values whole; the
first token is picked as `cachelife.generate` picks it. A beam request takes a group of neighbouring rows, one
per beam, each given the same prefill, and starts its search from the prefill's logits (`beam_groups`).
`advance` runs one call of the program's step for every row (each program's step built by `batch_steps`),
`collect` hands back the requests that ended. The slots' states are `slots`' table; the device buffers are
`rows`' (and a beam program's state, `beam_groups`').
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Any

import torch
from attrs import define, field
from transformers import PreTrainedModel

from cachelife.core.cache_lifecycle import is_encoder_decoder_cache, lifecycle
from cachelife.core.pinning import prepare_static_cache
from cachelife.generation.beams import buffer_width
from cachelife.generation.loop_settings import LoopSettings
from cachelife.model_rewrites.row_positions import RowPositions
from cachelife.serving.admission import BatchView
from cachelife.serving.batch_steps import BatchSteps
from cachelife.serving.beam_groups import BeamProgram, group_output, start_group
from cachelife.serving.encoder_rows import EncoderRow, padded_encoder_row, write_encoder_row
from cachelife.serving.joint_prefill import JointPrefill, Prefilled, group_sizes
from cachelife.serving.model_facts import (
    check_memory,
    check_positions,
    encoder_length_of,
    refuse_sliding_windows,
    step_names,
    vocab_size,
)
from cachelife.serving.prefill import Prefill
from cachelife.serving.programs import Programs
from cachelife.serving.requests import Joining, first_sequence, hand_back, stopped_at
from cachelife.serving.row_settings import RowSettings
from cachelife.serving.row_starts import RowStarts
from cachelife.serving.row_writes import RowWrites, roll_rows
from cachelife.serving.rows import (
    PER_ROW,
    Program,
    Rows,
    per_row_program,
    row_values,
)
from cachelife.serving.slots import Decoding, Finished, Free, Prefilling, Slot
from cachelife.serving.snapshots import READ_LAG, Snapshot, Snapshots
from cachelife.serving.window import Occupant, Placement


@define(kw_only=True)
class _Seat:
    """A request's rows: `size` rows from the row it is keyed by (its beams or sampled sequences; else 1)."""

    joining: Joining
    start: int
    end: int
    streamed: int  # the row's tokens handed to its request's streamer so far (the prompt's by generate)
    checked: int  # the row's tokens its host-side stopping criteria have seen (the prompt's at first)
    joined: int  # the step calls before it joined: the rows' snapshots until then are not its
    size: int = 1
    unused: int = 0  # leading noise buffers holding draws no step used yet
    # Several sampled sequences: each row's tokens its host-side stops have seen, and where they stopped it.
    checks: dict[int, int] = field(factory=dict)
    stops: dict[int, int] = field(factory=dict)


class Batch:
    """`rows` rows of at most `max_length` tokens each (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, *, rows: int, max_length: int, settings: LoopSettings,
                 encoder_length: int | None, row_positions: RowPositions | None = None) -> None:  # fmt: skip
        self.model, self.settings, self.max_length = model, settings, max_length
        self.row_positions = row_positions
        self.names = step_names(model, None if row_positions is None else row_positions.positions)
        # Past a row's last feed: its last call's slots, and the calls before the host reads that it ended.
        self.reserve = (1 + READ_LAG) * settings.steps_per_call
        self.width = max_length + self.reserve
        check_positions(model, max_length)
        refuse_sliding_windows(model, self.width)
        self.encoder_length = encoder_length_of(model, encoder_length)
        joint = () if model.config.is_encoder_decoder else group_sizes(rows)
        check_memory(model, rows=rows, width=self.width, encoder_length=self.encoder_length,
                     scratch_rows=1 + sum(joint))  # fmt: skip
        self.vocab = vocab_size(model)
        device = model.device
        self.rows = Rows.allocate(rows, buffer_width(max_length), self.width, device)
        self.row_settings = RowSettings.allocate(rows, self.vocab, device)
        self.cache = prepare_static_cache(model, batch_size=rows, max_cache_len=self.width,
                                          encoder_length=self.encoder_length)  # fmt: skip
        self.scratch = prepare_static_cache(model, batch_size=1, max_cache_len=self.width,
                                            encoder_length=self.encoder_length)  # fmt: skip
        self.prefill = Prefill(model, self.scratch, settings, self.vocab)
        self.writes = RowWrites(model, self.cache, self.scratch, settings)
        self.starts = RowStarts(model, self.rows, self.vocab, settings)
        self.joint = JointPrefill(model, self.cache, sizes=joint, width=self.width, settings=settings,
                                  prefill=self.prefill, cache_name=self.names.cache)  # fmt: skip
        if is_encoder_decoder_cache(self.cache):  # every row's encoder keys and values are written at its join
            for index in range(len(lifecycle(self.cache).cross_attention)):
                self.cache.is_updated[index] = True
        self.step_inputs: dict[str, Any] = {self.names.cache: self.cache}
        self.noise = tuple(torch.ones(rows, self.vocab, device=device) for _ in range(settings.steps_per_call))
        for buffer in self.noise:
            torch._dynamo.mark_static_address(buffer)
        self.batch_steps = BatchSteps(
            model=model, rows=self.rows, noise=self.noise, step_inputs=self.step_inputs, names=self.names,
            settings=settings, cache=self.cache, row_count=rows,
        )  # fmt: skip
        self.slots = [Slot(row) for row in range(rows)]
        self.seats: dict[int, _Seat] = {}
        self.programs = Programs()
        self.beam_states = self.programs.beam_states
        self.program: Program | BeamProgram | None = None
        self.slot = 0  # where every row writes its next key and value
        self.steps = 0
        self.calls = 0  # calls of the step so far
        self.snapshots = Snapshots.allocate(self.rows)
        # The rows' state after each of the last calls, oldest first; `collect` reads the one `READ_LAG` calls back.
        self.pending: deque[Snapshot] = deque()
        self.moves = 0
        self.joins = 0
        self.prefill_seconds = 0.0  # the scheduler's wall seconds in newcomers' prefills
        self.prefills = 0  # forwards over newcomers' prompts (a joint prefill's is one)

    def view(self) -> BatchView:
        """The batch as admission (`admission.plan`) sees it."""
        return BatchView(
            free=tuple(isinstance(slot.state, Free) for slot in self.slots),
            program=None if self.program is None else self.program.key,
            occupants=tuple(Occupant(seat.start, seat.end) for seat in self.seats.values()),
            slot=self.slot, width=self.width, reserve=self.reserve,
        )  # fmt: skip

    def prefill_jointly(self, joinings: list[Joining]) -> list[Prefilled] | None:
        """The newcomers' prompts through one forward (`joint_prefill`), or None if it failed."""
        started = time.perf_counter()
        prefilled = self.joint.or_none(joinings)
        self.prefill_seconds += time.perf_counter() - started
        self.prefills += prefilled is not None
        return prefilled

    def join(self, joining: Joining, first: int, placement: Placement, prefilled: Prefilled | None = None) -> None:
        """Write the newcomer's prompt into its free rows from `first` so that it ends before the placement's
        slot (from `prefilled`, or its own prefill now), and pick its first token (or take its beams' first
        step); a failure fails the newcomer alone and leaves the other rows as they were."""
        group = self.slots[first : first + joining.rows]
        for slot in group:
            slot.move("admit", Prefilling(joining.request.number))
        encoder = None
        try:
            program = self._joining_program(joining)
            if prefilled is None:
                prefilled, encoder = self._prefill(joining)
        except Exception as error:
            for slot in group:
                slot.move("fail", Free())
            hand_back(joining, error=error)
            return
        try:
            start = self._place(first, joining, placement, program=program, prefilled=prefilled, encoder=encoder)
        except BaseException as error:
            # A roll moves every row: past the prefill, a failure leaves the batch's buffers in doubt, and the
            # scheduler fails every row after this one.
            for slot in group:
                self.rows.free(slot.row)
                slot.move("fail", Free())
            hand_back(joining, error=error)
            raise
        for slot in group:
            slot.move("start", Decoding(joining.request.number, start))
        self.joins += 1
        end = self.slot + joining.max_length - joining.prompt - 1
        self.seats[first] = _Seat(
            joining=joining, start=start, end=end, streamed=joining.prompt, checked=joining.prompt, joined=self.calls,
            size=joining.rows,
        )  # fmt: skip

    def _place(
        self, first: int, joining: Joining, placement: Placement, *, program: Program | BeamProgram,
        prefilled: Prefilled, encoder: EncoderRow | None,
    ) -> int:  # fmt: skip
        """Move the rows as the placement says, copy the prefill into the request's rows from `first`, pick the
        first token (or take the beams' first step); the rows' first slot."""
        logits = prefilled.logits
        self.program = program
        if placement.shift:
            self._roll(placement.shift)
        self.slot = placement.slot
        start = self.slot - joining.prompt
        for row in range(first, first + joining.rows):
            prefilled.writes.write(row, start - prefilled.extra, self.slot, prefilled.source)
            if encoder is not None:
                write_encoder_row(self.step_inputs, row, encoder)
            if joining.per_row is None:
                for buffer, value in zip(program.rows, row_values(joining.converted), strict=True):
                    buffer[row] = value
        first_pick = None if isinstance(program, BeamProgram) else program  # a search's first step is its own
        self.starts.start(
            first, prompt=joining.input_ids[:1], count=joining.rows, max_length=joining.max_length, first_slot=start,
            padding=joining.padding, logits=logits[0], program=first_pick, per_row=joining.per_row,
            generator=joining.generator, draws=joining.draws,
        )  # fmt: skip
        if isinstance(program, BeamProgram):
            noise = torch.ones(joining.beams, self.vocab, device=logits.device)
            if joining.generator is not None:
                noise.exponential_(generator=joining.generator)
            start_group(
                self.beam_states[program.key], program, first // joining.beams, prompt=joining.input_ids,
                max_length=joining.max_length, logits=logits, noise=noise,
            )  # fmt: skip
        return start

    def advance(self) -> None:
        """One call of the step for every row (`steps_per_call` steps; a graph's first call runs one)."""
        if self.program is None:
            return
        if self.program.key[0] == PER_ROW:  # the sampling stages and n-gram bans only while a row needs them
            self.program = self._per_row(*self._stages())
        spc = self.settings.steps_per_call
        for row, seat in self.seats.items():
            generator = seat.joining.generator
            if generator is not None:
                for buffer in self.noise[seat.unused :]:
                    seat.joining.draws.draw(buffer[row : row + seat.size], generator)
        with self.row_positions.reading_rows() if self.row_positions is not None else contextlib.nullcontext():
            ran = self.programs[self.program.key][1]()
        for row, seat in self.seats.items():  # draws a call did not use come first in the next
            if seat.joining.generator is None:
                continue
            for index in range(spc - ran):
                self.noise[index][row : row + seat.size].copy_(self.noise[ran + index][row : row + seat.size])
            seat.unused = max(spc - ran, 0)
        self.slot += ran
        self.steps += ran
        self.calls += 1
        if not isinstance(self.program, BeamProgram):
            tokens = any(seat.joining.streamer is not None or seat.joining.criteria for seat in self.seats.values())
            self.pending.append(self.snapshots.take(self.rows, taken=self.calls, tokens=tokens))

    def collect(self) -> None:
        """Hand streaming rows' new tokens over, hand back the rows that ended, and leave abandoned ones: from
        the rows' snapshot of the call `READ_LAG` calls back (`snapshots`; a beam search's groups from the last)."""
        if isinstance(self.program, BeamProgram):
            self.pending.clear()
            if self.seats:
                self._collect_groups(self.program)
            return
        snapshot = self.pending.popleft() if len(self.pending) > READ_LAG else None
        if snapshot is not None and self.seats:
            self._collect_rows(snapshot)

    def _collect_rows(self, snapshot: Snapshot) -> None:
        snapshot.wait()
        lengths, unfinished = snapshot.length.tolist(), snapshot.unfinished.tolist()
        for row, seat in list(self.seats.items()):
            joining = seat.joining
            if joining.abandoned:
                self.end(row)
                continue
            if seat.joined >= snapshot.taken:  # it joined after this snapshot
                continue
            if seat.size > 1:
                self._collect_sequences(row, seat, lengths, unfinished)
                continue
            length = lengths[row]
            stopped = None
            if joining.criteria:  # the stops only the host reads, over the positions since their last look
                stopped = stopped_at(joining.criteria, self.rows.tokens[row : row + 1, :length], after=seat.checked)
                seat.checked = length
            length = length if stopped is None else stopped
            if joining.streamer is not None and length > seat.streamed and snapshot.tokens is not None:
                joining.streamed.append(snapshot.tokens[row, seat.streamed : length].clone())  # the buffer is reused
                seat.streamed = length
                joining.news.set()
            if stopped is not None or not unfinished[row] or length >= joining.max_length:
                self.end(row, tokens=self.rows.tokens[row : row + 1, :length].clone())

    def _collect_sequences(self, row: int, seat: _Seat, lengths: list[int], unfinished: list[bool]) -> None:
        """A request's several sampled sequences, from `row`: each ends on its own (on the device, or where a stop
        only the host reads stops it, after which the row decodes no more), and the request once all have, each
        padded past its end as generate pads it."""
        joining, group = seat.joining, range(row, row + seat.size)
        for each in group:
            if joining.criteria and each not in seat.stops:
                stopped = stopped_at(joining.criteria, self.rows.tokens[each : each + 1, : lengths[each]],
                                     after=seat.checks.get(each, seat.checked))  # fmt: skip
                seat.checks[each] = lengths[each]
                if stopped is not None:
                    seat.stops[each] = stopped
                    self.rows.unfinished[each] = False
        ended = [each in seat.stops or not unfinished[each] or lengths[each] >= joining.max_length for each in group]
        if not all(ended):
            return
        ends = [seat.stops.get(each, lengths[each]) for each in group]
        tokens = self.rows.tokens[row : row + seat.size, : max(ends)].clone()
        for index, end in enumerate(ends):
            tokens[index, end:] = joining.pad
        self.end(row, tokens=tokens)

    def _collect_groups(self, program: BeamProgram) -> None:
        """Hand back the groups whose search ended (one host read of the running flags), and leave abandoned
        ones."""
        state = self.beam_states[program.key]
        running = state.running.tolist()
        for row, seat in list(self.seats.items()):
            joining, group = seat.joining, row // seat.size
            if joining.abandoned:
                self.end(row)
            elif not running[group]:
                tokens = group_output(state, group, prompt_length=joining.prompt, sequences=joining.sequences)
                self.end(row, tokens=tokens)

    def end(self, row: int, *, tokens: torch.Tensor | None = None, error: BaseException | None = None) -> None:
        """The request in the rows from `row` ends: its rows are freed (its search stopped) and it is handed
        its tokens or its error."""
        seat = self.seats.pop(row)
        for slot in self.slots[row : row + seat.size]:
            slot.move("finish", Finished(seat.joining.request.number))
            self.rows.free(slot.row)
            slot.move("free", Free())
        joining = seat.joining
        if isinstance(self.program, BeamProgram):
            self.beam_states[self.program.key].running[row // seat.size] = False
        elif joining.generator is not None and tokens is not None:  # one draw per token step, as generate leaves it
            joining.draws.rewind(joining.generator, int(tokens.shape[1]) - joining.prompt)
        hand_back(joining, tokens=tokens, error=error)

    def fail_all(self, error: BaseException) -> None:
        self.pending.clear()
        for row in list(self.seats):
            self.end(row, error=error)
        self.slot = 0

    # -- joining ---------------------------------------------------------------------------------------------

    def _stages(self, joining: Joining | None = None) -> tuple[bool, bool]:
        """Whether a row of the batch (or the newcomer) samples, and whether one bans n-grams."""
        seated = (seat.joining for seat in self.seats.values())
        values = [j.per_row for j in (*seated, *([joining] if joining else [])) if j.per_row is not None]
        return any(v.do_sample for v in values), any(v.no_repeat_ngram for v in values)

    def _joining_program(self, joining: Joining) -> Program | BeamProgram:
        """The program the batch runs once the newcomer has joined."""
        if joining.per_row is not None:
            return self._per_row(*self._stages(joining))
        if self.seats and self.program is not None:
            return self.program
        return self._program_for(joining)

    def _per_row(self, sampling: bool, ngrams: bool) -> Program:
        key: tuple[object, ...] = (PER_ROW, sampling, ngrams)
        if self.programs.get(key) is None:
            program = per_row_program(self.row_settings, sampling=sampling, ngrams=ngrams)
            self.programs.add(key, (program, self.batch_steps.stepper(program)), running=None)
        return self.programs[key][0]  # type: ignore[return-value]  # a per-row key holds a Program

    def _program_for(self, joining: Joining) -> Program | BeamProgram:
        found = self.programs.get(joining.key)
        if found is None:
            found = self.batch_steps.own(joining, self.beam_states)
            self.programs.add(joining.key, found, running=None if self.program is None else self.program.key)
        return found[0]

    def _prefill(self, joining: Joining) -> tuple[Prefilled, EncoderRow | None]:
        """The newcomer's prompt through the prefill on the scratch cache, and its encoder output (and mask) at
        the engine's encoder length."""
        started = time.perf_counter()
        kwargs = first_sequence(joining.model_kwargs, joining.rows)
        for stale in ("cache", "past_key_values"):
            kwargs.pop(stale, None)
        kwargs[self.names.cache] = self.scratch
        encoder = None
        if self.encoder_length is not None:
            encoder = padded_encoder_row(
                kwargs, width=self.encoder_length, rows=len(self.slots), step_inputs=self.step_inputs,
                masked=self.names.positions is None,  # Whisper's (position ids) has no padding to mask
            )  # fmt: skip
        logits = self.prefill(joining.input_ids[:1], joining.config, kwargs)
        self.prefill_seconds += time.perf_counter() - started
        self.prefills += 1
        return Prefilled(logits=logits, writes=self.writes, source=0, extra=0), encoder

    def _roll(self, shift: int) -> None:
        """Move every row's content `shift` slots along the cache (all rows alike, distances kept)."""
        self.moves += 1
        roll_rows(self.cache, shift)
        for first, seat in self.seats.items():
            seat.start += shift
            seat.end += shift
            for row in range(first, first + seat.size):
                self.rows.attend_from(row, seat.start + seat.joining.padding)
