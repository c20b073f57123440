"""A Ray Serve application of one model's `Engine`, answering OpenAI-shaped HTTP requests (the `serve` extra).

`application(factory, name=...)` builds it: each replica calls `factory()` for the model and its tokenizer (a
text model: `POST /v1/completions` and `POST /v1/chat/completions`, streamed as server-sent events with
`"stream": true`) or its processor (Whisper: `POST /v1/audio/transcriptions` and, where the model translates,
`/v1/audio/translations`), with `GET /v1/models` and `GET /health` beside, and serves them through one `Engine`;
`openai_api` and `openai_text` read the requests and shape the answers. Nothing else in cachelife imports
this module, so cachelife imports without Ray.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any

import numpy as np
from ray import serve
from ray.serve import Application
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from transformers import PreTrainedModel

from cachelife.errors import InvalidArgumentError
from cachelife.serving.engine import Engine
from cachelife.serving.openai_api import (
    HEALTH,
    MODELS,
    Tokenizer,
    error_answer,
    error_body,
    models_body,
    server_sent_event,
)
from cachelife.serving.openai_audio import (
    TRANSCRIPTIONS,
    TRANSLATIONS,
    AudioProcessor,
    form_fields,
    language_of,
    parse_transcription,
    segments_of,
    text_of,
    transcription_body,
    transcription_kwargs,
)
from cachelife.serving.openai_logprobs import token_logprobs
from cachelife.serving.openai_text import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    Answer,
    Completion,
    TextDeltas,
    answer_body,
    completion_kwargs,
    finish_reason,
    parse_chat,
    parse_completion,
    role_chunk,
    text_chunk,
    usage_chunk,
)
from cachelife.validate import check_int

logger = logging.getLogger(__name__)

# A picklable callable that each replica calls once: the model (on the device it should run on) and its
# tokenizer, or for Whisper its processor.
Factory = Callable[[], tuple[PreTrainedModel, Tokenizer | AudioProcessor]]


class Replica:
    """One Serve replica: the factory's model and tokenizer or processor, one `Engine`, OpenAI's endpoints."""

    def __init__(
        self, factory: Factory, model_name: str, engine_options: Mapping[str, Any], warm_up: bool = True
    ) -> None:
        model, helper = factory()
        self._model, self._name = model, model_name
        self._routes: dict[tuple[str, str], Callable[[Request], Awaitable[Response]]] = {
            ("GET", MODELS): self._models,
            ("GET", HEALTH): self._health,
        }
        if model.main_input_name == "input_features":
            if not isinstance(helper, AudioProcessor):
                msg = f"the factory of {model_name!r} must return a processor with feature_extractor and tokenizer"
                raise InvalidArgumentError(msg)
            # Whisper's language tokens, "<|en|>": OpenAI's API names a language by its code.
            languages = tuple(token[2:-2] for token in getattr(model.generation_config, "lang_to_id", None) or ())
            tasks = getattr(model.generation_config, "task_to_id", None) or {}
            for path, task in ((TRANSCRIPTIONS, "transcribe"), (TRANSLATIONS, "translate")):
                if task in tasks or path == TRANSCRIPTIONS:
                    self._routes["POST", path] = functools.partial(self._transcribe, helper, languages, task)
        else:
            if not isinstance(helper, Tokenizer):
                msg = f"the factory of {model_name!r} must return a tokenizer with encode and decode"
                raise InvalidArgumentError(msg)
            vocab = int(model.config.vocab_size)
            parsers: dict[str, Callable[[bytes], Completion]] = {
                COMPLETIONS: functools.partial(
                    parse_completion, model_name=model_name, tokenizer=helper, vocab_size=vocab
                ),
                CHAT_COMPLETIONS: functools.partial(parse_chat, model_name=model_name, tokenizer=helper),
            }
            for path, parse in parsers.items():
                self._routes["POST", path] = functools.partial(self._text, helper, parse)
        end = model.generation_config.eos_token_id
        self._end_ids = frozenset([end] if isinstance(end, int) else end or ())
        self._engine = Engine(model, **engine_options)
        if warm_up and isinstance(helper, AudioProcessor):
            self._warm_up_audio(model, helper)
        elif warm_up:
            self._warm_up(model, helper, parsers[COMPLETIONS], engine_options)
        logger.info("serving %s on %s at %s", model_name, model.device, ", ".join(p for _, p in self._routes))

    def _warm_up(self, model: PreTrainedModel, tokenizer: Any, parse: Callable[[bytes], Completion],
                 engine_options: Mapping[str, Any]) -> None:  # fmt: skip
        """Compile what completions need before the replica takes traffic (`Engine.warm_up`): a greedy and a
        sampled completion of a short prompt as examples."""
        max_length = engine_options.get("max_length", inspect.signature(Engine).parameters["max_length"].default)
        prompt = [token % int(model.config.vocab_size) for token in range(3, 3 + max(1, min(16, max_length // 4)))]
        for temperature in (0, 1):
            body = {"model": self._name, "prompt": prompt, "max_tokens": 2, "temperature": temperature}
            self._engine.warm_up(**completion_kwargs(parse(json.dumps(body).encode()), model.device, tokenizer))

    def _warm_up_audio(self, model: PreTrainedModel, processor: AudioProcessor) -> None:
        """Compile what transcriptions need before the replica takes traffic (`Engine.warm_up`): a greedy
        transcription of a second of silence as the example."""
        extractor = processor.feature_extractor
        silence = np.zeros(int(extractor.sampling_rate), dtype=np.float32)
        features = extractor(silence, sampling_rate=extractor.sampling_rate, return_tensors="pt")["input_features"]
        self._engine.warm_up(input_features=features.to(model.device, model.dtype), do_sample=False, task="transcribe")

    async def __call__(self, request: Request) -> Response:
        path = request.url.path.removeprefix(request.scope.get("root_path", "")) or "/"
        answer = self._routes.get((request.method, path))
        if answer is None:
            routes = ", ".join(f"{method} {route}" for method, route in self._routes)
            msg = f"this server answers {routes}; got {request.method} {path}"
            known = any(route == path for _, route in self._routes)
            return JSONResponse(error_body(msg, "not_found"), 405 if known else 404)
        try:
            return await answer(request)
        except Exception as error:  # every failure is this request's answer; the replica goes on
            status, body = error_answer(error)
            if status == 500:
                logger.exception("request to %s failed", path)
            return JSONResponse(body, status)

    async def _models(self, request: Request) -> Response:
        return JSONResponse(models_body(self._name))

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self._name, **{"held": self._engine.stats().held}})

    async def _text(self, tokenizer: Tokenizer, parse: Callable[[bytes], Completion], request: Request) -> Response:
        completion = parse(await request.body())
        answer = Answer(model_name=self._name, tokenizer=tokenizer, end_ids=self._end_ids)
        device = self._model.device
        arguments = [completion_kwargs(completion, device, tokenizer, index) for index in range(completion.n)]
        if completion.stream:
            streams = [self._engine.stream(**kwargs) for kwargs in arguments]
            # A failure before the first tokens (a full queue, a bad request) is an answer with its status.
            firsts = await asyncio.gather(*(anext(stream, None) for stream in streams), return_exceptions=True)
            failed = [first for first in firsts if isinstance(first, BaseException)]
            if failed:
                await asyncio.gather(*(stream.aclose() for stream in streams), return_exceptions=True)
                raise failed[0]
            events = _events(streams, [f for f in firsts if not isinstance(f, BaseException)], completion, answer)
            return StreamingResponse(events, media_type="text/event-stream")
        encoder_decoder = bool(self._model.config.is_encoder_decoder)
        if encoder_decoder and completion.logprobs is not None:
            msg = "logprobs are served for decoder-only models (one forward over the prompt and the new tokens)"
            raise InvalidArgumentError(msg)
        outputs = await _all([self._engine.generate(**kwargs) for kwargs in arguments])
        start = 1 if encoder_decoder else len(completion.prompt_ids)
        choices = [[int(token) for token in output[0, start:]] for output in outputs]
        logprobs = None
        if completion.logprobs is not None:
            top, prompt = completion.logprobs, completion.prompt_ids
            logprobs = [await asyncio.to_thread(token_logprobs, self._model, prompt, choice, top=top)
                        for choice in choices]  # fmt: skip
        return JSONResponse(answer_body(choices, completion, answer, logprobs))

    async def _transcribe(
        self, processor: AudioProcessor, languages: Sequence[str], task: str, request: Request
    ) -> Response:
        fields = form_fields(request.headers.get("content-type", ""), await request.body())
        extractor = processor.feature_extractor
        transcription = parse_transcription(
            fields, model_name=self._name, feature_extractor=extractor, languages=languages
        )
        kwargs = transcription_kwargs(transcription, processor, self._model)
        output = await self._engine.generate(**kwargs, task=task)
        config = self._model.generation_config
        timestamp_begin = int(getattr(config, "no_timestamps_token_id", 0) or 0) + 1
        tokens = output["sequences"] if isinstance(output, dict) else output
        segments = segments_of(output, processor.tokenizer, timestamp_begin) if isinstance(output, dict) else []
        language = transcription.language
        if language is None and isinstance(output, dict) and output["segments"][0]:
            language = language_of(output["segments"][0][0]["result"], getattr(config, "lang_to_id", None) or {})
        body = transcription_body(
            transcription, text=text_of(tokens[0].tolist(), processor.tokenizer, timestamp_begin), segments=segments,
            language=language, task="transcribe" if task == "transcribe" else "translate",
        )  # fmt: skip
        return PlainTextResponse(body) if isinstance(body, str) else JSONResponse(body)

    def __del__(self) -> None:
        # Serve calls this when it stops the replica: requests still queued fail with EngineClosedError.
        if hasattr(self, "_engine"):
            self._engine.close()


async def _all(requests: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Every request's result; the first failure cancels the others and is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(request) for request in requests]
    except BaseExceptionGroup as failures:
        raise failures.exceptions[0] from None
    return [task.result() for task in tasks]


async def _events(
    streams: list[AsyncGenerator[int, None]], firsts: list[int | None], completion: Completion, answer: Answer
) -> AsyncGenerator[str, None]:
    """A streamed answer as OpenAI's server-sent events: for each choice (a chat's opened by the assistant's
    role) a chunk per new piece of text and a last chunk with its finish reason, in the order they come; with
    `include_usage` a usage chunk; then "[DONE]". A failure after the first tokens is the stream's last event,
    OpenAI's error object. A client that goes away closes this generator, which cancels the requests."""
    queue: asyncio.Queue[tuple[int, int | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[int, None], first: int | None) -> None:
        try:
            token = first
            while token is not None:
                await queue.put((index, token))
                token = await anext(stream, None)
            await queue.put((index, None))
        except Exception as error:  # handed to the stream's reader
            await queue.put((index, error))

    pumps = [
        asyncio.create_task(pump(i, stream, first))
        for i, (stream, first) in enumerate(zip(streams, firsts, strict=True))
    ]
    deltas = [TextDeltas(tokenizer=answer.tokenizer, stops=completion.stop) for _ in streams]
    generated: list[list[int]] = [[] for _ in streams]
    try:
        if completion.chat:
            for index in range(len(streams)):
                yield server_sent_event(role_chunk(answer, completion, index))
        for _ in range(len(streams)):
            while True:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    break
                generated[index].append(item)
                if text := deltas[index].add(item):
                    yield server_sent_event(text_chunk(answer, completion, index, text, None))
            rest, stopped = deltas[index].rest(), deltas[index].stopped
            finish = finish_reason(generated[index], completion.max_tokens, answer.end_ids, stopped=stopped)
            yield server_sent_event(text_chunk(answer, completion, index, rest, finish))
        if completion.include_usage:
            yield server_sent_event(usage_chunk(answer, completion, sum(len(tokens) for tokens in generated)))
    except Exception as error:  # the status is sent already: the error is the stream's last event
        logger.exception("a streamed answer failed after %d tokens", sum(len(tokens) for tokens in generated))
        yield server_sent_event(error_answer(error)[1])
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*(stream.aclose() for stream in streams), return_exceptions=True)
    yield server_sent_event("[DONE]")


def application(
    factory: Factory,
    *,
    name: str,
    num_gpus: float = 0,
    num_replicas: int = 1,
    autoscaling_config: Mapping[str, Any] | None = None,
    warm_up: bool = True,
    **engine_options: Any,
) -> Application:
    """A Serve application of the model `factory()` builds, named `name`; `serve.run(application(...))` serves it.

    Each replica builds its own model and one `Engine(model, **engine_options)` (`rows`, `max_length`,
    `queue_size`, `compile_step`, ...), and takes as many requests at once as that engine holds (`rows +
    queue_size`). `num_gpus=1` gives each replica a GPU of its own (the factory then puts the model on "cuda").
    `num_replicas` replicas, or with `autoscaling_config` (Serve's: `min_replicas`, `max_replicas`,
    `target_ongoing_requests`, ...) as many as the load asks for. With `warm_up` each replica runs examples
    through `Engine.warm_up` before it takes traffic (a text model's a greedy and a sampled completion, Whisper's
    a greedy transcription of silence), so that the first requests do not wait for compilations.
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
    return serve.deployment(**options)(Replica).bind(factory, name, engine_options, warm_up)
