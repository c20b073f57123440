"""A Ray Serve application of one model's `Engine`, answering OpenAI-shaped HTTP requests (the `serve` extra).

`application(factory, name=...)` builds it: each replica calls `factory()` for the model and its tokenizer (a
text model: `POST /v1/completions`, streamed as server-sent events with `"stream": true`) or its processor
(Whisper: `POST /v1/audio/transcriptions`) and serves them through one `Engine`; `openai_api` reads the
requests and shapes the answers. Nothing else in cachelife imports this module, so cachelife imports without
Ray.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from ray import serve
from ray.serve import Application
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from transformers import PreTrainedModel

from cachelife.errors import InvalidArgumentError
from cachelife.serving.engine import Engine
from cachelife.serving.openai_api import (
    COMPLETIONS,
    TRANSCRIPTIONS,
    AudioProcessor,
    Completion,
    TextDeltas,
    Tokenizer,
    completion_body,
    completion_chunk,
    completion_kwargs,
    error_answer,
    error_body,
    finish_reason,
    form_fields,
    parse_completion,
    parse_transcription,
    server_sent_event,
    transcription_body,
    transcription_kwargs,
)
from cachelife.validate import check_int

logger = logging.getLogger(__name__)

# A picklable callable that each replica calls once: the model (on the device it should run on) and its
# tokenizer, or for Whisper its processor.
Factory = Callable[[], tuple[PreTrainedModel, Tokenizer | AudioProcessor]]


class Replica:
    """One Serve replica: the factory's model and tokenizer or processor, one `Engine`, one HTTP endpoint."""

    def __init__(self, factory: Factory, model_name: str, engine_options: Mapping[str, Any]) -> None:
        model, helper = factory()
        self._model, self._name = model, model_name
        self._answer: Callable[[Request], Awaitable[Response]]
        if model.main_input_name == "input_features":
            if not isinstance(helper, AudioProcessor):
                msg = f"the factory of {model_name!r} must return a processor with feature_extractor and tokenizer"
                raise InvalidArgumentError(msg)
            # Whisper's language tokens, "<|en|>": OpenAI's API names a language by its code.
            languages = tuple(token[2:-2] for token in getattr(model.generation_config, "lang_to_id", None) or ())
            self._path, self._answer = TRANSCRIPTIONS, functools.partial(self._transcribe, helper, languages)
        else:
            if not isinstance(helper, Tokenizer):
                msg = f"the factory of {model_name!r} must return a tokenizer with encode and decode"
                raise InvalidArgumentError(msg)
            self._path, self._answer = COMPLETIONS, functools.partial(self._complete, helper)
        self._engine = Engine(model, **engine_options)
        logger.info("serving %s on %s at %s", model_name, model.device, self._path)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path.removeprefix(request.scope.get("root_path", "")) or "/"
        if path != self._path or request.method != "POST":
            msg = f"this server answers POST {self._path}, got {request.method} {path}"
            return JSONResponse(error_body(msg, "not_found"), 404 if path != self._path else 405)
        try:
            return await self._answer(request)
        except Exception as error:  # every failure is this request's answer; the replica goes on
            status, body = error_answer(error)
            if status == 500:
                logger.exception("request to %s failed", self._path)
            return JSONResponse(body, status)

    async def _complete(self, tokenizer: Tokenizer, request: Request) -> Response:
        model, data = self._model, await request.body()
        completion = parse_completion(
            data, model_name=self._name, tokenizer=tokenizer, vocab_size=int(model.config.vocab_size)
        )
        end = model.generation_config.eos_token_id
        end_ids = frozenset([end] if isinstance(end, int) else end or ())
        kwargs = completion_kwargs(completion, model.device)
        if completion.stream:
            tokens = self._engine.stream(**kwargs)
            # A failure before the first token (a full queue, a bad request) is an answer with its status.
            first = await anext(tokens, None)
            events = _events(tokens, first, completion, model_name=self._name, tokenizer=tokenizer, end_ids=end_ids)
            return StreamingResponse(events, media_type="text/event-stream")
        generated = await self._engine.generate(**kwargs)
        return JSONResponse(
            completion_body(
                generated,
                completion,
                model_name=self._name,
                tokenizer=tokenizer,
                end_ids=end_ids,
                generated_from=1 if model.config.is_encoder_decoder else len(completion.prompt_ids),
            )
        )

    async def _transcribe(self, processor: AudioProcessor, languages: Sequence[str], request: Request) -> Response:
        fields = form_fields(request.headers.get("content-type", ""), await request.body())
        extractor = processor.feature_extractor
        transcription = parse_transcription(
            fields, model_name=self._name, feature_extractor=extractor, languages=languages
        )
        tokens = await self._engine.generate(**transcription_kwargs(transcription, processor, self._model))
        text = processor.tokenizer.decode([int(t) for t in tokens[0]], skip_special_tokens=True)
        body = transcription_body(text, transcription.response_format)
        return PlainTextResponse(body) if isinstance(body, str) else JSONResponse(body)

    def __del__(self) -> None:
        # Serve calls this when it stops the replica: requests still queued fail with EngineClosedError.
        if hasattr(self, "_engine"):
            self._engine.close()


