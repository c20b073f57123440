"""The engine's batch on the device: per-row tokens, lengths, limits and masks, and the step that decodes them.

Each row holds its own request's tokens from column 0 (`Rows`); lengths, end flags, length limits, the
attention mask over the cache's slots and the processors' per-row positions are tensors with one entry per
row, so that one compiled step (and one CUDA graph) serves whatever mix of requests the rows hold. A row's
position ids are its own token count minus one, whatever cache slot it writes (`window`), less its left
padding: a left-padded prompt's pads stay in its tokens (the processors read them, as `generate`'s do) and in
its cache slots, which its mask leaves out, and its positions count from its first token, as `generate`
counts them from the prompt's attention mask.

Everyday requests' processors are values in the rows (`row_settings`): one `Program` of the per-row pipeline
serves every mix of temperatures, top-k, top-p, penalties, suppressed and forced tokens, end and pad tokens,
greedy rows and sampling rows alike (its sampling variant runs while a row samples). A request with other
processors has a program of its own: transformers' processors converted as `cachelife.generate` converts them
(`generation.processors`), with the positions that differ between requests (the begin index of suppressed
tokens, minimum lengths, forced positions) held per row; requests of another such program wait for the batch
to run theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import attrs
import torch
from attrs import frozen
from transformers import PreTrainedModel

from cachelife.generation.greedy import pick_and_append
from cachelife.generation.penalties import Occurrences
from cachelife.generation.processors import Called, TensorProcessor
from cachelife.generation.tensor_processors import (
    Eta,
    ForceAt,
    NoEosBefore,
    NoRepeatNGram,
    RepetitionPenalty,
    SequenceBias,
    SuppressAtBegin,
    WhisperTimestamps,
)
from cachelife.serving.row_pipeline import pick, process
from cachelife.serving.row_settings import RowSettings

# The tensor processors' fields that hold a position of one request, held per row in a program.
ROW_FIELDS: Final[dict[type[object], tuple[str, ...]]] = {
    SuppressAtBegin: ("begin_index",),
    NoEosBefore: ("minimum", "skip"),
    ForceAt: ("at",),
    Occurrences: ("skip",),
    WhisperTimestamps: ("begin_index",),
}
# The key of the per-row pipeline's programs (with whether it runs the sampling stages).
PER_ROW: Final = "per-row"
# Processors the engine's per-row step runs: those that read only the scores, and the tensor processors whose
# arithmetic holds with one length per row.
_ROW_SAFE: Final = (
    Called,
    Eta,
    SuppressAtBegin,
    NoEosBefore,
    ForceAt,
    RepetitionPenalty,
    Occurrences,
    WhisperTimestamps,
    NoRepeatNGram,
    SequenceBias,
)


@frozen(kw_only=True)
class StepNames:
    """The forward's arguments: the token input, the decoder's mask over the cache, its position ids (None:
    T5's relative positions, read from the slots, need none; BART's family reads them from `row_positions`)
    and the cache; `row_positions`, the (rows, 1) buffer of `cachelife.model_rewrites.row_positions` that a
    decoder without position ids reads while the rows step."""

    tokens: str
    mask: str
    positions: str | None
    cache: str
    row_positions: torch.Tensor | None = None

    @property
    def takes_positions(self) -> bool:
        return self.positions is not None or self.row_positions is not None

    def feed(self, inputs: dict[str, Any], positions: torch.Tensor) -> None:
        """Hand the rows' position ids (rows, 1) to the forward: as its argument, or into `row_positions`."""
        if self.positions is not None:
            inputs[self.positions] = positions
        if self.row_positions is not None:
            self.row_positions.copy_(positions)


