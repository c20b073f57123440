"""OpenAI-shaped HTTP requests and answers for an engine, as plain functions (no web framework, no Ray).

What every endpoint shares (the sampling, field checks, errors in OpenAI's shape, server-sent events, the model
list) and the transcription endpoint: a multipart form is checked into a `Transcription` whose
`transcription_kwargs` are one `Engine.generate` call, and `transcription_body` shapes the answer. The text
endpoints are `openai_text`'s; `ray_serve` serves them all.
"""

from __future__ import annotations

import email.policy
import io
import json
import wave
from collections.abc import Mapping, Sequence
from email import message_from_bytes
from typing import Any, Final, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch
from attrs import frozen
from transformers import PreTrainedModel

from cachelife.errors import (
    EngineClosedError,
    InvalidArgumentError,
    QueueFullError,
    RequestTimeoutError,
    UnsupportedGenerationError,
)

TRANSCRIPTIONS: Final = "/v1/audio/transcriptions"
TRANSLATIONS: Final = "/v1/audio/translations"
MODELS: Final = "/v1/models"
HEALTH: Final = "/health"
SEEDS: Final = 2**64
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


@frozen(eq=False)  # an array has no one truth value
class Transcription:
    """A checked transcription request: mono samples in [-1, 1], the language, the sampling and the format."""

    audio: npt.NDArray[np.float32]
    language: str | None
    sampling: Sampling
    response_format: str


def number(name: str, value: object, low: float, high: float) -> float:
    """`value` as a float if it is a number (not a bool) in [low, high]."""
    if isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high:
        return float(value)
    msg = f"{name} must be a number in [{low:g}, {high:g}], got {value!r}"
    raise InvalidArgumentError(msg)


def check_fields(body: Mapping[str, object], known: Sequence[str], model_name: str) -> None:
    unknown = sorted(set(body) - set(known))
    if unknown:
        msg = f"unsupported fields {unknown!r}: this server reads {', '.join(known)}"
        raise InvalidArgumentError(msg)
    if body.get("model", model_name) != model_name:
        msg = f"model must be {model_name!r} (the model this server runs), got {body['model']!r}"
        raise InvalidArgumentError(msg)


def sampling_kwargs(sampling: Sampling, device: torch.device) -> dict[str, Any]:
    """`generate`'s sampling arguments: `do_sample=False` at temperature 0; else temperature, top-p and, for a
    seed, a `torch.Generator` on the model's device seeded with it."""
    if sampling.temperature == 0:
        return {"do_sample": False}
    kwargs: dict[str, Any] = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p}
    if sampling.seed is not None:
        kwargs["generator"] = torch.Generator(device=device).manual_seed(sampling.seed)
    return kwargs


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
    check_fields(fields, TRANSCRIPTION_FIELDS, model_name)
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
        Sampling(number("temperature", temperature, 0, 1)),
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


def models_body(model_name: str) -> dict[str, Any]:
    """OpenAI's model list: the one model this server runs."""
    model = {"id": model_name, "object": "model", "created": 0, "owned_by": "cachelife"}
    return {"object": "list", "data": [model]}


def error_body(message: str, kind: str) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def error_answer(error: BaseException) -> tuple[int, dict[str, Any]]:
    """A failed request's HTTP status (400 for a bad request, 503 when full or closed, 504 on timeout, else 500)
    and OpenAI's error object."""
    status = next((status for kind, status in STATUS if isinstance(error, kind)), 500)
    return status, error_body(str(error), "invalid_request_error" if status == 400 else type(error).__name__)
