"""The decoding settings of each engine row as values in tensors, so that one step serves every mix of them.

transformers builds a list of processors per `generate` call, each holding its settings as Python values: a
step compiled around one list serves only requests with those values. Here the processors `generate` builds
for everyday requests (`_get_logits_processor`'s, in its order) become stages of one fixed pipeline whose
settings are per-row tensors (`RowSettings`), written when a request joins its row:

| stage (transformers' processor)          | per-row value                                   | off            |
|------------------------------------------|-------------------------------------------------|----------------|
| RepetitionPenaltyLogitsProcessor         | penalty; left padding the penalty skips         | penalty 1      |
| NoRepeatNGramLogitsProcessor             | n-gram size, up to `row_ngrams.LONGEST_NGRAM`    | 0              |
| MinLengthLogitsProcessor                 | minimum length (end tokens: the row's own)      | 0              |
| MinNewTokensLengthLogitsProcessor        | minimum new tokens, prompt length               | 0              |
| ForcedBOSTokenLogitsProcessor            | token                                           | at length -1   |
| ForcedEOSTokenLogitsProcessor            | tokens, the length it forces them at            | at length -1   |
| SuppressTokensLogitsProcessor            | a vocabulary mask                               | empty mask     |
| SuppressTokensAtBeginLogitsProcessor     | a vocabulary mask, the length it applies at     | at length -1   |
| cachelife's OccurrencePenalty            | presence, frequency, the prompt it skips        | both 0         |
| TemperatureLogitsWarper                  | temperature                                     | 1              |
| TopKLogitsWarper                         | k                                               | the vocabulary |
| TopPLogitsWarper                         | 1 - p, rounded as transformers compares it      | flag           |
| MinPLogitsWarper                         | p                                               | flag           |
| TypicalLogitsWarper                      | mass                                            | flag           |
| LogitNormalization                       | -                                               | flag           |

plus, for picking the token: sampling or not, the end tokens (a vocabulary mask) and the pad token. Each stage
(`row_pipeline.process`) computes what transformers' processor computes, one row's arithmetic per row; a row
that has the stage off keeps its scores as they were (`torch.where`), bit for bit. A request whose list holds
anything else (a custom processor, Whisper's timestamp rules, bad words, an order of its own) is not `PerRow`:
it runs a program of its own (`rows.Program`), as before.

Variants of the pipeline share the same tensors: with or without the sampling stages (run while a row samples)
and the n-gram bans (while a row bans n-grams); the batch picks one at each step boundary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
from attrs import frozen
from transformers.generation import logits_process as lp

from cachelife.generation.penalties import OccurrencePenalty
from cachelife.serving.host_values import copy_values, device_tensor
from cachelife.serving.row_ngrams import LONGEST_NGRAM

_OFF = -1  # a length no row has: the stages that apply at one length never apply


@frozen(kw_only=True)
class PerRow:
    """One request's values for the pipeline (Python values: written into a row when the request joins)."""

    do_sample: bool
    eos: tuple[int, ...]
    pad: int
    repetition_penalty: float = 1.0
    repetition_ignore: int = 0
    no_repeat_ngram: int = 0
    min_length: int = 0
    min_new_tokens: int = 0
    prompt_length: int = 0
    bos: int = 0
    bos_at: int = _OFF
    forced_eos: tuple[int, ...] = ()
    forced_eos_at: int = _OFF
    suppress: tuple[int, ...] = ()
    begin_suppress: tuple[int, ...] = ()
    begin_at: int = _OFF
    presence: float = 0.0
    frequency: float = 0.0
    occurrences_from: int = 0
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    renormalize: bool = False


# The stages in transformers' order: a request's processors must appear in this order, each at most once.
_ORDER: tuple[type[lp.LogitsProcessor], ...] = (
    lp.RepetitionPenaltyLogitsProcessor,
    lp.NoRepeatNGramLogitsProcessor,
    lp.MinLengthLogitsProcessor,
    lp.MinNewTokensLengthLogitsProcessor,
    lp.ForcedBOSTokenLogitsProcessor,
    lp.ForcedEOSTokenLogitsProcessor,
    lp.SuppressTokensLogitsProcessor,
    lp.SuppressTokensAtBeginLogitsProcessor,
    OccurrencePenalty,  # where `generate` puts a custom processor: after its own, before the warpers
    lp.TemperatureLogitsWarper,
    lp.TopKLogitsWarper,
    lp.TopPLogitsWarper,
    lp.MinPLogitsWarper,
    lp.TypicalLogitsWarper,
    lp.LogitNormalization,
)
_WARPERS = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper, lp.MinPLogitsWarper,
            lp.TypicalLogitsWarper)  # fmt: skip


