"""A request's side of the engine: what it asks for, what the engine checks before any work, and how its
`generate` thread hands the prepared request over and waits for the tokens."""

from __future__ import annotations

import copy
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Any

import attrs
import torch
from attrs import define, field
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.utils import ModelOutput

from cachelife.errors import InvalidArgumentError, RequestTimeoutError, UnsupportedGenerationError
from cachelife.generation.arguments import int_field, merged_config, unsupported_argument, unsupported_config
from cachelife.generation.draws import DrawStates
from cachelife.generation.loop_settings import LoopSettings
from cachelife.generation.method import unsupported_criterion, unsupported_prompt, unsupported_window
from cachelife.generation.processors import TensorProcessor, tensor_processors, unsupported_processor
from cachelife.generation.tensor_processors import RepetitionPenalty
from cachelife.serving.model_facts import vocab_size
from cachelife.serving.row_settings import PerRow
from cachelife.serving.rows import unsupported_for_rows

# cachelife.generate's own settings: an engine's are set once, on the engine.
ENGINE_SETTINGS = ("fallback", "steps_per_call", "stop_check_every", "compile_step", "cuda_graphs",
                   "compile_options", "encoder_buckets")  # fmt: skip
_POLL_SECONDS = 0.05


@define(kw_only=True)
class Request:
    number: int
    kwargs: dict[str, Any]
    generator: torch.Generator | None
    timeout: float | None
    future: Future[Any] = field(factory=Future)  # what the caller waits on
    # When it times out (`time.monotonic()` seconds), `timeout` seconds after it was made.
    deadline: float | None = field(init=False)
    released: bool = False  # its place among the engine's held requests given back

    @deadline.default
    def _deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout


@define(kw_only=True)
class Joining:
    """A prepared request, from its `generate`'s thread to the scheduler and back."""

    request: Request
    input_ids: torch.Tensor
    model_kwargs: dict[str, Any]
    config: GenerationConfig
    converted: tuple[TensorProcessor, ...]
    key: tuple[object, ...]
    max_length: int
    generator: torch.Generator | None
    streamer: BaseStreamer | None = None
    beams: int = 1  # num_beams (its input_ids hold one copy of the prompt per beam)
    sequences: int = 1  # hypotheses it returns (num_return_sequences; without beams, one row each)
    pad: int = 0  # the token a finished sequence is padded with, as generate pads it
    padding: int = 0  # pad tokens on the left of its prompt (its attention mask's zeros)
    per_row: PerRow | None = None  # its processors as the per-row pipeline's values, if they are (`row_settings`)
    # Stopping criteria only the host evaluates (`stop_strings`, `max_time`, custom ones), read at each boundary.
    criteria: tuple[StoppingCriteria, ...] = ()
    done: threading.Event = field(factory=threading.Event)
    # Set on every hand-over to the request's thread: new tokens for its streamer, or the end.
    news: threading.Event = field(factory=threading.Event)
    streamed: deque[torch.Tensor] = field(factory=deque)  # new tokens (CPU) its streamer has not had yet
    tokens: torch.Tensor | None = None
    error: BaseException | None = None
    abandoned: bool = False  # its thread stopped waiting (cancelled, timed out, its streamer failed)
    draws: DrawStates = field(factory=DrawStates)  # its generator's state before each draw of its rows' noise

    @property
    def rows(self) -> int:
        """The rows it takes: one per beam, or one per sampled sequence."""
        return self.beams if self.beams > 1 else self.sequences

    @property
    def prompt(self) -> int:
        return int(self.input_ids.shape[1])


def check_request(model: PreTrainedModel, kwargs: dict[str, Any], *, streamed: bool = False) -> GenerationConfig:
    """What is wrong with a request before any work: `InvalidArgumentError` or `UnsupportedGenerationError`;
    `streamed` says that its tokens go to a streamer (a `streamer=` in `kwargs` says so too). Returns the
    generation config `generate` will merge for it."""
    ours = sorted(name for name in ENGINE_SETTINGS if name in kwargs)
    if ours:
        msg = f"{', '.join(ours)} are the engine's settings (Engine(model, ...)), not a request's"
        raise InvalidArgumentError(msg)
    inputs = [(name, value) for name in ("input_ids", "input_features", "inputs_embeds")
              if isinstance(value := kwargs.get(name), torch.Tensor)]  # fmt: skip
    if not inputs:
        msg = "an engine request needs input_ids (or Whisper's input_features) as a tensor, got none"
        raise InvalidArgumentError(msg)
    for name, value in inputs:
        check_prompt_shape(name, value)
    for name in ("input_ids", "decoder_input_ids"):
        if isinstance(value := kwargs.get(name), torch.Tensor):
            check_token_ids(name, value, vocab_size(model))
    rows = int(inputs[0][1].shape[0])
    if rows != 1:
        msg = f"an engine request is one sequence (batch 1), got a batch of {rows}: submit each"
        raise InvalidArgumentError(msg)
    try:
        config = merged_config(model, kwargs)
    except ValueError as error:  # transformers' own checks of the generation settings
        msg = f"an engine request's generation settings are invalid: {error}"
        raise InvalidArgumentError(msg) from error
    if (streamed or kwargs.get("streamer") is not None) and int_field(config, "num_beams") > 1:
        msg = f"a beam search (num_beams={int_field(config, 'num_beams')}) streams no tokens: transformers refuses it"
        raise InvalidArgumentError(msg)
    if (streamed or kwargs.get("streamer") is not None) and int_field(config, "num_return_sequences") > 1:
        sequences = int_field(config, "num_return_sequences")
        msg = f"num_return_sequences={sequences} streams no tokens: a streamer takes one sequence"
        raise InvalidArgumentError(msg)
    feature = (
        unsupported_argument(kwargs)
        or unsupported_config(config)
        or unsupported_by_rows(config)
        or host_stops_with_beams(kwargs, config)
        or whisper_sequences(model, config)
    )
    if feature is not None:
        msg = f"the engine does not decode {feature}; call cachelife.generate for it"
        raise UnsupportedGenerationError(msg)
    return config


