"""OpenAI-shaped HTTP requests and answers for an engine, as plain functions (no web framework, no Ray).

What every endpoint shares: the sampling, field checks, errors in OpenAI's shape, server-sent events and the
model list. The text endpoints are `openai_text`'s, the audio ones `openai_audio`'s; `ray_serve` serves them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol, runtime_checkable

import torch
from attrs import frozen

from cachelife.errors import (
    EngineClosedError,
    InvalidArgumentError,
    QueueFullError,
    RequestTimeoutError,
    UnsupportedGenerationError,
)

MODELS: Final = "/v1/models"
HEALTH: Final = "/health"
SEEDS: Final = 2**64
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


@frozen
class Sampling:
    """How tokens are chosen: greedy at temperature 0, else sampled (top-p; seeded when `seed` is given)."""

    temperature: float
    top_p: float = 1.0
    seed: int | None = None


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
