"""The Ray Serve application (`cachelife.serving.ray_serve`): the request and response mapping
(`cachelife.serving.openai_api`, no Ray needed), then a local Ray instance serving a tiny Llama and a tiny Whisper
over HTTP, whose answers must be `cachelife.generate`'s tokens for the same inputs, decoded (skipped without the
serve extra)."""

from __future__ import annotations

import http.client
import importlib
import io
import json
import math
import socket
import sys
import time
import urllib.error
import urllib.request
import uuid
import warnings
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

import cachelife
from cachelife.errors import (
    EngineClosedError,
    InvalidArgumentError,
    QueueFullError,
    RequestTimeoutError,
    UnsupportedGenerationError,
)
from cachelife.serving.openai_api import (
    Completion,
    Sampling,
    TextDeltas,
    completion_body,
    completion_kwargs,
    error_answer,
    finish_reason,
    form_fields,
    parse_completion,
    parse_transcription,
    read_wav,
    sampling_kwargs,
    transcription_body,
)
from cachelife.tools import zoo

# One local Ray instance (a module fixture) for every test here: one pytest-xdist worker runs them all.
pytestmark = pytest.mark.xdist_group("ray")

# transformers' tokenizer and processor classes are not described in typings/: reached through the module.
transformers = importlib.import_module("transformers")
tokenizers = importlib.import_module("tokenizers")

RATE = 16000


def llama_tokenizer() -> Any:
    """A word-level tokenizer for the tiny Llama's 320 ids: <pad> <s> </s> <unk> <mask>, then w5 ... w319; a
    prompt starts with <s>."""
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]
    vocab = {token: i for i, token in enumerate(specials)} | {f"w{i}": i for i in range(5, 320)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def whisper_processor() -> Any:
    """A processor for the tiny Whisper: 16 mel bins over a 1 s window (64 frames, its encoder's input), and a
    word-level tokenizer for its 300 ids whose start, end, language and task ids are special."""
    extractor = transformers.WhisperFeatureExtractor(
        feature_size=16, sampling_rate=RATE, hop_length=250, chunk_length=1
    )
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(300)}, unk_token="t3"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3",
        extra_special_tokens=[f"t{i}" for i in range(250, 263)],
    )  # fmt: skip
    return transformers.WhisperProcessor(feature_extractor=extractor, tokenizer=fast)


def llama() -> tuple[PreTrainedModel, Any]:
    """The served Llama's factory: zoo's tiny Llama (seeded random weights) and its tokenizer."""
    return cachelife.enable(zoo.build("llama").model), llama_tokenizer()


def whisper() -> tuple[PreTrainedModel, Any]:
    """The served Whisper's factory: zoo's tiny Whisper with language and task tokens, and its processor."""
    model = zoo.build("whisper").model
    zoo.whisper_tiny_generation(model.generation_config)
    return cachelife.enable(model), whisper_processor()