@frozen(kw_only=True)
class Rows:
    """Static buffers, mutated in place."""

    tokens: torch.Tensor  # (rows, width) long: each row's tokens from column 0
    length: torch.Tensor  # (rows,) long
    unfinished: torch.Tensor  # (rows,) bool
    active: torch.Tensor  # (rows,) bool: rows that decode (others' steps change nothing)
    max_length: torch.Tensor  # (rows,) long
    mask: torch.Tensor  # (rows, cache slots) long: the slots each row attends to
    padding: torch.Tensor  # (rows,) long: the pad tokens on the left of each row's prompt

    @classmethod
    def allocate(cls, rows: int, width: int, slots: int, device: torch.device) -> Rows:
        made = cls(
            tokens=torch.zeros(rows, width, dtype=torch.long, device=device),
            length=torch.ones(rows, dtype=torch.long, device=device),
            unfinished=torch.zeros(rows, dtype=torch.bool, device=device),
            active=torch.zeros(rows, dtype=torch.bool, device=device),
            max_length=torch.ones(rows, dtype=torch.long, device=device),
            mask=torch.ones(rows, slots, dtype=torch.long, device=device),
            padding=torch.zeros(rows, dtype=torch.long, device=device),
        )
        for tensor in attrs.astuple(made, recurse=False):
            torch._dynamo.mark_static_address(tensor)
        return made

    def running(self) -> torch.Tensor:
        return self.active & self.unfinished & (self.length < self.max_length)

    def positions(self) -> torch.Tensor:
        """The position ids of each row's last token: its index less the row's left padding."""
        return (self.length - 1 - self.padding).clamp(min=0)[:, None]

    def last_tokens(self) -> torch.Tensor:
        return self.tokens.gather(1, (self.length - 1).clamp(min=0)[:, None])

    def start(self, among: torch.Tensor, prompt: torch.Tensor, values: torch.Tensor) -> None:
        """The rows where `among` (rows,) holds start a request: `prompt` (width,), its tokens padded with zeros,
        and `values` (4,): its prompt's length, its max length, its left padding (the prompt's first tokens), and
        the cache slot its first token is in. Device work alone: the same kernels for every row (a graph replays
        them)."""
        length, max_length, padding, first_slot = values.unbind(0)
        beside = among[:, None]
        self.tokens.copy_(torch.where(beside, prompt[None, :], self.tokens))
        self.length.copy_(torch.where(among, length, self.length))
        self.unfinished.copy_(self.unfinished | among)
        self.active.copy_(self.active | among)
        self.max_length.copy_(torch.where(among, max_length, self.max_length))
        self.padding.copy_(torch.where(among, padding, self.padding))
        slots = torch.arange(self.mask.shape[1], device=self.mask.device)
        attended = (slots >= first_slot + padding).to(self.mask.dtype)
        self.mask.copy_(torch.where(beside, attended[None, :], self.mask))

    def attend_from(self, row: int, first_slot: int) -> None:
        slots = torch.arange(self.mask.shape[1], device=self.mask.device)
        self.mask[row].copy_(slots >= first_slot)

    def free(self, row: int) -> None:
        self.active[row] = False
        self.unfinished[row] = False
        self.length[row] = 1
        self.padding[row] = 0
        self.mask[row].fill_(1)


@frozen(kw_only=True)
class Program:
    """The processors of a batch and how it picks tokens; `rows` are the per-row tensors of its processors'
    `ROW_FIELDS`, (rows, 1) each, in the order `row_values` lists them. A program of the per-row pipeline has
    `settings` instead (and no processors): `do_sample` then says whether it runs the sampling stages, `ngrams`
    whether it runs the n-gram bans."""

    key: tuple[object, ...]
    processors: tuple[TensorProcessor, ...]
    rows: tuple[torch.Tensor, ...]
    do_sample: bool
    eos: torch.Tensor | None
    pad: int
    settings: RowSettings | None = None
    ngrams: bool = False


def per_row_program(settings: RowSettings, *, sampling: bool, ngrams: bool) -> Program:
    return Program(
        key=(PER_ROW, sampling, ngrams), processors=(), rows=(), do_sample=sampling, eos=None, pad=0,
        settings=settings, ngrams=ngrams,
    )  # fmt: skip


def shares_batch(key: tuple[object, ...], other: tuple[object, ...]) -> bool:
    """Whether requests of programs `key` and `other` may decode in one batch: the same program, or both the
    per-row pipeline (either variant)."""
    return key == other or (key[0] == PER_ROW and other[0] == PER_ROW)


def unsupported_for_rows(converted: Sequence[TensorProcessor], processors: Sequence[object]) -> str | None:
    """Why the rows cannot run `converted` (`processors`, transformers', converted one by one), naming the
    processor; None if they can."""
    for made, processor in zip(converted, processors, strict=True):
        if not isinstance(made, _ROW_SAFE):
            return f"a {type(processor).__name__} in an engine (its rule reads one length for the whole batch)"
    return None


def row_values(converted: Sequence[TensorProcessor]) -> list[torch.Tensor]:
    """One request's values of the per-row fields, 0-dim each, in program order."""
    return [getattr(p, name) for p in converted for name in ROW_FIELDS.get(type(p), ())]


