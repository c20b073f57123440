"""OpenAI's audio endpoints for a Whisper engine, as plain functions: transcriptions and translations.

A multipart form is checked into a `Transcription`; `transcription_kwargs` are one `Engine.generate` call (audio
longer than the model's window is Whisper's long form, which needs its timestamps; the formats with segments ask
for them too); `transcription_body` shapes the answer: `json`, `text`, `verbose_json` (language, duration,
segments with start, end and text), `srt` or `vtt`, from the tokens or from Whisper's segments.
"""

from __future__ import annotations

import email.policy
import io
import wave
from collections.abc import Mapping, Sequence
from email import message_from_bytes
from typing import Any, Final, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch
from attrs import frozen
from transformers import PreTrainedModel

from cachelife.errors import InvalidArgumentError
from cachelife.serving.openai_api import Sampling, Tokenizer, check_fields, number, sampling_kwargs

TRANSCRIPTIONS: Final = "/v1/audio/transcriptions"
TRANSLATIONS: Final = "/v1/audio/translations"
TRANSCRIPTION_FIELDS: Final = (
    "file", "model", "language", "temperature", "response_format", "timestamp_granularities[]",
    "timestamp_granularities",
)  # fmt: skip
RESPONSE_FORMATS: Final = ("json", "text", "verbose_json", "srt", "vtt")
WITH_SEGMENTS: Final = ("verbose_json", "srt", "vtt")
MAX_SECONDS: Final = 1800.0  # the longest audio a request may send: half an hour
SECONDS_PER_TIMESTAMP: Final = 0.02  # Whisper's timestamp tokens count in steps of 20 ms


class FeatureExtractor(Protocol):
    """What serving needs of Whisper's feature extractor: its rate, its window and its call."""

    sampling_rate: int
    n_samples: int

    def __call__(self, raw_speech: npt.NDArray[np.float32], **options: Any) -> Any: ...


@runtime_checkable
class AudioProcessor(Protocol):
    """What serving needs of a Whisper processor: its feature extractor and its tokenizer."""

    @property
    def feature_extractor(self) -> FeatureExtractor: ...
    @property
    def tokenizer(self) -> Tokenizer: ...


@frozen(eq=False, kw_only=True)  # an array has no one truth value
class Transcription:
    """A checked transcription request: mono samples in [-1, 1], the language, the sampling and the format."""

    audio: npt.NDArray[np.float32]
    language: str | None
    sampling: Sampling
    response_format: str
    sampling_rate: int = 16000

    @property
    def duration(self) -> float:
        return float(self.audio.size) / self.sampling_rate


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
        msg = f"file must be a 16-bit PCM WAV file (the one format read); reading it failed: {error}"
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
    """A transcription request's form, checked: `file` (a WAV file of up to `MAX_SECONDS`), `language` (one of
    `languages`, the model's codes), `temperature` (default 0, greedy), `response_format` (default "json") and
    `timestamp_granularities[]` ("segment" alone)."""
    check_fields(fields, TRANSCRIPTION_FIELDS, model_name)
    file = fields.get("file")
    if not isinstance(file, bytes):
        msg = f"file must be an uploaded WAV file (curl -F file=@audio.wav), got {file!r:.80}"
        raise InvalidArgumentError(msg)
    rate = feature_extractor.sampling_rate
    audio = read_wav(file, rate)
    if not 0 < audio.size <= MAX_SECONDS * rate:
        msg = f"file must hold 1 to {int(MAX_SECONDS * rate)} samples ({MAX_SECONDS:g} s), got {audio.size}"
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
    for name in ("timestamp_granularities[]", "timestamp_granularities"):
        if name in fields and fields[name] != "segment":
            msg = f"{name} must be segment (word timestamps are not supported), got {fields[name]!r:.80}"
            raise InvalidArgumentError(msg)
    raw = fields.get("temperature", "0")
    try:
        temperature: object = float(raw)
    except ValueError:
        temperature = raw  # number() says what is wrong with it
    return Transcription(
        audio=audio,
        language=str(language) if language is not None else None,
        sampling=Sampling(number("temperature", temperature, 0, 1)),
        response_format=str(response_format),
        sampling_rate=rate,
    )


