"""The Ray Serve replica's endpoints called in this process (no Ray cluster, no HTTP): stops with a tokenizer
transformers' stop strings read, streamed and not, and the translation route asking for Whisper's translate
task. The same endpoints over HTTP, through the official openai client, are test_ray_serve.py's."""

from __future__ import annotations

import asyncio
import io
import json
import wave
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

import cachelife
from cachelife.tools import zoo

ray_serve = pytest.importorskip("cachelife.serving.ray_serve", reason="the serve extra is not installed")
starlette = pytest.importorskip("starlette.requests")


def letters_llama() -> tuple[PreTrainedModel, Any]:
    return zoo.build("llama").model, zoo.letters_tokenizer(320)


def call(replica: Any, method: str, path: str, body: bytes = b"", content_type: str = "application/json") -> Any:
    """The replica's answer to one request: (status, the body's bytes) after every streamed piece came."""

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"",
             "headers": [(b"content-type", content_type.encode())]}  # fmt: skip

    async def answer() -> tuple[int, bytes]:
        response = await replica(starlette.Request(scope, receive))
        if hasattr(response, "body_iterator"):
            pieces = [piece if isinstance(piece, bytes) else piece.encode() async for piece in response.body_iterator]
            return response.status_code, b"".join(pieces)
        return response.status_code, bytes(response.body)

    return asyncio.run(answer())


@pytest.fixture(scope="module")
def replica() -> Any:
    served = ray_serve.Replica(letters_llama, "llama", {"rows": 2, "max_length": 64, "compile_step": False})
    yield served
    served._engine.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_ends_the_text_before_it_where_the_requests_generate_stops(replica: Any, stream: bool) -> None:
    model, tokenizer = letters_llama()
    prompt = tokenizer.encode("abc")
    ids = torch.tensor([prompt])  # "a" is id 0, the pad token: the mask says it is no padding, as the server's does
    mask = torch.ones_like(ids)
    free = cachelife.generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                              compile_step=False)  # fmt: skip
    assert isinstance(free, torch.Tensor)
    stop = tokenizer.decode(free[0, ids.shape[1] + 3 : ids.shape[1] + 5].tolist())  # the 4th and 5th new tokens
    request = {"prompt": "abc", "max_tokens": 10, "temperature": 0, "stop": [stop], "stream": stream}
    status, body = call(replica, "POST", "/v1/completions", json.dumps(request).encode())
    assert status == 200, body
    if stream:
        events = [line.removeprefix("data: ") for line in body.decode().split("\n\n") if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
        text, finish = "".join(chunk["text"] for chunk in chunks), chunks[-1]["finish_reason"]
    else:
        answer = json.loads(body)
        text, finish = answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]
    stopped = cachelife.generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                 compile_step=False, stop_strings=[stop], tokenizer=tokenizer)  # fmt: skip
    assert isinstance(stopped, torch.Tensor)
    assert stopped.shape[1] < free.shape[1]
    full = tokenizer.decode(stopped[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
    assert full.endswith(stop)
    assert (text, finish) == (full[: full.index(stop)], "stop")
    if not stream:
        assert json.loads(body)["usage"]["completion_tokens"] == stopped.shape[1] - ids.shape[1]


def test_each_route_answers_its_method_and_others_are_404_or_405(replica: Any) -> None:
    assert call(replica, "GET", "/v1/models")[0] == 200
    assert json.loads(call(replica, "GET", "/health")[1])["status"] == "ok"
    assert call(replica, "GET", "/v1/chat/completions")[0] == 405
    status, body = call(replica, "POST", "/v1/audio/transcriptions", b"{}")
    assert status == 404
    assert "POST /v1/completions, POST /v1/chat/completions; got POST /v1/audio/transcriptions" in body.decode()


def silence(seconds: float) -> bytes:
    """A 16-bit mono WAV file of silence at 16 kHz."""
    data = io.BytesIO()
    with wave.open(data, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(16000)
        file.writeframes(b"\0\0" * int(16000 * seconds))
    return data.getvalue()


class Recording:
    """An engine stand-in that keeps each request's arguments and answers with the decoder prompt alone."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    async def generate(self, **kwargs: Any) -> torch.Tensor:
        self.requests.append(kwargs)
        return torch.tensor([[1, 2]])

    def close(self) -> None:
        pass


def test_the_translation_route_asks_for_whispers_translate_task() -> None:
    def whisper() -> tuple[PreTrainedModel, Any]:
        model = zoo.build("whisper").model
        zoo.whisper_tiny_generation(model.generation_config)
        return model, zoo.whisper_tiny_processor()

    served = ray_serve.Replica(whisper, "whisper", {"rows": 1, "max_length": 16, "compile_step": False})
    served._engine.close()
    served._engine = Recording()
    boundary = "b0undary"
    form = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            "Content-Type: audio/wav\r\n\r\n"
        ).encode()
        + silence(0.1)
        + f"\r\n--{boundary}--\r\n".encode()
    )
    content_type = f"multipart/form-data; boundary={boundary}"
    for path, task in (("/v1/audio/translations", "translate"), ("/v1/audio/transcriptions", "transcribe")):
        assert call(served, "POST", path, form, content_type)[0] == 200
        assert served._engine.requests[-1]["task"] == task