def wav(samples: np.ndarray[Any, Any], *, rate: int = RATE, channels: int = 1, width: int = 2) -> bytes:
    """`samples` (in [-1, 1]) as a PCM WAV file."""
    data = io.BytesIO()
    with wave.open(data, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(width)
        out.setframerate(rate)
        out.writeframes((samples * 32767).astype("<i2").tobytes() if width == 2 else bytes(len(samples)))
    return data.getvalue()


def tone(seconds: float) -> np.ndarray[Any, Any]:
    return np.sin(2 * math.pi * 440 * np.arange(int(RATE * seconds)) / RATE).astype(np.float32) * 0.5


def multipart(fields: dict[str, str | bytes]) -> tuple[str, bytes]:
    """A multipart/form-data body as curl -F writes it: bytes as an uploaded file, str as a field."""
    boundary = uuid.uuid4().hex
    parts = []
    for name, value in fields.items():
        is_file = isinstance(value, bytes)
        disposition = f'form-data; name="{name}"' + ('; filename="audio.wav"' if is_file else "")
        head = f"--{boundary}\r\nContent-Disposition: {disposition}\r\n"
        head += "Content-Type: audio/wav\r\n\r\n" if is_file else "\r\n"
        parts.append(head.encode() + (value if isinstance(value, bytes) else value.encode()) + b"\r\n")
    return f"multipart/form-data; boundary={boundary}", b"".join(parts) + f"--{boundary}--\r\n".encode()


# The request mapping, without Ray.


def test_a_string_prompt_is_tokenized_and_openai_defaults_apply() -> None:
    completion = parse_completion(b'{"prompt": "w10 w20"}', model_name="m", tokenizer=llama_tokenizer(), vocab_size=320)
    assert completion == Completion((1, 10, 20), max_tokens=16, sampling=Sampling(temperature=1.0, top_p=1.0))


def test_an_empty_string_prompt_is_the_tokenizers_start_token() -> None:
    completion = parse_completion(b'{"prompt": ""}', model_name="m", tokenizer=llama_tokenizer(), vocab_size=320)
    assert completion.prompt_ids == (1,)


def test_a_token_prompt_and_every_setting_are_read() -> None:
    body = b'{"model": "m", "prompt": [7, 8], "max_tokens": 4, "temperature": 0, "top_p": 0.5, "seed": 3}'
    completion = parse_completion(body, model_name="m", tokenizer=llama_tokenizer(), vocab_size=320)
    assert completion == Completion((7, 8), 4, Sampling(0.0, 0.5, 3))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], "the body must be a JSON object, got list"),
        ("{", "the body must be JSON: Expecting property name"),
        ({"prompt": "w5", "n": 2}, "unsupported fields ['n']: this server reads model, prompt, max_tokens"),
        ({"prompt": "w5", "model": "gpt"}, "model must be 'm' (the model this server runs), got 'gpt'"),
        (
            {"prompt": []},
            "prompt must be a string of at least one token or a non-empty list of token ids in [0, 320), got []",
        ),
        ({"prompt": [5, 320]}, "token ids in [0, 320), got [5, 320]"),
        ({"prompt": ["w5"]}, "got ['w5']"),
        ({"prompt": [True]}, "got [True]"),
        ({"prompt": "w5", "max_tokens": 0}, "max_tokens must be a positive int, got 0"),
        ({"prompt": "w5", "max_tokens": True}, "max_tokens must be a positive int, got True"),
        ({"prompt": "w5", "temperature": 2.5}, "temperature must be a number in [0, 2], got 2.5"),
        ({"prompt": "w5", "top_p": "high"}, "top_p must be a number in [0, 1], got 'high'"),
        ({"prompt": "w5", "seed": -1}, "seed must be an int >= 0, got -1"),
        ({"prompt": "w5", "seed": 2**64}, "seed must be an int from 0 to 2**64 - 1, got 18446744073709551616"),
    ],
)
def test_a_bad_completion_request_says_what_was_expected_and_what_came(body: object, message: str) -> None:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    with pytest.raises(InvalidArgumentError) as raised:
        parse_completion(data, model_name="m", tokenizer=llama_tokenizer(), vocab_size=320)
    assert message in str(raised.value)
    assert error_answer(raised.value)[0] == 400


def test_stream_is_read_and_must_be_a_bool() -> None:
    body = b'{"prompt": "w10", "stream": true}'
    assert parse_completion(body, model_name="m", tokenizer=llama_tokenizer(), vocab_size=320).stream
    with pytest.raises(InvalidArgumentError, match="stream must be true or false, got 'yes'"):
        parse_completion(b'{"prompt": "w10", "stream": "yes"}', model_name="m", tokenizer=llama_tokenizer(),
                         vocab_size=320)  # fmt: skip


def test_text_deltas_add_up_to_the_decoded_text() -> None:
    tokenizer = llama_tokenizer()
    ids = [10, 20, 2, 30]  # an end token (special: no text) in the middle
    deltas = TextDeltas(tokenizer)
    pieces = [deltas.add(token) for token in ids]
    assert pieces == ["w10", " w20", "", " w30"]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


