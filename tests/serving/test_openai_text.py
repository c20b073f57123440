"""OpenAI's text endpoints as plain functions (`cachelife.serving.openai_text`, no Ray): what each body is read
as, what is refused and how, each choice's `generate` arguments, the answers' shapes and the streamed text."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from cachelife.errors import InvalidArgumentError
from cachelife.generation.penalties import OccurrencePenalty
from cachelife.serving.openai_api import Sampling, error_answer, sampling_kwargs
from cachelife.serving.openai_logprobs import TokenLogprob, logprobs_body, token_logprobs
from cachelife.serving.openai_text import (
    Answer,
    Completion,
    TextDeltas,
    answer_body,
    completion_kwargs,
    cut_at_stop,
    finish_reason,
    parse_chat,
    parse_completion,
    role_chunk,
    text_chunk,
    usage_chunk,
)
from cachelife.tools import zoo

TOKENIZER = zoo.words_tokenizer()
LETTERS = zoo.letters_tokenizer(320)  # one that transformers' stop strings read


def completion(body: dict[str, Any], tokenizer: Any = TOKENIZER) -> Completion:
    return parse_completion(json.dumps(body).encode(), model_name="m", tokenizer=tokenizer, vocab_size=320)


def chat(body: dict[str, Any]) -> Completion:
    return parse_chat(json.dumps(body).encode(), model_name="m", tokenizer=TOKENIZER)


def test_a_string_prompt_is_tokenized_and_openai_defaults_apply() -> None:
    assert completion({"prompt": "w10 w20"}) == Completion(
        prompt_ids=(1, 10, 20), max_tokens=16, sampling=Sampling(temperature=1.0, top_p=1.0)
    )
    assert completion({"prompt": ""}).prompt_ids == (1,)  # the tokenizer's start token


def test_a_token_prompt_and_every_setting_are_read() -> None:
    body = {
        "model": "m", "prompt": [7, 8], "max_tokens": 4, "temperature": 0, "top_p": 0.5, "seed": 3, "n": 2,
        "stop": ["b", "cd"], "stream": True, "stream_options": {"include_usage": True}, "user": "u1",
        "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": None,
    }  # fmt: skip
    assert completion(body, LETTERS) == Completion(
        prompt_ids=(7, 8), max_tokens=4, sampling=Sampling(0.0, 0.5, 3), stop=("b", "cd"), n=2, stream=True,
        include_usage=True,
    )  # fmt: skip
    assert completion({"prompt": "ab", "stop": "x", "max_completion_tokens": 3}, LETTERS).stop == ("x",)
    assert completion({"prompt": "w5", "max_completion_tokens": 3}).max_tokens == 3


def test_a_chat_is_its_messages_through_the_chat_template_with_the_assistants_turn_opened() -> None:
    messages = [
        {"role": "system", "content": "w9"},
        {"role": "user", "content": [{"type": "text", "text": "w10 "}, {"type": "text", "text": "w11"}]},
    ]
    read = chat({"messages": messages, "max_completion_tokens": 5, "temperature": 0})
    assert read.prompt_ids == (5, 9, 6, 10, 11, 7)  # system w9, user w10 w11, then the assistant's word
    assert read.chat
    assert read.max_tokens == 5


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], "the body must be a JSON object, got list"),
        ("{", "the body must be JSON: Expecting property name"),
        ({"prompt": "w5", "echo": True}, "unsupported fields ['echo']: this server reads model, max_tokens"),
        ({"prompt": "w5", "model": "gpt"}, "model must be 'm' (the model this server runs), got 'gpt'"),
        ({"prompt": []}, "a non-empty list of token ids in [0, 320), got []"),
        ({"prompt": [5, 320]}, "token ids in [0, 320), got [5, 320]"),
        ({"prompt": [True]}, "got [True]"),
        ({"prompt": "w5", "max_tokens": 0}, "max_tokens must be a positive int, got 0"),
        ({"prompt": "w5", "max_tokens": 2, "max_completion_tokens": 3}, "name one budget and disagree"),
        ({"prompt": "w5", "temperature": 2.5}, "temperature must be a number in [0, 2], got 2.5"),
        ({"prompt": "w5", "top_p": "high"}, "top_p must be a number in [0, 1], got 'high'"),
        ({"prompt": "w5", "seed": -1}, "seed must be an int >= 0, got -1"),
        ({"prompt": "w5", "seed": 2**64}, "seed must be an int from 0 to 2**64 - 1, got 18446744073709551616"),
        ({"prompt": "w5", "stream": "yes"}, "stream must be true or false, got 'yes'"),
        ({"prompt": "w5", "stream_options": {"include_usage": True}}, "stream_options must be"),
        ({"prompt": "w5", "stop": ["a", "b", "c", "d", "e"]}, "a list of up to 4 of them"),
        ({"prompt": "w5", "stop": [""]}, "stop must be a non-empty string"),
        ({"prompt": "w5", "n": 0}, "n must be a positive int, got 0"),
        ({"prompt": "w5", "n": 17}, "n must be at most 16, got 17"),
        ({"prompt": "w5", "user": 5}, "user must be a string, got 5"),
        ({"prompt": "w5", "presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2], got 2.5"),
        ({"prompt": "w5", "frequency_penalty": "x"}, "frequency_penalty must be a number in [-2, 2], got 'x'"),
        ({"prompt": "w5", "logprobs": 6}, "logprobs must be at most 5 (OpenAI's limit), got 6"),
        ({"prompt": "w5", "logprobs": 2, "stream": True}, "logprobs with stream are not supported by this server"),
    ],
)
def test_a_bad_completion_request_says_what_was_expected_and_what_came(body: object, message: str) -> None:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    with pytest.raises(InvalidArgumentError) as raised:
        parse_completion(data, model_name="m", tokenizer=TOKENIZER, vocab_size=320)
    assert message in str(raised.value)
    assert error_answer(raised.value)[0] == 400


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "messages must be a non-empty list"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "w5"}]}, "messages[0] must be {role: one of system"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "content: text or text parts"),
        ({"messages": [{"role": "user", "content": "w5", "tool_calls": []}]}, "messages[0] must be"),
        ({"messages": [{"role": "user", "content": "w5"}], "logprobs": 1}, "logprobs must be true or false"),
        ({"messages": [{"role": "user", "content": "w5"}], "top_logprobs": 2}, "top_logprobs needs logprobs true"),
        (
            {"messages": [{"role": "user", "content": "w5"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs must be a number in [0, 20], got 21",
        ),
        ({"messages": [{"role": "user", "content": "w5"}], "logprobs": True, "top_logprobs": 2.5}, "top_logprobs must"),
        ({"messages": [{"role": "user", "content": "w5"}], "presence_penalty": False}, "presence_penalty must be"),
        ({"messages": [{"role": "user", "content": "w5"}], "tools": []}, "unsupported fields ['tools']"),
        ({"messages": [{"role": "user", "content": "w5"}], "prompt": "w5"}, "unsupported fields ['prompt']"),
    ],
)
def test_a_bad_chat_request_says_what_was_expected_and_what_came(body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        chat(body)
    assert message in str(raised.value)


def test_stops_a_tokenizer_cannot_serve_are_refused_naming_why() -> None:
    with pytest.raises(InvalidArgumentError, match="stop is not supported for this model: transformers' stop"):
        completion({"prompt": "w5", "stop": "w9"})  # the word-level tokenizer has no decoder to read


def test_a_tokenizer_without_a_chat_template_refuses_chats() -> None:
    plain = zoo.words_tokenizer()
    plain.chat_template = None
    with pytest.raises(InvalidArgumentError, match="no chat template: use /v1/completions"):
        parse_chat(b'{"messages": [{"role": "user", "content": "w5"}]}', model_name="m", tokenizer=plain)


def test_temperature_zero_is_greedy_and_a_seed_is_a_generator_seeded_with_it() -> None:
    assert sampling_kwargs(Sampling(0.0, 0.5, 3), torch.device("cpu")) == {"do_sample": False}
    kwargs = sampling_kwargs(Sampling(0.7, 0.9, 3), torch.device("cpu"))
    generator = kwargs.pop("generator")
    assert kwargs == {"do_sample": True, "temperature": 0.7, "top_p": 0.9}
    assert torch.equal(torch.rand(4, generator=generator), torch.rand(4, generator=torch.Generator().manual_seed(3)))
    assert "generator" not in sampling_kwargs(Sampling(0.7), torch.device("cpu"))


def test_each_choice_is_one_row_with_its_mask_budget_stops_and_its_own_seed() -> None:
    read = Completion(prompt_ids=(1, 10, 20), max_tokens=5, sampling=Sampling(0.7, 1.0, 2**64 - 1), stop=("w9",), n=2)
    first, second = (completion_kwargs(read, torch.device("cpu"), TOKENIZER, index) for index in range(2))
    assert first.keys() == {"input_ids", "attention_mask", "max_new_tokens", "do_sample", "temperature", "top_p",
                            "generator", "stop_strings", "tokenizer"}  # fmt: skip
    assert first["input_ids"].tolist() == [[1, 10, 20]]
    assert first["attention_mask"].tolist() == [[1, 1, 1]]
    assert (first["max_new_tokens"], first["stop_strings"], first["tokenizer"]) == (5, ["w9"], TOKENIZER)
    assert first["generator"].initial_seed() == 2**64 - 1
    assert second["generator"].initial_seed() == 0  # the seed plus the choice's index, in 64 bits
    plain = Completion(prompt_ids=(1,), max_tokens=2, sampling=Sampling(0.0))
    assert completion_kwargs(plain, torch.device("cpu"), None).keys() == {
        "input_ids", "attention_mask", "max_new_tokens", "do_sample"
    }  # fmt: skip


def test_the_penalties_are_an_occurrence_penalty_after_the_prompt() -> None:
    read = completion({"prompt": "w10 w20", "presence_penalty": 0.5, "frequency_penalty": -1})
    assert (read.presence_penalty, read.frequency_penalty) == (0.5, -1.0)
    (penalty,) = completion_kwargs(read, torch.device("cpu"), TOKENIZER)["logits_processor"]
    assert isinstance(penalty, OccurrencePenalty)
    assert (penalty.presence, penalty.frequency, penalty.prompt_length) == (0.5, -1.0, 3)
    assert completion({"prompt": "w10", "presence_penalty": 0, "frequency_penalty": None}).presence_penalty == 0


def test_the_text_ends_before_the_first_stop_and_the_finish_reason_says_why() -> None:
    assert cut_at_stop("w5 w6 w7 w8", ["w7", "w6"]) == ("w5 ", True)
    assert cut_at_stop("w5 w6", ["w9"]) == ("w5 w6", False)
    assert finish_reason([5, 6], 2, frozenset({2}), stopped=False) == "length"
    assert finish_reason([5, 6], 2, frozenset({2}), stopped=True) == "stop"
    assert finish_reason([5, 2], 2, frozenset({2}), stopped=False) == "stop"
    assert finish_reason([5], 2, frozenset({2}), stopped=False) == "stop"


@pytest.mark.parametrize("is_chat", [False, True])
def test_an_answer_is_shaped_like_openais(is_chat: bool) -> None:
    read = Completion(prompt_ids=(1, 10), max_tokens=3, sampling=Sampling(0.0), stop=("w30",), n=3, chat=is_chat)
    answer = Answer(model_name="m", tokenizer=TOKENIZER, end_ids=frozenset({2}))
    # the budget spent; an end token; a stop string (its text and what follows it left out)
    body = answer_body([[20, 21, 22], [20, 2], [20, 30, 31]], read, answer)
    assert body["id"].startswith("chatcmpl-" if is_chat else "cmpl-")
    assert body["object"] == ("chat.completion" if is_chat else "text_completion")
    texts, finishes = ["w20 w21 w22", "w20", "w20 "], ["length", "stop", "stop"]
    if is_chat:
        assert [c["message"] for c in body["choices"]] == [{"role": "assistant", "content": t} for t in texts]
    else:
        assert [c["text"] for c in body["choices"]] == texts
    assert [(c["index"], c["finish_reason"], c["logprobs"]) for c in body["choices"]] == [
        (i, f, None) for i, f in enumerate(finishes)
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}
    json.dumps(body)


def test_streamed_chunks_are_shaped_like_openais() -> None:
    read = Completion(prompt_ids=(1, 10), max_tokens=3, sampling=Sampling(0.0), stream=True, chat=True)
    answer = Answer(model_name="m", tokenizer=TOKENIZER, end_ids=frozenset({2}))
    opened = role_chunk(answer, read, 1)
    assert opened["object"] == "chat.completion.chunk"
    assert opened["choices"] == [
        {"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert text_chunk(answer, read, 0, "w5", None)["choices"][0]["delta"] == {"content": "w5"}
    assert text_chunk(answer, read, 0, "", "stop")["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"
    }  # fmt: skip
    usage = usage_chunk(answer, read, 4)
    assert (usage["choices"], usage["usage"]["total_tokens"]) == ([], 6)
    plain = Completion(prompt_ids=(1,), max_tokens=3, sampling=Sampling(0.0), stream=True)
    assert text_chunk(answer, plain, 0, "w5", None)["choices"][0]["text"] == "w5"


def test_text_deltas_add_up_to_the_decoded_text() -> None:
    ids = [10, 20, 2, 30]  # an end token (special: no text) in the middle
    deltas = TextDeltas(tokenizer=TOKENIZER)
    pieces = [deltas.add(token) for token in ids] + [deltas.rest()]
    assert pieces == ["w10", " w20", "", " w30", ""]
    assert "".join(pieces) == TOKENIZER.decode(ids, skip_special_tokens=True)


def test_text_deltas_hold_back_what_may_begin_a_stop_and_end_before_the_stop() -> None:
    deltas = TextDeltas(tokenizer=TOKENIZER, stops=("w21 w22",))
    pieces = [deltas.add(token) for token in (10, 21, 23, 21, 22, 30)]
    # "w21" waits (the stop may begin there), goes out once w23 shows it does not; the stop ends the text
    assert pieces == ["w10", " ", "w21 w23", " ", "", ""]
    assert deltas.stopped
    assert "".join(pieces) + deltas.rest() == "w10 w21 w23 "
    held = TextDeltas(tokenizer=TOKENIZER, stops=("w21 w22",))
    assert [held.add(10), held.add(21), held.rest()] == ["w10", " ", "w21"]  # held back until the end


class _Bytes:
    """A tokenizer whose tokens are bytes: a character of several bytes is unfinished until its last one."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(token_ids).decode(errors="replace")