def per_row(
    processors: Sequence[lp.LogitsProcessor], *, do_sample: bool, eos: torch.Tensor | None, pad: int
) -> PerRow | str:
    """The request's processors as per-row values, or why they are not (a reason naming the processor)."""
    ends = () if eos is None else tuple(int(token) for token in eos.view(-1).tolist())
    values: dict[str, object] = {}
    last = -1
    for processor in processors:
        kind = type(processor)
        if kind not in _ORDER:
            return f"a {kind.__name__}"
        at = _ORDER.index(kind)
        if at <= last:
            return f"processors in an order of their own ({kind.__name__} after {_ORDER[last].__name__})"
        last = at
        if kind in _WARPERS and not do_sample:
            return f"a {kind.__name__} without sampling"
        found = _values(processor, ends)
        if isinstance(found, str):
            return found
        values.update(found)
    return PerRow(do_sample=do_sample, eos=ends, pad=pad, **values)  # type: ignore[arg-type]  # checked by _values


def _ids(value: object) -> tuple[int, ...]:
    if isinstance(value, torch.Tensor):
        return tuple(int(token) for token in value.view(-1).tolist())
    if isinstance(value, int):
        return (value,)
    if isinstance(value, Sequence):
        return tuple(int(token) for token in value)
    msg = f"token ids as a tensor, an int or a sequence of ints, got {value!r}"
    raise TypeError(msg)


def _kept_filtered(processor: lp.LogitsProcessor) -> str | None:
    """Warpers keep one token and filter to -inf in the pipeline (as `generate` builds them without beams)."""
    if getattr(processor, "min_tokens_to_keep", 1) != 1 or getattr(processor, "filter_value", -math.inf) != -math.inf:
        return f"a {type(processor).__name__} with min_tokens_to_keep or filter_value of its own"
    return None


def _values(processor: lp.LogitsProcessor, eos: tuple[int, ...]) -> dict[str, object] | str:  # noqa: PLR0911, PLR0912 (one case per stage)
    match processor:
        case lp.RepetitionPenaltyLogitsProcessor():
            # The padding lengths, one per sequence of the request's one prompt (sampled sequences): all equal.
            ignore = getattr(processor, "prompt_ignore_length", None)
            skipped = 0 if ignore is None else _ids(ignore)[0]
            return {"repetition_penalty": float(processor.penalty), "repetition_ignore": skipped}
        case lp.NoRepeatNGramLogitsProcessor():
            size = int(processor.ngram_size)
            if size > LONGEST_NGRAM:
                return f"a NoRepeatNGramLogitsProcessor of {size}-grams (the rows ban up to {LONGEST_NGRAM})"
            return {"no_repeat_ngram": size}
        case lp.MinLengthLogitsProcessor():
            if _ids(processor.eos_token_id) != eos:
                return "a MinLengthLogitsProcessor whose end tokens are not the request's"
            return {"min_length": int(processor.min_length)}
        case lp.MinNewTokensLengthLogitsProcessor():
            if _ids(processor.eos_token_id) != eos:
                return "a MinNewTokensLengthLogitsProcessor whose end tokens are not the request's"
            return {"min_new_tokens": int(processor.min_new_tokens),
                    "prompt_length": int(processor.prompt_length_to_skip)}  # fmt: skip
        case lp.ForcedBOSTokenLogitsProcessor():
            return {"bos": int(processor.bos_token_id), "bos_at": 1}
        case lp.ForcedEOSTokenLogitsProcessor():
            return {"forced_eos": _ids(processor.eos_token_id), "forced_eos_at": int(processor.max_length) - 1}
        case lp.SuppressTokensLogitsProcessor():
            return {"suppress": _ids(processor.suppress_tokens)}
        case lp.SuppressTokensAtBeginLogitsProcessor():
            return {"begin_suppress": _ids(processor.begin_suppress_tokens), "begin_at": int(processor.begin_index)}
        case OccurrencePenalty():
            return {"presence": processor.presence, "frequency": processor.frequency,
                    "occurrences_from": processor.prompt_length}  # fmt: skip
        case lp.TemperatureLogitsWarper():
            return {"temperature": float(processor.temperature)}
        case lp.TopKLogitsWarper():
            return _kept_filtered(processor) or {"top_k": int(processor.top_k)}
        case lp.TopPLogitsWarper():
            return _kept_filtered(processor) or {"top_p": float(processor.top_p)}
        case lp.MinPLogitsWarper():
            return _kept_filtered(processor) or {"min_p": float(processor.min_p)}
        case lp.TypicalLogitsWarper():
            return _kept_filtered(processor) or {"typical_p": float(processor.mass)}
        case _:  # LogitNormalization
            return {"renormalize": True}


