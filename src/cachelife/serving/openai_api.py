"""OpenAI-shaped HTTP requests and answers for an engine, as plain functions (no web framework, no Ray).

A completion's JSON body or a transcription's multipart form is checked into a value (`Completion`,
`Transcription`) whose `*_kwargs` are one `Engine.generate` call; `completion_body` and `transcription_body`
shape the answer from its tokens; `error_answer` answers a failure. `ray_serve` serves them.
"""

from __future__ import annotations

import email.policy
import io
import json
import time
import uuid
import wave
from collections.abc import Mapping, Sequence
from email import message_from_bytes
from typing import Any, Final, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch
from attrs import define, field, frozen
from transformers import PreTrainedModel

from cachelife.errors import (
    EngineClosedError,
    InvalidArgumentError,
    QueueFullError,
    RequestTimeoutError,
    UnsupportedGenerationError,
)
from cachelife.validate import check_int, is_int_at_least

COMPLETIONS: Final = "/v1/completions"
TRANSCRIPTIONS: Final = "/v1/audio/transcriptions"
SEEDS: Final = 2**64
COMPLETION_FIELDS: Final = ("model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stream")
TRANSCRIPTION_FIELDS: Final = ("file", "model", "language", "temperature", "response_format")
RESPONSE_FORMATS: Final = ("json", "text")
# The first entry an error is an instance of gives its HTTP status; anything else is a 500.
STATUS: Final[tuple[tuple[type[BaseException], int], ...]] = (
    (QueueFullError, 503),
    (EngineClosedError, 503),
    (RequestTimeoutError, 504),
    (InvalidArgumentError, 400),
    (UnsupportedGenerationError, 400),
)


@runtime_checkable
class Tokenizer(Protocol):
    """What serving needs of a text model's tokenizer (a transformers tokenizer has it)."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class FeatureExtractor(Protocol):
    """What serving needs of Whisper's feature extractor: its rate, its window and its call."""

    sampling_rate: int
    n_samples: int

    def __call__(self, raw_speech: npt.NDArray[np.float32], *, sampling_rate: int, return_tensors: str) -> Any: ...


@runtime_checkable
class AudioProcessor(Protocol):
    """What serving needs of a Whisper processor: its feature extractor and its tokenizer."""

    @property
    def feature_extractor(self) -> FeatureExtractor: ...
    @property
    def tokenizer(self) -> Tokenizer: ...


@frozen
class Sampling:
    """How tokens are chosen: greedy at temperature 0, else sampled (top-p; seeded when `seed` is given)."""

    temperature: float
    top_p: float = 1.0
    seed: int | None = None


@frozen
class Completion:
    """A checked completion request: the prompt's token ids, the token budget, the sampling, and whether the
    answer streams (server-sent events, a chunk per piece of text)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    stream: bool = False


@frozen(eq=False)  # an array has no one truth value
class Transcription:
    """A checked transcription request: mono samples in [-1, 1], the language, the sampling and the format."""

    audio: npt.NDArray[np.float32]
    language: str | None
    sampling: Sampling
    response_format: str


def _number(name: str, value: object, low: float, high: float) -> float:
    """`value` as a float if it is a number (not a bool) in [low, high]."""
    if isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high:
        return float(value)
    msg = f"{name} must be a number in [{low:g}, {high:g}], got {value!r}"
    raise InvalidArgumentError(msg)


def _check_fields(body: Mapping[str, object], known: Sequence[str], model_name: str) -> None:
    unknown = sorted(set(body) - set(known))
    if unknown:
        msg = f"unsupported fields {unknown!r}: this server reads {', '.join(known)}"
        raise InvalidArgumentError(msg)
    if body.get("model", model_name) != model_name:
        msg = f"model must be {model_name!r} (the model this server runs), got {body['model']!r}"
        raise InvalidArgumentError(msg)


def parse_completion(data: bytes, *, model_name: str, tokenizer: Tokenizer, vocab_size: int) -> Completion:
    """A completion request's JSON body, checked: `prompt` (a string, or a list of token ids), `max_tokens`
    (OpenAI's default 16), `temperature` (default 1; 0 is greedy), `top_p`, `seed` and `stream`."""
    try:
        body = json.loads(data)
    except ValueError as error:
        msg = f"the body must be JSON: {error}"
        raise InvalidArgumentError(msg) from error
    if not isinstance(body, dict):
        msg = f"the body must be a JSON object, got {type(body).__name__}: {body!r:.80}"
        raise InvalidArgumentError(msg)
    _check_fields(body, COMPLETION_FIELDS, model_name)
    prompt = body.get("prompt")
    ids: list[int] = []
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(is_int_at_least(i, 0) and i < vocab_size for i in prompt):
        ids = prompt
    if not ids:
        msg = (
            f"prompt must be a string of at least one token or a non-empty list of token ids in [0, {vocab_size}), "
            f"got {prompt!r:.80}"
        )
        raise InvalidArgumentError(msg)
    seed = body.get("seed")
    if seed is not None and (check_int("seed", seed, minimum=0) >= SEEDS):  # torch's generators take 64 bits
        msg = f"seed must be an int from 0 to 2**64 - 1, got {seed!r}"
        raise InvalidArgumentError(msg)
    sampling = Sampling(
        temperature=_number("temperature", body.get("temperature", 1), 0, 2),
        top_p=_number("top_p", body.get("top_p", 1), 0, 1),
        seed=seed,
    )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        msg = f"stream must be true or false, got {stream!r:.80}"
        raise InvalidArgumentError(msg)
    return Completion(tuple(ids), check_int("max_tokens", body.get("max_tokens", 16)), sampling, stream)


def sampling_kwargs(sampling: Sampling, device: torch.device) -> dict[str, Any]:
    """`generate`'s sampling arguments: `do_sample=False` at temperature 0; else temperature, top-p and, for a
    seed, a `torch.Generator` on the model's device seeded with it."""
    if sampling.temperature == 0:
        return {"do_sample": False}
    kwargs: dict[str, Any] = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p}
    if sampling.seed is not None:
        kwargs["generator"] = torch.Generator(device=device).manual_seed(sampling.seed)
    return kwargs