def unsupported_by_rows(config: GenerationConfig) -> str | None:
    """What a request's generation config asks that the engine's rows do not decode, named as the user sets it
    (`generate` may set more in the request's thread: Whisper's fallback asks for scores)."""
    if getattr(config, "return_dict_in_generate", False):
        return "return_dict_in_generate=True (scores, logits; Whisper asks for them for its thresholds)"
    if getattr(config, "encoder_no_repeat_ngram_size", None):
        return "encoder_no_repeat_ngram_size (its rule reads one encoder input for the whole batch)"
    if getattr(config, "exponential_decay_length_penalty", None) is not None:
        return "exponential_decay_length_penalty (its rule reads one length for the whole batch)"
    return None


def whisper_sequences(model: PreTrainedModel, config: GenerationConfig) -> str | None:
    """Several sequences of one Whisper request: its `generate` decodes them as a batch of copies of the audio,
    which the engine's one-request rows do not take."""
    sequences = int_field(config, "num_return_sequences")
    if model.config.model_type == "whisper" and sequences > 1:
        return f"num_return_sequences={sequences} for Whisper (its generate decodes them as a batch of the audio)"
    return None


def host_stops_with_beams(kwargs: dict[str, Any], config: GenerationConfig) -> str | None:
    """Stops only the host reads, asked of a beam search (whose rows the host does not look at)."""
    if int_field(config, "num_beams") == 1:
        return None
    asked = [name for name in ("stop_strings", "max_time") if getattr(config, name, None) is not None]
    asked += ["stopping_criteria"] if kwargs.get("stopping_criteria") else []
    return f"{asked[0]} with beam search" if asked else None


def check_prompt_shape(name: str, value: torch.Tensor) -> None:
    """A prompt tensor of the dimensions its name takes (token ids (1, length); features and embeddings (1, n,
    size)), with at least one position."""
    shape = "(1, length)" if name.endswith("input_ids") else "(1, positions, size)"
    if value.dim() != shape.count(",") + 1 or 0 in value.shape:
        msg = f"an engine request's {name} is a tensor of shape {shape}, got shape {tuple(value.shape)}"
        raise InvalidArgumentError(msg)


def check_token_ids(name: str, ids: torch.Tensor, vocab: int) -> None:
    """Token ids of an integer dtype, each in the model's vocabulary."""
    if ids.dtype not in (torch.long, torch.int32):
        msg = f"an engine request's {name} holds token ids as torch.long (or int32), got {ids.dtype}"
        raise InvalidArgumentError(msg)
    check_prompt_shape(name, ids)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        msg = f"an engine request's {name} holds ids from 0 to {vocab - 1} (the model's vocabulary), got {low}..{high}"
        raise InvalidArgumentError(msg)