class _Bytes:
    """A tokenizer whose tokens are bytes: a character of several bytes is unfinished until its last one."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(token_ids).decode(errors="replace")


def test_text_deltas_hold_an_unfinished_character_back() -> None:
    deltas = TextDeltas(_Bytes())
    pieces = [deltas.add(byte) for byte in "aé!".encode()]
    assert pieces == ["a", "", "é", "!"]


def test_the_finish_reason_is_length_only_for_a_used_budget_without_an_end() -> None:
    assert finish_reason([5, 6], 2, frozenset({2})) == "length"
    assert finish_reason([5, 2], 2, frozenset({2})) == "stop"
    assert finish_reason([5], 2, frozenset({2})) == "stop"


def test_temperature_zero_is_greedy_and_a_seed_is_a_generator_seeded_with_it() -> None:
    assert sampling_kwargs(Sampling(0.0, 0.5, 3), torch.device("cpu")) == {"do_sample": False}
    kwargs = sampling_kwargs(Sampling(0.7, 0.9, 3), torch.device("cpu"))
    generator = kwargs.pop("generator")
    assert kwargs == {"do_sample": True, "temperature": 0.7, "top_p": 0.9}
    assert torch.equal(torch.rand(4, generator=generator), torch.rand(4, generator=torch.Generator().manual_seed(3)))
    assert "generator" not in sampling_kwargs(Sampling(0.7), torch.device("cpu"))


def test_a_completion_is_one_row_with_its_mask_and_budget() -> None:
    kwargs = completion_kwargs(Completion((1, 10, 20), 5, Sampling(0.0)), torch.device("cpu"))
    assert kwargs.keys() == {"input_ids", "attention_mask", "max_new_tokens", "do_sample"}
    assert kwargs["input_ids"].tolist() == [[1, 10, 20]]
    assert kwargs["attention_mask"].tolist() == [[1, 1, 1]]
    assert kwargs["max_new_tokens"] == 5


@pytest.mark.parametrize(
    ("tokens", "generated_from", "text", "finish", "completion_tokens"),
    [
        ([1, 10, 20, 30, 40], 2, "w20 w30 w40", "length", 3),  # the budget (3) is spent
        ([1, 10, 20, 2], 2, "w20", "stop", 2),  # the end token came
        ([0, 30, 2], 1, "w30", "stop", 2),  # an encoder-decoder's tokens start after its start token
    ],
)
def test_a_completion_body_is_shaped_like_openais(
    tokens: list[int], generated_from: int, text: str, finish: str, completion_tokens: int
) -> None:
    completion = Completion((1, 10), 3, Sampling(0.0))
    body = completion_body(
        torch.tensor([tokens]), completion, model_name="m", tokenizer=llama_tokenizer(), end_ids=frozenset({2}),
        generated_from=generated_from,
    )  # fmt: skip
    assert body["id"].startswith("cmpl-")
    assert isinstance(body["created"], int)
    assert {key: body[key] for key in ("object", "model", "choices", "usage")} == {
        "object": "text_completion",
        "model": "m",
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
        "usage": {"prompt_tokens": 2, "completion_tokens": completion_tokens, "total_tokens": 2 + completion_tokens},
    }
    json.dumps(body)


def test_a_multipart_form_gives_files_as_bytes_and_fields_as_text() -> None:
    audio = bytes(range(256)) * 4 + b"\r\n--\r\n"  # every byte value, and what looks like a boundary
    content_type, body = multipart({"file": audio, "language": "en"})
    assert form_fields(content_type, body) == {"file": audio, "language": "en"}
    with pytest.raises(
        InvalidArgumentError, match=r"must be multipart/form-data .* got Content-Type 'application/json'"
    ):
        form_fields("application/json", b"{}")


def test_a_wav_file_is_read_as_samples_in_minus_one_to_one() -> None:
    samples = read_wav(wav(tone(0.25)), RATE)
    assert samples.dtype == np.float32
    assert samples.shape == (4000,)
    np.testing.assert_allclose(samples, tone(0.25), atol=1e-4)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (wav(tone(0.1), rate=8000), "must be 16-bit mono WAV at 16000 Hz, got 16-bit, 1 channels at 8000 Hz"),
        (wav(tone(0.1), channels=2), "got 16-bit, 2 channels at 16000 Hz"),
        (wav(tone(0.1), width=1), "got 8-bit, 1 channels"),
        (b"ID3 an mp3 file", "file must be a 16-bit PCM WAV file; reading it failed"),
    ],
)
def test_a_wav_file_of_another_kind_is_refused_with_how_to_convert_it(data: bytes, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        read_wav(data, RATE)
    assert message in str(raised.value)


def test_a_transcription_form_is_read_with_openais_defaults() -> None:
    extractor = whisper_processor().feature_extractor
    request = parse_transcription({"file": wav(tone(0.5))}, model_name="m", feature_extractor=extractor, languages=())
    assert (request.audio.shape, request.language, request.sampling, request.response_format) == (
        (8000,), None, Sampling(0.0), "json",
    )  # fmt: skip
    fields: dict[str, str | bytes] = {"file": wav(tone(0.5)), "language": "en", "temperature": "0.4", "model": "m"}
    fields |= {"response_format": "text"}
    request = parse_transcription(fields, model_name="m", feature_extractor=extractor, languages=("en", "de"))
    assert (request.language, request.sampling, request.response_format) == ("en", Sampling(0.4), "text")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"file": "audio.wav"}, "file must be an uploaded WAV file (curl -F file=@audio.wav), got 'audio.wav'"),
        ({"file": wav(tone(1.5))}, "file must hold 1 to 16000 samples (1 s), got 24000"),
        ({"file": wav(tone(0.5)), "response_format": "srt"}, "response_format must be one of json, text, got 'srt'"),
        ({"file": wav(tone(0.5)), "temperature": "warm"}, "temperature must be a number in [0, 1], got 'warm'"),
        ({"file": wav(tone(0.5)), "prompt": "hi"}, "unsupported fields ['prompt']"),
        ({"file": wav(tone(0.5)), "language": "english"}, "language must be one of en, de, got 'english'"),
    ],
)
def test_a_bad_transcription_request_says_what_was_expected(fields: dict[str, str | bytes], message: str) -> None:
    extractor = whisper_processor().feature_extractor
    with pytest.raises(InvalidArgumentError) as raised:
        parse_transcription(fields, model_name="m", feature_extractor=extractor, languages=("en", "de"))
    assert message in str(raised.value)


def test_a_transcription_answer_is_json_or_the_text_alone() -> None:
    assert transcription_body("t5 t6", "json") == {"text": "t5 t6"}
    assert transcription_body("t5 t6", "text") == "t5 t6"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (QueueFullError("full"), 503),
        (EngineClosedError("closed"), 503),
        (RequestTimeoutError("late"), 504),
        (InvalidArgumentError("bad"), 400),
        (UnsupportedGenerationError("beams"), 400),
        (RuntimeError("broken"), 500),
    ],
)
def test_each_error_has_its_status_and_openais_error_object(error: Exception, status: int) -> None:
    kind = "invalid_request_error" if status == 400 else type(error).__name__
    body = {"error": {"message": str(error), "type": kind, "param": None, "code": None}}
    assert error_answer(error) == (status, body)


# A local Ray instance serving both models.


def post(url: str, body: bytes, content_type: str, *, attempts: int = 3) -> tuple[int, bytes]:
    """The status and body of a POST. A connection that Serve's proxy drops before any answer is tried again, as
    HTTP clients retry a request that no server answered (on a loaded 2-core CI machine the local proxy dropped a
    connection once, unanswered); an answer, whatever its status, is returned at once."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type}, method="POST")
    for _ in range(attempts - 1):
        try:
            return unrouted_waited_out(request)
        except (http.client.RemoteDisconnected, ConnectionResetError):
            time.sleep(1.0)
    return unrouted_waited_out(request)