@frozen(kw_only=True)
class RowSettings:
    """Every row's values (static buffers, written by `write` at a join, read by the compiled step)."""

    do_sample: torch.Tensor  # (rows,) bool
    eos: torch.Tensor  # (rows, vocab) bool
    pad: torch.Tensor  # (rows,) long
    penalty: torch.Tensor  # (rows, 1) float32
    ignore: torch.Tensor  # (rows,) long
    ngram: torch.Tensor  # (rows, 1) long: 0 where off
    min_length: torch.Tensor  # (rows, 1) long
    min_new_tokens: torch.Tensor  # (rows, 1) long
    prompt_length: torch.Tensor  # (rows, 1) long
    bos: torch.Tensor  # (rows, 1) long
    bos_at: torch.Tensor  # (rows, 1) long
    forced_eos: torch.Tensor  # (rows, vocab) bool
    forced_eos_at: torch.Tensor  # (rows, 1) long
    suppress: torch.Tensor  # (rows, vocab) bool
    begin_suppress: torch.Tensor  # (rows, vocab) bool
    begin_at: torch.Tensor  # (rows, 1) long
    presence: torch.Tensor  # (rows, 1) float32
    frequency: torch.Tensor  # (rows, 1) float32
    occurrences_from: torch.Tensor  # (rows, 1) long
    temperature: torch.Tensor  # (rows, 1) float32
    top_k: torch.Tensor  # (rows, 1) long: the vocabulary size where off
    top_p_cut: torch.Tensor  # (rows, 1) float32: 1 - top_p, rounded as transformers' comparison rounds it
    top_p_on: torch.Tensor  # (rows, 1) bool
    min_p: torch.Tensor  # (rows, 1) float32
    min_p_on: torch.Tensor  # (rows, 1) bool
    typical_p: torch.Tensor  # (rows, 1) float32
    typical_on: torch.Tensor  # (rows, 1) bool
    renormalize: torch.Tensor  # (rows, 1) bool

    @classmethod
    def allocate(cls, rows: int, vocab: int, device: torch.device) -> RowSettings:
        def flat(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(rows, dtype=dtype, device=device)

        def column(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(rows, 1, dtype=dtype, device=device)

        def mask() -> torch.Tensor:
            return torch.zeros(rows, vocab, dtype=torch.bool, device=device)

        long, flag, real = torch.long, torch.bool, torch.float32
        settings = cls(
            do_sample=flat(flag),
            eos=mask(),
            pad=flat(long),
            penalty=column(real),
            ignore=flat(long),
            ngram=column(long),
            min_length=column(long),
            min_new_tokens=column(long),
            prompt_length=column(long),
            bos=column(long),
            bos_at=column(long),
            forced_eos=mask(),
            forced_eos_at=column(long),
            suppress=mask(),
            begin_suppress=mask(),
            begin_at=column(long),
            presence=column(real),
            frequency=column(real),
            occurrences_from=column(long),
            temperature=column(real),
            top_k=column(long),
            top_p_cut=column(real),
            top_p_on=column(flag),
            min_p=column(real),
            min_p_on=column(flag),
            typical_p=column(real),
            typical_on=column(flag),
            renormalize=column(flag),
        )
        for tensor in attrs.astuple(settings, recurse=False):
            torch._dynamo.mark_static_address(tensor)
        for row in range(rows):
            settings.clear(row)
        return settings

    @property
    def vocab(self) -> int:
        return int(self.eos.shape[1])

    def write(self, row: int, values: PerRow) -> None:
        """Row `row` decodes with `values` from the next step on."""
        staged = StagedSettings.allocate(self.vocab, self.eos.device)
        staged.stage(values)
        indices = torch.arange(self.do_sample.shape[0], device=self.eos.device)
        self.write_staged(indices == row, staged)

    def write_staged(self, among: torch.Tensor, staged: StagedSettings) -> None:
        """The rows where `among` (rows,) holds decode with the values in `staged` from the next step on: device
        work alone, the same kernels for every row and request (a graph replays them)."""
        values = (*staged.numbers.unbind(0), *staged.reals.unbind(0), *staged.masks.unbind(0))
        for name, value in zip((*_NUMBERS, *_REALS, *_MASKS), values, strict=True):
            field: torch.Tensor = getattr(self, name)
            where = among.view(-1, *([1] * (field.dim() - 1)))
            field.copy_(torch.where(where, value.to(field.dtype), field))

    def clear(self, row: int) -> None:
        """Row `row` holds no request: every stage off, greedy."""
        self.write(row, PerRow(do_sample=False, eos=(), pad=0))


# `RowSettings`' fields as `StagedSettings` holds them: integers and flags, real numbers, vocabulary masks.
_NUMBERS = ("do_sample", "pad", "ignore", "ngram", "min_length", "min_new_tokens", "prompt_length", "bos", "bos_at",
            "forced_eos_at", "begin_at", "occurrences_from", "top_k", "top_p_on", "min_p_on", "typical_on",
            "renormalize")  # fmt: skip
_REALS = ("penalty", "presence", "frequency", "temperature", "top_p_cut", "min_p", "typical_p")
_MASKS = ("eos", "forced_eos", "suppress", "begin_suppress")


@frozen(kw_only=True)
class StagedSettings:
    """One request's `PerRow` values on the device, in `RowSettings`' fields' order, for `write_staged`."""

    numbers: torch.Tensor  # (len(_NUMBERS),) long; flags as 0 or 1
    reals: torch.Tensor  # (len(_REALS),) float32
    masks: torch.Tensor  # (len(_MASKS), vocab) bool

    @classmethod
    def allocate(cls, vocab: int, device: torch.device) -> StagedSettings:
        return cls(
            numbers=torch.zeros(len(_NUMBERS), dtype=torch.long, device=device),
            reals=torch.zeros(len(_REALS), dtype=torch.float32, device=device),
            masks=torch.zeros(len(_MASKS), vocab, dtype=torch.bool, device=device),
        )

    def stage(self, values: PerRow) -> None:
        """Copy `values` in: two copies from the host and, where a mask names tokens, one write of them all."""
        vocab = int(self.masks.shape[1])
        numbers = {
            "do_sample": values.do_sample, "pad": values.pad, "ignore": values.repetition_ignore,
            "ngram": values.no_repeat_ngram, "min_length": values.min_length, "min_new_tokens": values.min_new_tokens,
            "prompt_length": values.prompt_length, "bos": values.bos, "bos_at": values.bos_at,
            "forced_eos_at": values.forced_eos_at, "begin_at": values.begin_at,
            "occurrences_from": values.occurrences_from,
            "top_k": vocab if values.top_k is None else min(values.top_k, vocab),
            "top_p_on": values.top_p is not None, "min_p_on": values.min_p is not None,
            "typical_on": values.typical_p is not None, "renormalize": values.renormalize,
        }  # fmt: skip
        reals = {
            "penalty": values.repetition_penalty, "presence": values.presence, "frequency": values.frequency,
            "temperature": values.temperature,
            # transformers compares float32 probabilities with the Python float 1 - top_p: float32 of that double.
            "top_p_cut": 0.0 if values.top_p is None else 1 - values.top_p,
            "min_p": 0.0 if values.min_p is None else values.min_p,
            "typical_p": 1.0 if values.typical_p is None else values.typical_p,
        }  # fmt: skip
        copy_values(self.numbers, [int(numbers[name]) for name in _NUMBERS])
        copy_values(self.reals, [reals[name] for name in _REALS])
        masks = (values.eos, values.forced_eos, values.suppress, values.begin_suppress)
        self.masks.zero_()
        flat = [index * vocab + token for index, ids in enumerate(masks) for token in ids]
        if flat:
            self.masks.view(-1)[device_tensor(flat, device=self.masks.device)] = True