def test_text_deltas_hold_an_unfinished_character_back() -> None:
    deltas = TextDeltas(tokenizer=_Bytes())
    pieces = [deltas.add(byte) for byte in "aé!".encode()]
    assert pieces == ["a", "", "é", "!"]


def test_logprobs_are_read_as_the_alternatives_asked_for() -> None:
    assert completion({"prompt": "w5"}).logprobs is None
    assert completion({"prompt": "w5", "logprobs": 0}).logprobs == 0
    assert completion({"prompt": "w5", "logprobs": 3}).logprobs == 3
    message = [{"role": "user", "content": "w5"}]
    assert chat({"messages": message, "logprobs": False}).logprobs is None
    assert chat({"messages": message, "logprobs": True}).logprobs == 0
    assert chat({"messages": message, "logprobs": True, "top_logprobs": 4}).logprobs == 4


def test_token_logprobs_are_the_models_own_as_transformers_generate_gives_them() -> None:
    model = zoo.build("llama").model
    ids = torch.tensor([[1, 10, 20, 30]])
    out: Any = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                              do_sample=False, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    generated = out.sequences[0, 4:].tolist()
    expected = torch.stack([logits[0] for logits in out.logits]).float().log_softmax(dim=-1)
    entries = token_logprobs(model, [1, 10, 20, 30], generated, top=3)
    assert [entry.token for entry in entries] == generated
    for step, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(float(expected[step, entry.token]), abs=1e-5)
        values, indices = expected[step].topk(3)
        assert [token for token, _ in entry.top] == indices.tolist()
        assert [value for _, value in entry.top] == pytest.approx(values.tolist(), abs=1e-5)
        assert entry.top[0][0] == entry.token  # greedy, no processor: the chosen token is the likeliest
    assert token_logprobs(model, [1, 10], [], top=2) == []
    assert all(entry.top == () for entry in token_logprobs(model, [1, 10], generated[:2], top=0))


def test_logprobs_are_shaped_as_openai_shapes_them() -> None:
    entries = [TokenLogprob(20, -0.5, ((20, -0.5), (21, -1.5))), TokenLogprob(2, -0.25, ((2, -0.25), (30, -2.0)))]
    chat_shape = logprobs_body(entries, TOKENIZER, chat=True)
    assert chat_shape["content"][0] == {
        "token": "w20", "logprob": -0.5, "bytes": list(b"w20"),
        "top_logprobs": [{"token": "w20", "logprob": -0.5, "bytes": list(b"w20")},
                         {"token": "w21", "logprob": -1.5, "bytes": list(b"w21")}],
    }  # fmt: skip
    assert chat_shape["content"][1]["token"] == "</s>"  # the end token, as the tokenizer writes it
    plain = logprobs_body(entries, TOKENIZER, chat=False)
    assert plain == {
        "tokens": ["w20", "</s>"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"w20": -0.5, "w21": -1.5}, {"</s>": -0.25, "w30": -2.0}], "text_offset": [0, 3],
    }  # fmt: skip