async def _events(
    tokens: AsyncGenerator[int, None], first: int | None, completion: Completion, *, model_name: str,
    tokenizer: Tokenizer, end_ids: frozenset[int],
) -> AsyncGenerator[str, None]:  # fmt: skip
    """A streamed completion as OpenAI's server-sent events: a chunk per new piece of text, a last chunk with
    the finish reason (or, for a failure after the first token, OpenAI's error object), then "[DONE]". A client
    that goes away closes this generator, which cancels the request."""
    chunk = functools.partial(
        completion_chunk, completion_id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model_name=model_name
    )
    deltas, generated, token = TextDeltas(tokenizer), [], first
    try:
        while token is not None:
            generated.append(token)
            if text := deltas.add(token):
                yield server_sent_event(chunk(text))
            token = await anext(tokens, None)
        yield server_sent_event(chunk("", finish=finish_reason(generated, completion.max_tokens, end_ids)))
    except Exception as error:  # the status is sent already: the error is the stream's last event
        logger.exception("a streamed completion failed after %d tokens", len(generated))
        yield server_sent_event(error_answer(error)[1])
    finally:
        await tokens.aclose()
    yield server_sent_event("[DONE]")


def application(
    factory: Factory,
    *,
    name: str,
    num_gpus: float = 0,
    num_replicas: int = 1,
    autoscaling_config: Mapping[str, Any] | None = None,
    **engine_options: Any,
) -> Application:
    """A Serve application of the model `factory()` builds, named `name`; `serve.run(application(...))` serves it.

    Each replica builds its own model and one `Engine(model, **engine_options)` (`rows`, `max_length`,
    `queue_size`, `compile_step`, ...), and takes as many requests at once as that engine holds (`rows +
    queue_size`). `num_gpus=1` gives each replica a GPU of its own (the factory then puts the model on "cuda").
    `num_replicas` replicas, or with `autoscaling_config` (Serve's: `min_replicas`, `max_replicas`,
    `target_ongoing_requests`, ...) as many as the load asks for.
    """
    defaults = inspect.signature(Engine).parameters
    rows, queue_size = (engine_options.get(key, defaults[key].default) for key in ("rows", "queue_size"))
    options: dict[str, Any] = {
        "name": name,
        "ray_actor_options": {"num_gpus": num_gpus},
        "max_ongoing_requests": check_int("rows", rows) + check_int("queue_size", queue_size, minimum=0),
    }
    if autoscaling_config is None:
        options["num_replicas"] = check_int("num_replicas", num_replicas)
    else:
        options["autoscaling_config"] = dict(autoscaling_config)
    return serve.deployment(**options)(Replica).bind(factory, name, engine_options)