def unrouted_waited_out(request: urllib.request.Request, seconds: float = 120.0) -> tuple[int, bytes]:
    """The answer to `request`, asked again while Serve's proxy itself answers that no application holds the
    path (its plain-text "Path ... not found", never an application's JSON 404): the proxy forgets an
    application's route while Serve restarts its replica (a health check missed on a loaded 2-core CI machine
    did that once) and learns it again once the replica is back."""
    deadline = time.monotonic() + seconds
    while True:
        status, body = answer(request)
        if not (status == 404 and body.startswith(b"Path '")) or time.monotonic() > deadline:
            return status, body
        time.sleep(0.5)


def answer(request: urllib.request.Request) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(request, timeout=120) as response:  # a local test server
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def routed(address: str, paths: list[str], seconds: float = 120.0) -> None:
    """Wait until Serve's HTTP proxy routes every path to its application: `serve.run` returns once the
    replicas are up, and the proxy learns the new route prefixes after that (a 404 meanwhile)."""
    deadline = time.monotonic() + seconds
    waiting = list(paths)
    while waiting:
        request = urllib.request.Request(f"{address}{waiting[0]}", data=b"{}", method="POST")
        if answer(request)[0] != 404:
            waiting.pop(0)
        elif time.monotonic() > deadline:
            msg = f"Serve's proxy still answers 404 for {waiting} after {seconds} s"
            raise TimeoutError(msg)
        else:
            time.sleep(0.5)