def transcription_kwargs(
    transcription: Transcription, processor: AudioProcessor, model: PreTrainedModel
) -> dict[str, Any]:
    """The `generate` arguments of one transcription: features (1, mel bins, frames) in the model's dtype; audio
    longer than the window is Whisper's long form (all its frames, with their mask, and timestamps, which it
    needs); the formats with segments ask for Whisper's timestamps and segments."""
    extractor = processor.feature_extractor
    long_form = transcription.audio.size > extractor.n_samples
    options: dict[str, Any] = {"sampling_rate": extractor.sampling_rate, "return_tensors": "pt"}
    if long_form:
        options |= {"truncation": False, "padding": "longest", "return_attention_mask": True}
    features = extractor(transcription.audio, **options)
    kwargs: dict[str, Any] = {
        "input_features": features["input_features"].to(model.device, model.dtype),
        **sampling_kwargs(transcription.sampling, model.device),
    }
    if long_form:
        kwargs["attention_mask"] = features["attention_mask"].to(model.device)
    if long_form or transcription.response_format in WITH_SEGMENTS:
        kwargs["return_timestamps"] = True
    if transcription.response_format in WITH_SEGMENTS:
        kwargs["return_segments"] = True
    if transcription.language is not None:
        kwargs["language"] = transcription.language
    return kwargs


@frozen(kw_only=True)
class Segment:
    start: float
    end: float
    tokens: tuple[int, ...]
    text: str


def text_of(tokens: Sequence[int], tokenizer: Tokenizer, timestamp_begin: int) -> str:
    """The text of Whisper's tokens: special tokens and timestamps left out."""
    return tokenizer.decode([int(t) for t in tokens if int(t) < timestamp_begin], skip_special_tokens=True).strip()


def segments_of(output: Any, tokenizer: Tokenizer, timestamp_begin: int) -> list[Segment]:
    """Whisper's segments (`return_segments=True`: per window, start and end in seconds and their tokens)."""
    found = []
    for segment in output["segments"][0]:
        tokens = tuple(int(t) for t in segment["tokens"])
        found.append(
            Segment(
                start=float(segment["start"]),
                end=float(segment["end"]),
                tokens=tokens,
                text=text_of(tokens, tokenizer, timestamp_begin),
            )
        )
    return found


def _clock(seconds: float, separator: str) -> str:
    milliseconds = round(seconds * 1000)
    hours, rest = divmod(milliseconds, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    return f"{hours:02d}:{minutes:02d}:{rest // 1000:02d}{separator}{rest % 1000:03d}"


def transcription_body(
    transcription: Transcription, *, text: str, segments: Sequence[Segment], language: str | None, task: str
) -> str | dict[str, Any]:
    """OpenAI's answer in the request's format: {"text"} (json), the text (text), the text with its language,
    duration and segments (verbose_json), or subtitles (srt, vtt)."""
    match transcription.response_format:
        case "text":
            return text
        case "verbose_json":
            shaped = [
                {"id": index, "seek": 0, "start": s.start, "end": s.end, "text": s.text, "tokens": list(s.tokens),
                 "temperature": transcription.sampling.temperature}
                for index, s in enumerate(segments)
            ]  # fmt: skip
            return {"task": task, "language": language, "duration": transcription.duration, "text": text,
                    "segments": shaped}  # fmt: skip
        case "srt":
            cues = [
                f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text}\n" for i, s in enumerate(segments, 1)
            ]
            return "\n".join(cues)
        case "vtt":
            cues = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text}\n" for s in segments]
            return "WEBVTT\n\n" + "\n".join(cues)
        case _:
            return {"text": text}


def language_of(tokens: torch.Tensor | Sequence[int], lang_to_id: Mapping[str, int]) -> str | None:
    """The language whose token Whisper's decoder prompt holds (the one it was given or detected)."""
    codes = {token_id: token[2:-2] for token, token_id in lang_to_id.items()}
    return next((codes[int(t)] for t in tokens if int(t) in codes), None)
