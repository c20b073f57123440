"""OpenAI's text endpoints for an engine, as plain functions: `/v1/completions` and `/v1/chat/completions`.

A request's JSON body is checked into a `Completion` (a chat's messages become its prompt through the
tokenizer's chat template); `completion_kwargs(completion, index)` is one `Engine.generate` call per choice
(`n` of them, choice i seeded with `seed + i`); `answer_body` shapes the answer from the choices' tokens and
the chunk functions the streamed one. Stops (`stop`) are the engine's `stop_strings`: the returned text ends
before the stop, as OpenAI's does; the presence and frequency penalties are cachelife's `OccurrencePenalty`.
What OpenAI's API has and this server does not decode is refused with a 400 naming it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch
from attrs import define, field, frozen
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StopStringCriteria

from cachelife.errors import InvalidArgumentError
from cachelife.generation.penalties import OccurrencePenalty
from cachelife.serving.openai_api import SEEDS, Sampling, Tokenizer, check_fields, number, sampling_kwargs
from cachelife.serving.openai_logprobs import TokenLogprob, logprobs_body
from cachelife.validate import check_int, is_int_at_least

COMPLETIONS: Final = "/v1/completions"
CHAT_COMPLETIONS: Final = "/v1/chat/completions"
# Read on both endpoints.
COMMON_FIELDS: Final = (
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stream", "stream_options",
    "stop", "n", "user", "presence_penalty", "frequency_penalty", "logprobs",
)  # fmt: skip
COMPLETION_FIELDS: Final = (*COMMON_FIELDS, "prompt")
CHAT_FIELDS: Final = (*COMMON_FIELDS, "messages", "top_logprobs")
ROLES: Final = ("system", "developer", "user", "assistant")
MAX_STOPS: Final = 4
MAX_CHOICES: Final = 16
MAX_COMPLETION_LOGPROBS: Final = 5
MAX_CHAT_LOGPROBS: Final = 20


@frozen(kw_only=True)
class Completion:
    """A checked text request: the prompt's token ids, the token budget per choice, the sampling, the stops,
    how many choices, whether the answer streams (and ends with a usage chunk), and whether it is a chat."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    logprobs: int | None = None  # alternatives per token with its log-probability (None: no log-probabilities)
    stream: bool = False
    include_usage: bool = False
    chat: bool = False


def _body(data: bytes) -> dict[str, Any]:
    try:
        body = json.loads(data)
    except ValueError as error:
        msg = f"the body must be JSON: {error}"
        raise InvalidArgumentError(msg) from error
    if not isinstance(body, dict):
        msg = f"the body must be a JSON object, got {type(body).__name__}: {body!r:.80}"
        raise InvalidArgumentError(msg)
    return body


def parse_completion(data: bytes, *, model_name: str, tokenizer: Tokenizer, vocab_size: int) -> Completion:
    """A `/v1/completions` body, checked: `prompt` (a string, or a list of token ids) and the common fields."""
    body = _body(data)
    check_fields(body, COMPLETION_FIELDS, model_name)
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
    return _completion(body, ids, chat=False, tokenizer=tokenizer)