def completion_kwargs(completion: Completion, device: torch.device) -> dict[str, Any]:
    """The `generate` arguments of one completion (batch 1) on `device`."""
    ids = torch.tensor([completion.prompt_ids], dtype=torch.long, device=device)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "max_new_tokens": completion.max_tokens,
        **sampling_kwargs(completion.sampling, device),
    }


def completion_body(
    tokens: torch.Tensor,
    completion: Completion,
    *,
    model_name: str,
    tokenizer: Tokenizer,
    end_ids: frozenset[int],
    generated_from: int,
) -> dict[str, Any]:
    """OpenAI's completion object for `generate`'s tokens (1, n), whose new tokens start at `generated_from`
    (the prompt's length for a decoder-only model, 1 after an encoder-decoder's start token)."""
    generated = [int(t) for t in tokens[0, generated_from:]]
    finish = finish_reason(generated, completion.max_tokens, end_ids)
    prompt_tokens = len(completion.prompt_ids)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [
            {"index": 0, "text": tokenizer.decode(generated, skip_special_tokens=True), "finish_reason": finish}
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(generated),
            "total_tokens": prompt_tokens + len(generated),
        },
    }


def finish_reason(generated: Sequence[int], max_tokens: int, end_ids: frozenset[int]) -> str:
    """OpenAI's reason a completion ended: "length" when it used its budget without an end token, else "stop"."""
    ended = bool(generated) and generated[-1] in end_ids
    return "length" if len(generated) >= max_tokens and not ended else "stop"


@define
class TextDeltas:
    """A completion's text as it grows, token by token: each call to `add` returns the text not handed out yet.
    Every token is decoded with those before it (a tokenizer may write a token otherwise next to others), and
    text that ends in an unfinished character (U+FFFD, bytes the next token completes) is held back."""

    tokenizer: Tokenizer
    ids: list[int] = field(factory=list)
    sent: int = 0  # characters handed out so far

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[self.sent :], len(text)
        return delta


def completion_chunk(
    text: str, *, completion_id: str, created: int, model_name: str, finish: str | None = None
) -> dict[str, Any]:
    """One chunk of a streamed completion, as OpenAI's server-sent events carry it."""
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model_name,
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
    }


def server_sent_event(data: Mapping[str, Any] | str) -> str:
    """One server-sent event: a JSON object, or a bare string such as OpenAI's closing "[DONE]"."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def form_fields(content_type: str, body: bytes) -> dict[str, str | bytes]:
    """A multipart/form-data body's fields: files as bytes, other fields as text."""
    if not content_type.startswith("multipart/form-data"):
        msg = f"the body must be multipart/form-data (curl -F file=@audio.wav), got Content-Type {content_type!r}"
        raise InvalidArgumentError(msg)
    message = message_from_bytes(f"Content-Type: {content_type}\r\n\r\n".encode() + body, policy=email.policy.HTTP)
    fields: dict[str, str | bytes] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if isinstance(name, str) and isinstance(payload, bytes):
            fields[name] = payload if part.get_filename() is not None else payload.decode()
    return fields