def program_key(converted: Sequence[TensorProcessor], *, do_sample: bool, eos: object, pad: int) -> tuple[object, ...]:
    """What must be equal for two requests to share a batch: every processor's type and settings but the
    per-row fields, and how tokens are picked."""
    described = tuple((type(p).__name__, _settings(p)) for p in converted)
    return (described, do_sample, _value(eos), pad)


def build_program(
    converted: Sequence[TensorProcessor], key: tuple[object, ...], *, rows: int, do_sample: bool,
    eos: torch.Tensor | None, pad: int,
) -> Program:  # fmt: skip
    """A program from one request's converted processors, the per-row fields as (rows, 1) buffers."""
    made, per_row = per_row_buffers(converted, rows)
    return Program(key=key, processors=made, rows=per_row, do_sample=do_sample, eos=eos, pad=pad)


def per_row_buffers(
    converted: Sequence[TensorProcessor], rows: int
) -> tuple[tuple[TensorProcessor, ...], tuple[torch.Tensor, ...]]:
    """The processors with their per-row fields as static (rows, 1) buffers, and those buffers in the order
    `row_values` lists their values."""
    per_row: list[torch.Tensor] = []
    made: list[TensorProcessor] = []
    for processor in converted:
        names = ROW_FIELDS.get(type(processor), ())
        if not names:
            made.append(processor)
            continue
        buffers = {}
        for name in names:
            value: torch.Tensor = getattr(processor, name)
            buffer = value.expand(rows, 1).clone()
            torch._dynamo.mark_static_address(buffer)
            buffers[name] = buffer
            per_row.append(buffer)
        made.append(attrs.evolve(processor, **buffers))  # type: ignore[misc]  # the tensor processors are attrs classes
    return tuple(made), tuple(per_row)


def engine_steps(
    model: PreTrainedModel,
    rows: Rows,
    *,
    noise: Sequence[torch.Tensor],
    program: Program,
    step_inputs: dict[str, Any],
    steps: int,
    names: StepNames,
) -> None:
    """`steps` steps of every row (the function that gets compiled)."""
    for index in range(steps):
        inputs: dict[str, Any] = {names.tokens: rows.last_tokens(), names.mask: rows.mask}
        if names.takes_positions:
            names.feed(inputs, rows.positions())
        output = model(**inputs, use_cache=True, **step_inputs)
        choose(rows, output.logits[:, -1].to(torch.float32), noise[index], program)


def choose(
    rows: Rows, logits: torch.Tensor, noise: torch.Tensor, program: Program, among: torch.Tensor | None = None
) -> None:
    """Process `logits` (rows, vocab; float32) with each row's length, pick a token per running row (argmax,
    or an exponential race) and append it, as `cachelife.generate`'s greedy step does for one request; with
    `among`, only those rows take part."""
    running = rows.running() if among is None else rows.running() & among
    length = rows.length[:, None]
    if program.settings is not None:
        scores = process(program.settings, rows.tokens, length, logits, sampling=program.do_sample,
                         ngrams=program.ngrams)  # fmt: skip
        pick(program.settings, rows.tokens, rows.length, rows.unfinished, scores, noise=noise, running=running,
             sampling=program.do_sample)  # fmt: skip
        return
    scores = logits
    for processor in program.processors:
        scores = processor(rows.tokens, length, scores)
    pick_and_append(
        rows.tokens, rows.length, rows.unfinished, scores, noise=noise, running=running, do_sample=program.do_sample,
        eos=program.eos, pad=program.pad,
    )  # fmt: skip


def _settings(processor: TensorProcessor) -> object:
    inner = getattr(processor, "processor", None)
    if isinstance(processor, Called) and inner is not None:
        return tuple(sorted((name, _value(value)) for name, value in vars(inner).items()))
    skipped = ROW_FIELDS.get(type(processor), ())
    if attrs.has(type(processor)):
        fields = attrs.fields(type(processor))  # type: ignore[arg-type]  # attrs.has narrows no type
        return tuple((f.name, _value(getattr(processor, f.name))) for f in fields if f.name not in skipped)
    return repr(processor)


def _value(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), tuple(value.shape), tuple(value.flatten().tolist()))
    if isinstance(value, list | tuple):
        return tuple(_value(item) for item in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _value(v)) for k, v in value.items()))
    return value if isinstance(value, int | float | str | bool | None) else repr(value)