def own_copy(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The request's arguments with copies of its tensors (also inside lists, tuples and an encoder output) and
    of its generation config: the request is decoded later, and the caller may reuse its own meanwhile."""

    def copied(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, ModelOutput):
            return type(value)(**{name: copied(field) for name, field in value.items()})
        if type(value) in (list, tuple):
            return type(value)(copied(item) for item in value)
        if isinstance(value, GenerationConfig):
            return copy.deepcopy(value)
        return value

    return {name: copied(value) for name, value in kwargs.items()}


def check_timeout(timeout: object) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
        msg = f"timeout must be a positive number of seconds or None, got {timeout!r}"
        raise InvalidArgumentError(msg)


def prepared_processors(
    model: PreTrainedModel, input_ids: torch.Tensor, *, processors: LogitsProcessorList,
    criteria: StoppingCriteriaList, config: GenerationConfig, model_kwargs: dict[str, Any], settings: LoopSettings,
    vocab: int,
) -> tuple[TensorProcessor, ...]:  # fmt: skip
    """The request's processors as the engine's step runs them, or `UnsupportedGenerationError` naming what
    the engine does not decode (what `generate` prepared, read in its thread)."""
    beams = int_field(config, "num_beams")
    rows = beams if beams > 1 else int_field(config, "num_return_sequences")
    reason = unsupported_by_rows(config)
    if reason is None and int(input_ids.shape[0]) != rows:
        reason = f"{int(input_ids.shape[0])} sequences for one request of {rows} row(s) (Whisper's several sequences)"
    reason = (
        reason
        or unsupported_criterion(criteria, config)
        or unsupported_processor(processors)
        or unsupported_prompt(model, model_kwargs)
        or unsupported_window(model, config, settings)
    )
    converted: tuple[TensorProcessor, ...] = ()
    if reason is None:
        converted = processors_for_rows(tensor_processors(processors, vocab_size=vocab, device=model.device))
        reason = unsupported_for_rows(converted, processors)
    if reason is not None:
        msg = f"the engine does not decode {reason}; call cachelife.generate for this request"
        raise UnsupportedGenerationError(msg)
    return converted


def processors_for_rows(converted: tuple[TensorProcessor, ...]) -> tuple[TensorProcessor, ...]:
    """A request's processors as every row of its program runs them: a repetition penalty's padding lengths,
    which `generate` gives once per sequence (beams, sampled sequences), as the one length they all are (an engine
    request is one prompt, expanded), so that they apply to however many rows the program has."""
    return tuple(
        attrs.evolve(processor, ignore=processor.ignore[:1])
        if isinstance(processor, RepetitionPenalty) and processor.ignore is not None
        else processor
        for processor in converted
    )


def wait_for(joining: Joining, lock: threading.Lock, waiting: deque[Joining]) -> torch.Tensor:
    """The tokens the scheduler hands back, each new token put into the request's streamer as it comes and the
    streamer ended after the last; on cancellation, timeout or a failing streamer the request leaves the queue
    (or, at the next step boundary, its row) and its thread raises."""
    request = joining.request
    try:
        while not joining.done.is_set():
            if joining.news.wait(_POLL_SECONDS):
                joining.news.clear()
                _stream(joining)
            expired = request.deadline is not None and time.monotonic() > request.deadline
            if request.future.done():  # cancelled, or failed by its deadline's watch
                raise CancelledError
            if expired:
                msg = f"the request was not served within its timeout of {request.timeout} s"
                raise RequestTimeoutError(msg)
        _stream(joining)
    except BaseException:
        with lock:
            joining.abandoned = True
            if joining in waiting:
                waiting.remove(joining)
        raise
    if joining.error is not None:
        raise joining.error
    if joining.tokens is None:  # unreachable: the scheduler hands back tokens or an error
        msg = "the engine ended the request without tokens"
        raise UnsupportedGenerationError(msg)
    if joining.streamer is not None:
        joining.streamer.end()
    return joining.tokens


def _stream(joining: Joining) -> None:
    """Put the new tokens the scheduler handed over into the streamer, one position at a time (as `_sample`
    puts them: a tensor of one token per sequence)."""
    streamer = joining.streamer
    while joining.streamed:
        chunk = joining.streamed.popleft()
        if streamer is not None:
            for token in chunk:
                streamer.put(token.reshape(1))


def stopped_at(criteria: Sequence[StoppingCriteria], sequence: torch.Tensor, *, after: int) -> int | None:
    """The first length past `after` at which one of `criteria` stops `sequence` (1, n), read position by
    position as `generate` reads them at its steps; None if none does."""
    for position in range(after + 1, sequence.shape[1] + 1):
        if any(bool(criterion(sequence[:, :position], None).any()) for criterion in criteria):
            return position
    return None


def hand_back(joining: Joining, *, tokens: torch.Tensor | None = None, error: BaseException | None = None) -> None:
    """End the request's wait with its tokens, or its error (nothing: it was abandoned)."""
    if tokens is None and error is None:
        error = CancelledError()
    joining.tokens, joining.error = tokens, error
    joining.done.set()
    joining.news.set()


def first_sequence(model_kwargs: dict[str, Any], rows: int) -> dict[str, Any]:
    """`generate`'s prepared inputs for one of its `rows` identical sequences (a beam request's, which
    transformers repeats once per beam): every tensor with `rows` leading entries (and the encoder's output)
    cut to the first."""
    if rows == 1:
        return dict(model_kwargs)

    def first(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            return value[:1]
        if isinstance(value, ModelOutput):  # the encoder's output
            return type(value)(**{name: first(field) for name, field in value.items()})
        return value

    return {name: first(value) for name, value in model_kwargs.items()}


def resolve(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    """Set the future's outcome unless it already has one (cancelled, or failed by its deadline)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