def parse_chat(data: bytes, *, model_name: str, tokenizer: Any) -> Completion:
    """A `/v1/chat/completions` body, checked: `messages` (each a role and its text content, through the
    tokenizer's chat template with the assistant's turn opened) and the common fields."""
    body = _body(data)
    check_fields(body, CHAT_FIELDS, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        msg = f"messages must be a non-empty list of {{role, content}} objects, got {messages!r:.80}"
        raise InvalidArgumentError(msg)
    turns = [_message(index, message) for index, message in enumerate(messages)]
    if getattr(tokenizer, "chat_template", None) is None:
        msg = "this model's tokenizer has no chat template: use /v1/completions with a prompt"
        raise InvalidArgumentError(msg)
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
    return _completion(body, [int(i) for i in ids], chat=True, tokenizer=tokenizer)


def _message(index: int, message: object) -> dict[str, str]:
    """A chat message as the chat template takes it: its role and its text (text parts joined)."""
    if isinstance(message, dict):
        role, content = message.get("role"), message.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            content = "".join(str(part.get("text", "")) for part in content)
        if role in ROLES and isinstance(content, str) and set(message) <= {"role", "content", "name"}:
            return {"role": str(role), "content": content}
    msg = (
        f"messages[{index}] must be {{role: one of {', '.join(ROLES)}, content: text or text parts}}, "
        f"got {message!r:.80}"
    )
    raise InvalidArgumentError(msg)


def _completion(body: Mapping[str, Any], ids: list[int], *, chat: bool, tokenizer: Any) -> Completion:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        msg = f"user must be a string, got {user!r:.80}"
        raise InvalidArgumentError(msg)
    budgets = {name: check_int(name, body[name]) for name in ("max_tokens", "max_completion_tokens") if name in body}
    if len(set(budgets.values())) > 1:
        msg = f"max_tokens and max_completion_tokens name one budget and disagree: {budgets}"
        raise InvalidArgumentError(msg)
    seed = body.get("seed")
    if seed is not None and (check_int("seed", seed, minimum=0) >= SEEDS):  # torch's generators take 64 bits
        msg = f"seed must be an int from 0 to 2**64 - 1, got {seed!r}"
        raise InvalidArgumentError(msg)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        msg = f"stream must be true or false, got {stream!r:.80}"
        raise InvalidArgumentError(msg)
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):  # fmt: skip
        msg = f"stream_options must be {{include_usage: true or false}} on a streamed request, got {options!r:.80}"
        raise InvalidArgumentError(msg)
    logprobs = _logprobs(body, chat=chat, stream=stream)
    n = check_int("n", body.get("n", 1))
    if n > MAX_CHOICES:
        msg = f"n must be at most {MAX_CHOICES}, got {n}"
        raise InvalidArgumentError(msg)
    return Completion(
        prompt_ids=tuple(ids),
        max_tokens=next(iter(budgets.values()), 16),
        sampling=Sampling(
            temperature=number("temperature", body.get("temperature", 1), 0, 2),
            top_p=number("top_p", body.get("top_p", 1), 0, 1),
            seed=seed,
        ),
        stop=_stops(body.get("stop"), tokenizer),
        presence_penalty=_penalty(body, "presence_penalty"),
        frequency_penalty=_penalty(body, "frequency_penalty"),
        n=n,
        logprobs=logprobs,
        stream=stream,
        include_usage=bool((options or {}).get("include_usage", False)),
        chat=chat,
    )


def _penalty(body: Mapping[str, Any], name: str) -> float:
    """A penalty from -2 to 2; left out or null, 0 (a `false` is refused, not read as 0)."""
    value = body.get(name)
    return 0.0 if value is None else number(name, value, -2, 2)


def _logprobs(body: Mapping[str, Any], *, chat: bool, stream: bool) -> int | None:
    """How many alternatives each token's log-probability comes with, or None: completions' `logprobs` (0 to
    5), a chat's `logprobs` (true or false) with `top_logprobs` (0 to 20)."""
    if chat:
        asked, top = body.get("logprobs"), body.get("top_logprobs")
        if (asked is not None and not isinstance(asked, bool)) or (top is not None and not asked):
            msg = f"logprobs must be true or false, and top_logprobs needs logprobs true; got {asked!r}, {top!r}"
            raise InvalidArgumentError(msg)
        value = 0 if top is None else top
        number("top_logprobs", value, 0, MAX_CHAT_LOGPROBS)  # OpenAI's range, and then a whole number
        count = None if not asked else check_int("top_logprobs", value, minimum=0)
    else:
        value = body.get("logprobs")
        count = None if value is None else check_int("logprobs", value, minimum=0)
        if count is not None and count > MAX_COMPLETION_LOGPROBS:
            msg = f"logprobs must be at most {MAX_COMPLETION_LOGPROBS} (OpenAI's limit), got {count}"
            raise InvalidArgumentError(msg)
    if count is not None and stream:
        msg = "logprobs with stream are not supported by this server (ask without streaming)"
        raise InvalidArgumentError(msg)
    return count


def _stops(stop: object, tokenizer: Any) -> tuple[str, ...]:
    """The stop strings, checked: transformers' `StopStringCriteria` (the engine's `stop_strings`) must read the
    model's tokenizer, which it does not for every tokenizer (a word-level one without a decoder, say)."""
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        msg = f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them, got {stop!r:.80}"
        raise InvalidArgumentError(msg)
    if stops:
        try:
            StopStringCriteria(tokenizer=tokenizer, stop_strings=stops)
        except Exception as error:  # transformers' own reading of the tokenizer's vocabulary
            msg = (
                f"stop is not supported for this model: transformers' stop strings cannot read its tokenizer ({error})"
            )
            raise InvalidArgumentError(msg) from error
    return tuple(stops)