def free_port() -> int:
    """A TCP port no one listens on now, as the system hands one out."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """Serve's HTTP address with the Llama at /llama and the Whisper at /whisper, on a local 2-CPU Ray."""
    ray = pytest.importorskip("ray", reason="the serve extra (pip install -e '.[serve]') is not installed")
    with warnings.catch_warnings():
        # Ray Serve declares its pydantic models with pydantic 1's Field(update_type=...): a deprecation warning.
        warnings.filterwarnings("ignore", "Using extra keyword arguments on `Field`", DeprecationWarning)
        serve = importlib.import_module("ray.serve")
        ray_serve = importlib.import_module("cachelife.serving.ray_serve")
    # The replicas unpickle this module's factories: send them by value, not as an import of a test module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        # The engines' steps run eagerly: compiling them would take most of this module's time on a CPU.
        engine: dict[str, Any] = {"rows": 2, "max_length": 64, "queue_size": 4, "compile_step": False}
        # A free port: a server of the user's own on Serve's default port would answer these tests otherwise.
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_serve.application(llama, name="llama", **engine), name="llama", route_prefix="/llama")
        serve.run(ray_serve.application(whisper, name="whisper", **engine), name="whisper", route_prefix="/whisper")
        address = f"http://127.0.0.1:{port}"
        routed(address, ["/llama/v1/completions", "/whisper/v1/audio/transcriptions"])
        yield address
    finally:
        serve.shutdown()
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def reference_completion(prompt: str, max_new_tokens: int, **sampling: Any) -> str:
    model, tokenizer = llama()
    ids = torch.tensor([tokenizer.encode(prompt)])
    tokens = cachelife.generate(
        model, input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, compile_step=False,
        **sampling,
    )  # fmt: skip
    assert isinstance(tokens, torch.Tensor)
    text: str = tokenizer.decode(tokens[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
    return text


@pytest.mark.slow
def test_a_served_completion_is_cachelife_generates_tokens_decoded(server: str) -> None:
    request = {"model": "llama", "prompt": "w10 w20 w30", "max_tokens": 6, "temperature": 0}
    status, body = post(f"{server}/llama/v1/completions", json.dumps(request).encode(), "application/json")
    assert status == 200, body
    answer = json.loads(body)
    assert answer["choices"][0]["text"] == reference_completion("w10 w20 w30", 6, do_sample=False)
    assert answer["usage"]["prompt_tokens"] == 4


@pytest.mark.slow
def test_a_streamed_completion_is_the_same_text_in_server_sent_events(server: str) -> None:
    request = {"model": "llama", "prompt": "w10 w20 w30", "max_tokens": 6, "temperature": 0, "stream": True}
    status, body = post(f"{server}/llama/v1/completions", json.dumps(request).encode(), "application/json")
    assert status == 200, body
    events = [line.removeprefix("data: ") for line in body.decode().split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    assert text == reference_completion("w10 w20 w30", 6, do_sample=False)
    assert len(chunks) > 2  # the text came in pieces, not at once


@pytest.mark.slow
def test_a_seeded_sampled_completion_is_cachelife_generates_with_that_seed(server: str) -> None:
    request = {"prompt": [1, 40, 50], "max_tokens": 5, "temperature": 0.9, "top_p": 0.8, "seed": 11}
    answers = [post(f"{server}/llama/v1/completions", json.dumps(request).encode(), "application/json")]
    answers.append(post(f"{server}/llama/v1/completions", json.dumps(request).encode(), "application/json"))
    texts = [json.loads(body)["choices"][0]["text"] for _, body in answers]
    expected = reference_completion(
        "w40 w50", 5, do_sample=True, temperature=0.9, top_p=0.8, generator=torch.Generator().manual_seed(11)
    )
    assert texts == [expected, expected]


@pytest.mark.slow
def test_concurrent_completions_each_get_their_own_tokens(server: str) -> None:
    prompts = ["w10", "w20 w21", "w30 w31 w32", "w40 w41 w42 w43"]  # more than the engine's 2 rows, queued

    def complete(prompt: str) -> str:
        request = json.dumps({"prompt": prompt, "max_tokens": 5, "temperature": 0}).encode()
        status, body = post(f"{server}/llama/v1/completions", request, "application/json")
        assert status == 200, body
        text: str = json.loads(body)["choices"][0]["text"]
        return text

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(complete, prompts))
    assert texts == [reference_completion(prompt, 5, do_sample=False) for prompt in prompts]


@pytest.mark.slow
def test_bad_requests_and_wrong_paths_get_400_and_404_with_a_message(server: str) -> None:
    status, body = post(f"{server}/llama/v1/completions", b'{"prompt": "w5", "max_tokens": -1}', "application/json")
    assert (status, json.loads(body)["error"]["message"]) == (400, "max_tokens must be a positive int, got -1")
    status, body = post(f"{server}/llama/v1/completions", b'{"prompt": "w5", "max_tokens": 100}', "application/json")
    assert status == 400  # the engine's own check
    assert "the engine's max_length is 64" in json.loads(body)["error"]["message"]
    status, body = post(f"{server}/llama/v1/completions", b"not json", "application/json")
    assert status == 400
    assert json.loads(body)["error"]["message"].startswith("the body must be JSON")
    status, body = post(f"{server}/llama/v1/chat/completions", b"{}", "application/json")
    assert (status, json.loads(body)["error"]["message"]) == (
        404, "this server answers POST /v1/completions, got POST /v1/chat/completions",
    )  # fmt: skip
    content_type, form = multipart({"file": wav(tone(0.5), rate=44100)})
    status, body = post(f"{server}/whisper/v1/audio/transcriptions", form, content_type)
    assert status == 400
    assert "got 16-bit, 1 channels at 44100 Hz" in json.loads(body)["error"]["message"]
    content_type, form = multipart({"file": wav(tone(0.5)), "language": "xx"})
    status, body = post(f"{server}/whisper/v1/audio/transcriptions", form, content_type)
    assert (status, json.loads(body)["error"]["message"]) == (400, "language must be one of en, de, fr, got 'xx'")


@pytest.mark.slow
@pytest.mark.parametrize("response_format", ["json", "text"])
def test_a_served_transcription_is_cachelife_generates_tokens_decoded(server: str, response_format: str) -> None:
    audio = tone(0.5)
    content_type, form = multipart({"file": wav(audio), "language": "en", "response_format": response_format})
    status, body = post(f"{server}/whisper/v1/audio/transcriptions", form, content_type)
    assert status == 200, body
    model, processor = whisper()
    samples = read_wav(wav(audio), RATE)
    features = processor.feature_extractor(samples, sampling_rate=RATE, return_tensors="pt")["input_features"]
    tokens = cachelife.generate(model, input_features=features, language="en", do_sample=False, compile_step=False)
    assert isinstance(tokens, torch.Tensor)
    expected = processor.tokenizer.decode(tokens[0].tolist(), skip_special_tokens=True)
    assert (json.loads(body)["text"] if response_format == "json" else body.decode()) == expected