def read_wav(data: bytes, sampling_rate: int) -> npt.NDArray[np.float32]:
    """A 16-bit PCM mono WAV file at `sampling_rate`, as float32 samples in [-1, 1]."""
    try:
        with wave.open(io.BytesIO(data)) as audio:
            shape = (audio.getsampwidth() * 8, audio.getnchannels(), audio.getframerate())
            frames = audio.readframes(audio.getnframes())
    except (wave.Error, EOFError) as error:
        msg = f"file must be a 16-bit PCM WAV file; reading it failed: {error}"
        raise InvalidArgumentError(msg) from error
    if shape != (16, 1, sampling_rate):
        msg = (
            f"file must be 16-bit mono WAV at {sampling_rate} Hz, got {shape[0]}-bit, {shape[1]} channels at "
            f"{shape[2]} Hz: convert it with `ffmpeg -i in.wav -ac 1 -ar {sampling_rate} -sample_fmt s16 out.wav`"
        )
        raise InvalidArgumentError(msg)
    return (np.frombuffer(frames, dtype="<i2") / 32768).astype(np.float32)


def parse_transcription(
    fields: Mapping[str, str | bytes],
    *,
    model_name: str,
    feature_extractor: FeatureExtractor,
    languages: Sequence[str],
) -> Transcription:
    """A transcription request's form, checked: `file` (a WAV file no longer than the model's window),
    `language` (one of `languages`, the model's codes), `temperature` (default 0, greedy) and `response_format`
    ("json" or "text")."""
    _check_fields(fields, TRANSCRIPTION_FIELDS, model_name)
    file = fields.get("file")
    if not isinstance(file, bytes):
        msg = f"file must be an uploaded WAV file (curl -F file=@audio.wav), got {file!r:.80}"
        raise InvalidArgumentError(msg)
    audio = read_wav(file, feature_extractor.sampling_rate)
    if not 0 < audio.size <= feature_extractor.n_samples:
        seconds = feature_extractor.n_samples / feature_extractor.sampling_rate
        msg = f"file must hold 1 to {feature_extractor.n_samples} samples ({seconds:g} s), got {audio.size}"
        raise InvalidArgumentError(msg)
    language = fields.get("language") or None
    if language is not None and language not in languages:
        known = f"one of {', '.join(languages)}" if languages else "left out: this model has no language tokens"
        msg = f"language must be {known}, got {language!r}"
        raise InvalidArgumentError(msg)
    response_format = fields.get("response_format", "json")
    if response_format not in RESPONSE_FORMATS:
        msg = f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {response_format!r}"
        raise InvalidArgumentError(msg)
    raw = fields.get("temperature", "0")
    try:
        temperature: object = float(raw)
    except ValueError:
        temperature = raw  # _number says what is wrong with it
    return Transcription(
        audio,
        str(language) if language is not None else None,
        Sampling(_number("temperature", temperature, 0, 1)),
        str(response_format),
    )


def transcription_kwargs(
    transcription: Transcription, processor: AudioProcessor, model: PreTrainedModel
) -> dict[str, Any]:
    """The `generate` arguments of one transcription: features (1, mel bins, frames) in the model's dtype."""
    extractor = processor.feature_extractor
    features = extractor(transcription.audio, sampling_rate=extractor.sampling_rate, return_tensors="pt")
    kwargs: dict[str, Any] = {
        "input_features": features["input_features"].to(model.device, model.dtype),
        **sampling_kwargs(transcription.sampling, model.device),
    }
    if transcription.language is not None:
        kwargs["language"] = transcription.language
    return kwargs


def transcription_body(text: str, response_format: str) -> str | dict[str, str]:
    """OpenAI's transcription answer: {"text": ...} for JSON, or the text alone."""
    return text if response_format == "text" else {"text": text}


def error_body(message: str, kind: str) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def error_answer(error: BaseException) -> tuple[int, dict[str, Any]]:
    """A failed request's HTTP status (400 for a bad request, 503 when full or closed, 504 on timeout, else 500)
    and OpenAI's error object."""
    status = next((status for kind, status in STATUS if isinstance(error, kind)), 500)
    return status, error_body(str(error), "invalid_request_error" if status == 400 else type(error).__name__)