def completion_kwargs(
    completion: Completion, device: torch.device, tokenizer: object, index: int = 0
) -> dict[str, Any]:
    """The `generate` arguments of choice `index` of a completion (batch 1) on `device`: its seed is the
    request's plus `index`, so that the choices differ and each repeats."""
    ids = torch.tensor([completion.prompt_ids], dtype=torch.long, device=device)
    sampling = completion.sampling
    if sampling.seed is not None:
        sampling = Sampling(
            temperature=sampling.temperature, top_p=sampling.top_p, seed=(sampling.seed + index) % SEEDS
        )
    kwargs: dict[str, Any] = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "max_new_tokens": completion.max_tokens,
        **sampling_kwargs(sampling, device),
    }
    if completion.stop:
        kwargs |= {"stop_strings": list(completion.stop), "tokenizer": tokenizer}
    if completion.presence_penalty or completion.frequency_penalty:
        penalty = OccurrencePenalty(
            presence=completion.presence_penalty, frequency=completion.frequency_penalty,
            prompt_length=len(completion.prompt_ids),
        )  # fmt: skip
        kwargs["logits_processor"] = LogitsProcessorList([penalty])
    return kwargs


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The text before the first of `stops` in it, and whether one was found."""
    found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    return (text[: min(found)], True) if found else (text, False)


def finish_reason(generated: Sequence[int], max_tokens: int, end_ids: frozenset[int], *, stopped: bool) -> str:
    """OpenAI's reason a choice ended: "stop" at an end token or a stop string, "length" when it used its budget."""
    ended = stopped or (bool(generated) and generated[-1] in end_ids)
    return "length" if len(generated) >= max_tokens and not ended else "stop"


@frozen(kw_only=True)
class Answer:
    """What the answer of a request needs besides its tokens."""

    model_name: str
    tokenizer: Tokenizer
    end_ids: frozenset[int]
    answer_id: str = field(factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(factory=lambda: int(time.time()))

    def usage(self, completion: Completion, completion_tokens: int) -> dict[str, int]:
        prompt = len(completion.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    def head(self, completion: Completion) -> dict[str, Any]:
        kind = "chat.completion" if completion.chat else "text_completion"
        return {
            "id": self.answer_id.replace("cmpl", "chatcmpl") if completion.chat else self.answer_id,
            "object": f"{kind}.chunk" if completion.chat and completion.stream else kind,
            "created": self.created,
            "model": self.model_name,
        }


def answer_body(
    choices: Sequence[list[int]], completion: Completion, answer: Answer,
    logprobs: Sequence[Sequence[TokenLogprob]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """OpenAI's completion (or chat completion) object for each choice's new tokens (and their log-probabilities,
    one `TokenLogprob` per new token, when the request asked for them)."""
    shaped = []
    for index, generated in enumerate(choices):
        text, stopped = cut_at_stop(answer.tokenizer.decode(generated, skip_special_tokens=True), completion.stop)
        finish = finish_reason(generated, completion.max_tokens, answer.end_ids, stopped=stopped)
        given = None if logprobs is None else logprobs_body(logprobs[index], answer.tokenizer, chat=completion.chat)
        if completion.chat:
            message = {"role": "assistant", "content": text}
            shaped.append({"index": index, "message": message, "logprobs": given, "finish_reason": finish})
        else:
            shaped.append({"index": index, "text": text, "logprobs": given, "finish_reason": finish})
    usage = answer.usage(completion, sum(len(generated) for generated in choices))
    return {**answer.head(completion), "choices": shaped, "usage": usage}


@define(kw_only=True)
class TextDeltas:
    """A choice's text as it grows, token by token: each call to `add` returns the text not handed out yet.
    Every token is decoded with those before it (a tokenizer may write a token otherwise next to others); text
    that ends in an unfinished character (U+FFFD, bytes the next token completes) is held back, and so is text
    that may be the start of a stop string; once a stop appears, nothing from it on is handed out."""

    tokenizer: Tokenizer
    stops: tuple[str, ...] = ()
    ids: list[int] = field(factory=list)
    sent: int = 0  # characters handed out so far
    stopped: bool = False

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._out(final=False)

    def rest(self) -> str:
        """What is left at the end (text held back for a stop that never came)."""
        return self._out(final=True)

    def _out(self, *, final: bool) -> str:
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        text, self.stopped = cut_at_stop(text, self.stops)
        end = len(text)
        if not self.stopped and not final:  # a tail that a stop may begin with waits for the next token
            end -= max((k for stop in self.stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        delta, self.sent = text[self.sent : end], max(self.sent, end)
        return delta


def text_chunk(answer: Answer, completion: Completion, index: int, text: str, finish: str | None) -> dict[str, Any]:
    """One streamed chunk of choice `index`: a piece of text, or the choice's end."""
    if completion.chat:
        delta = {"content": text} if text else {}
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    return {**answer.head(completion), "choices": [choice]}


def role_chunk(answer: Answer, completion: Completion, index: int) -> dict[str, Any]:
    """A chat choice's first streamed chunk: the assistant's role, as OpenAI's stream opens each choice."""
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return {**answer.head(completion), "choices": [choice]}


def usage_chunk(answer: Answer, completion: Completion, completion_tokens: int) -> dict[str, Any]:
    """The last chunk of a stream asked with `stream_options.include_usage`: no choices, the usage."""
    return {**answer.head(completion), "choices": [], "usage": answer.usage(completion, completion_tokens)}
