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
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel
from transformers.generation.logits_process import LogitsProcessorList

import cachelife
from cachelife.errors import (
    EngineClosedError,
    InvalidArgumentError,
    QueueFullError,
    RequestTimeoutError,
    UnsupportedGenerationError,
)
from cachelife.generation.penalties import OccurrencePenalty
from cachelife.serving.openai_api import Sampling, error_answer
from cachelife.serving.openai_audio import (
    Segment,
    form_fields,
    language_of,
    parse_transcription,
    read_wav,
    segments_of,
    text_of,
    transcription_body,
)
from cachelife.serving.openai_logprobs import token_logprobs
from cachelife.tools import zoo

# One local Ray instance (a module fixture) for every test here: one pytest-xdist worker runs them all.
pytestmark = pytest.mark.xdist_group("ray")


RATE = 16000


def llama() -> tuple[PreTrainedModel, Any]:
    """The served Llama's factory: zoo's tiny Llama (seeded random weights) and its tokenizer."""
    return cachelife.enable(zoo.build("llama").model), zoo.words_tokenizer()


def letters() -> tuple[PreTrainedModel, Any]:
    """The same Llama with the letters tokenizer, which transformers' stop strings read (the word-level one they
    cannot): the served model for `stop`."""
    return cachelife.enable(zoo.build("llama").model), zoo.letters_tokenizer(320)


def whisper() -> tuple[PreTrainedModel, Any]:
    """The served Whisper's factory: zoo's tiny Whisper with language and task tokens, and its processor."""
    model = zoo.build("whisper").model
    zoo.whisper_tiny_generation(model.generation_config)
    return cachelife.enable(model), zoo.whisper_tiny_processor()


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
        (b"ID3 an mp3 file", "file must be a 16-bit PCM WAV file (the one format read); reading it failed"),
    ],
)
def test_a_wav_file_of_another_kind_is_refused_with_how_to_convert_it(data: bytes, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        read_wav(data, RATE)
    assert message in str(raised.value)


def test_a_transcription_form_is_read_with_openais_defaults() -> None:
    extractor = zoo.whisper_tiny_processor().feature_extractor
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
        ({"file": wav(np.zeros(0, np.float32))}, "file must hold 1 to 28800000 samples (1800 s), got 0"),
        (
            {"file": wav(tone(0.5)), "response_format": "ass"},
            "response_format must be one of json, text, verbose_json, srt, vtt, got 'ass'",
        ),
        ({"file": wav(tone(0.5)), "timestamp_granularities[]": "word"}, "must be segment (word timestamps are not"),
        ({"file": wav(tone(0.5)), "temperature": "warm"}, "temperature must be a number in [0, 1], got 'warm'"),
        ({"file": wav(tone(0.5)), "prompt": "hi"}, "unsupported fields ['prompt']"),
        ({"file": wav(tone(0.5)), "language": "english"}, "language must be one of en, de, got 'english'"),
    ],
)
def test_a_bad_transcription_request_says_what_was_expected(fields: dict[str, str | bytes], message: str) -> None:
    extractor = zoo.whisper_tiny_processor().feature_extractor
    with pytest.raises(InvalidArgumentError) as raised:
        parse_transcription(fields, model_name="m", feature_extractor=extractor, languages=("en", "de"))
    assert message in str(raised.value)


def test_a_transcription_answer_is_shaped_as_its_format_asks() -> None:
    extractor = zoo.whisper_tiny_processor().feature_extractor
    segments = [
        Segment(start=0.0, end=1.5, tokens=(270, 5, 6, 280), text="t5 t6"),
        Segment(start=61.25, end=3725.007, tokens=(7,), text="t7"),
    ]

    def body(response_format: str) -> Any:
        request = parse_transcription({"file": wav(tone(0.5)), "response_format": response_format},
                                      model_name="m", feature_extractor=extractor, languages=())  # fmt: skip
        return transcription_body(request, text="t5 t6 t7", segments=segments, language="en", task="transcribe")

    assert body("json") == {"text": "t5 t6 t7"}
    assert body("text") == "t5 t6 t7"
    assert body("verbose_json") == {
        "task": "transcribe", "language": "en", "duration": 0.5, "text": "t5 t6 t7",
        "segments": [
            {"id": 0, "seek": 0, "start": 0.0, "end": 1.5, "text": "t5 t6", "tokens": [270, 5, 6, 280],
             "temperature": 0.0},
            {"id": 1, "seek": 0, "start": 61.25, "end": 3725.007, "text": "t7", "tokens": [7], "temperature": 0.0},
        ],
    }  # fmt: skip
    assert body("srt") == "1\n00:00:00,000 --> 00:00:01,500\nt5 t6\n\n2\n00:01:01,250 --> 01:02:05,007\nt7\n"
    assert body("vtt") == "WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nt5 t6\n\n00:01:01.250 --> 01:02:05.007\nt7\n"


def test_whisper_text_leaves_special_tokens_and_timestamps_out() -> None:
    tokenizer = zoo.whisper_tiny_processor().tokenizer
    assert text_of([1, 252, 270, 5, 6, 280, 2], tokenizer, timestamp_begin=263) == "t5 t6"
    assert language_of(torch.tensor([1, 251, 261]), {"<|en|>": 250, "<|de|>": 251}) == "de"
    assert language_of([1, 261], {"<|en|>": 250}) is None


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


def test_the_ray_tests_are_one_group_on_one_worker(request: pytest.FixtureRequest) -> None:
    if not getattr(request.config.option, "loadgroup", False):  # what pytest-xdist sets on its workers
        pytest.skip("runs on a pytest-xdist worker under --dist loadgroup (nox's runs)")
    assert request.node.nodeid.endswith("@ray")  # the group pytest-xdist keeps on one worker


def test_a_replica_warms_its_engine_up_before_it_takes_traffic() -> None:
    pytest.importorskip("ray", reason="the serve extra (pip install -e '.[serve]') is not installed")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Using extra keyword arguments on `Field`", DeprecationWarning)
        ray_serve = importlib.import_module("cachelife.serving.ray_serve")
    options = {"rows": 2, "max_length": 64, "queue_size": 4, "compile_step": False}
    warmed = ray_serve.Replica(llama, "llama", options)  # the deployment's class, built here without Ray
    cold = ray_serve.Replica(llama, "llama", options, warm_up=False)
    audio = ray_serve.Replica(whisper, "whisper", options)
    try:
        # A greedy and a sampled completion, each alone at two prompt lengths and in three groups of two.
        assert (warmed._engine.stats().joins, cold._engine.stats().joins) == (2 * (2 + 3 * 2), 0)
        assert audio._engine.stats().joins == 1  # a transcription of silence (Whisper's encoder length is fixed)
    finally:
        for replica in (warmed, cold, audio):
            replica._engine.close()


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
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)  # a replica takes one (logical) CPU
    try:
        # The engines' steps run eagerly: compiling them would take most of this module's time on a CPU.
        engine: dict[str, Any] = {"rows": 2, "max_length": 64, "queue_size": 4, "compile_step": False}
        # A free port: a server of the user's own on Serve's default port would answer these tests otherwise.
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_serve.application(llama, name="llama", **engine), name="llama", route_prefix="/llama")
        serve.run(ray_serve.application(whisper, name="whisper", **engine), name="whisper", route_prefix="/whisper")
        serve.run(ray_serve.application(letters, name="letters", **engine), name="letters", route_prefix="/letters")
        address = f"http://127.0.0.1:{port}"
        routed(address, ["/llama/v1/completions", "/whisper/v1/audio/transcriptions", "/letters/v1/completions"])
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
        400, "messages must be a non-empty list of {role, content} objects, got None",
    )  # fmt: skip
    status, body = post(f"{server}/llama/v1/embeddings", b"{}", "application/json")
    assert status == 404
    assert json.loads(body)["error"]["message"] == (
        "this server answers GET /v1/models, GET /health, POST /v1/completions, POST /v1/chat/completions; "
        "got POST /v1/embeddings"
    )
    status, body = answer(urllib.request.Request(f"{server}/llama/v1/completions", method="GET"))
    assert status == 405
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


# The official openai client against the same server.


@pytest.fixture
def client(server: str) -> Iterator[Callable[[str], Any]]:
    """The official openai client of a served model by its name, each closed after the test."""
    openai = pytest.importorskip("openai", reason="the openai client (a dev dependency) is not installed")
    made: list[Any] = []

    def of(model: str) -> Any:
        made.append(openai.OpenAI(base_url=f"{server}/{model}/v1", api_key="unused", max_retries=0, timeout=120))
        return made[-1]

    yield of
    for each in made:
        each.close()


def reference_tokens(ids: list[int], max_new_tokens: int, **settings: Any) -> list[int]:
    """The new tokens of the served Llama's own `cachelife.generate` on the prompt `ids`."""
    model, _ = llama()
    prompt = torch.tensor([ids])
    tokens = cachelife.generate(
        model, input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
        compile_step=False, **settings,
    )  # fmt: skip
    assert isinstance(tokens, torch.Tensor)
    return [int(token) for token in tokens[0, prompt.shape[1] :]]


CHAT = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w10 w11 w12"}]


def chat_ids() -> list[int]:
    return [int(i) for i in zoo.words_tokenizer().apply_chat_template(CHAT, add_generation_prompt=True,
                                                                       tokenize=True, return_dict=False)]  # fmt: skip


@pytest.mark.slow
def test_the_openai_client_lists_the_model_and_the_server_answers_health(
    server: str, client: Callable[[str], Any]
) -> None:
    assert [model.id for model in client("llama").models.list()] == ["llama"]
    assert [model.id for model in client("whisper").models.list()] == ["whisper"]
    status, body = answer(urllib.request.Request(f"{server}/llama/health", method="GET"))
    assert (status, json.loads(body)["status"]) == (200, "ok")


@pytest.mark.slow
def test_a_chat_through_the_openai_client_is_its_templated_prompts_generate(
    server: str, client: Callable[[str], Any]
) -> None:
    answer = client("llama").chat.completions.create(
        model="llama", messages=CHAT, max_completion_tokens=6, temperature=0, user="tester"
    )
    expected = reference_tokens(chat_ids(), 6, do_sample=False)
    choice = answer.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == zoo.words_tokenizer().decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(chat_ids()), 6)


@pytest.mark.slow
def test_a_streamed_chat_gives_the_same_text_then_its_usage(client: Callable[[str], Any]) -> None:
    chunks = list(client("llama").chat.completions.create(
        model="llama", messages=CHAT, max_completion_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    expected = zoo.words_tokenizer().decode(reference_tokens(chat_ids(), 6, do_sample=False), skip_special_tokens=True)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == expected
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6
    assert len({chunk.id for chunk in chunks}) == 1


@pytest.mark.slow
def test_a_stop_the_models_tokenizer_cannot_serve_is_a_400_saying_why(client: Callable[[str], Any]) -> None:
    """The served word-level tokenizer has no decoder for transformers' stop strings to read: refused, not a 500
    (test_replica.py serves stops with a tokenizer they read)."""
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError, match="stop is not supported for this model"):
        client("llama").completions.create(model="llama", prompt="w10", max_tokens=4, stop=["w20"])


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_each_seeded_with_the_seed_plus_their_index(client: Callable[[str], Any], stream: bool) -> None:
    settings: dict[str, Any] = {"model": "llama", "prompt": [1, 40, 50], "max_tokens": 5, "temperature": 0.9,
                                "seed": 2**64 - 2, "n": 3}  # fmt: skip
    completions = client("llama").completions
    tokenizer = zoo.words_tokenizer()
    expected = [
        tokenizer.decode(reference_tokens([1, 40, 50], 5, do_sample=True, temperature=0.9,
                                          generator=torch.Generator().manual_seed(seed)), skip_special_tokens=True)
        for seed in (2**64 - 2, 2**64 - 1, 0)
    ]  # fmt: skip
    if stream:
        texts = ["", "", ""]
        for chunk in completions.create(**settings, stream=True):
            texts[chunk.choices[0].index] += chunk.choices[0].text
    else:
        texts = [choice.text for choice in sorted(completions.create(**settings).choices, key=lambda c: c.index)]
    assert texts == expected
    assert len(set(texts)) > 1


@pytest.mark.slow
def test_what_the_server_does_not_decode_is_a_400_naming_the_field_through_the_client(
    server: str, client: Callable[[str], Any]
) -> None:
    openai = pytest.importorskip("openai")
    llama_client = client("llama")
    with pytest.raises(openai.BadRequestError, match="logprobs with stream are not supported by this server"):
        llama_client.completions.create(model="llama", prompt="w10", max_tokens=2, logprobs=2, stream=True)
    with pytest.raises(openai.BadRequestError, match=r"unsupported fields \['logit_bias'\]"):
        llama_client.chat.completions.create(model="llama", messages=CHAT, logit_bias={"5": 1})
    with pytest.raises(openai.BadRequestError, match=r"presence_penalty must be a number in \[-2, 2\]"):
        llama_client.chat.completions.create(model="llama", messages=CHAT, presence_penalty=3)
    with pytest.raises(openai.BadRequestError, match=r"unsupported fields \['tools'\]"):
        llama_client.chat.completions.create(model="llama", messages=CHAT, tools=[{"type": "function",
                                             "function": {"name": "f", "parameters": {}}}])  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        llama_client.embeddings.create(model="llama", input="w10")


@pytest.mark.slow
def test_a_served_translation_is_cachelife_generates_translate_task(server: str) -> None:
    audio = tone(0.5)
    content_type, form = multipart({"file": wav(audio), "language": "de"})
    status, body = post(f"{server}/whisper/v1/audio/translations", form, content_type)
    assert status == 200, body
    model, processor = whisper()
    features = processor.feature_extractor(read_wav(wav(audio), RATE), sampling_rate=RATE, return_tensors="pt")
    tokens = cachelife.generate(model, input_features=features["input_features"], language="de", task="translate",
                                do_sample=False, compile_step=False)  # fmt: skip
    assert isinstance(tokens, torch.Tensor)
    # The tiny random Whisper writes the same words for either task: test_replica.py checks the task asked for.
    assert json.loads(body)["text"] == processor.tokenizer.decode(tokens[0].tolist(), skip_special_tokens=True)


@pytest.mark.slow
def test_penalties_through_the_client_are_the_requests_generate_with_an_occurrence_penalty(
    client: Callable[[str], Any],
) -> None:
    tokenizer = zoo.words_tokenizer()
    ids = tokenizer.encode("w10 w20 w30")
    answer = client("llama").completions.create(
        model="llama", prompt="w10 w20 w30", max_tokens=12, temperature=0, presence_penalty=1.5, frequency_penalty=1
    )
    penalty = OccurrencePenalty(presence=1.5, frequency=1.0, prompt_length=len(ids))
    expected = reference_tokens(ids, 12, do_sample=False, logits_processor=LogitsProcessorList([penalty]))
    assert answer.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert expected != reference_tokens(ids, 12, do_sample=False)  # the penalties change this completion


def long_form_reference(audio: np.ndarray[Any, Any]) -> tuple[str, list[Segment]]:
    """The text and segments of the served Whisper's own `cachelife.generate` on audio longer than its window."""
    model, processor = whisper()
    extracted = processor.feature_extractor(audio, sampling_rate=RATE, return_tensors="pt", truncation=False,
                                            padding="longest", return_attention_mask=True)  # fmt: skip
    output = cachelife.generate(
        model, input_features=extracted["input_features"], attention_mask=extracted["attention_mask"],
        language="en", do_sample=False, compile_step=False, return_timestamps=True, return_segments=True,
    )  # fmt: skip
    assert isinstance(output, dict)
    begin = int(vars(model.generation_config)["no_timestamps_token_id"]) + 1
    text = text_of(output["sequences"][0].tolist(), processor.tokenizer, begin)
    return text, segments_of(output, processor.tokenizer, begin)


@pytest.mark.slow
def test_long_audio_in_every_format_is_whispers_long_form_with_its_segments(client: Callable[[str], Any]) -> None:
    audio = np.concatenate([tone(1.0), np.zeros(RATE // 2, np.float32), tone(1.0) * 0.3])  # 2.5 windows
    text, segments = long_form_reference(audio)
    assert len(segments) > 1
    transcriptions = client("whisper").audio.transcriptions
    verbose = transcriptions.create(
        model="whisper", file=("talk.wav", wav(audio)), language="en", response_format="verbose_json",
        timestamp_granularities=["segment"],
    )  # fmt: skip
    assert (verbose.text, verbose.language, verbose.duration) == (text, "en", 2.5)
    assert [(s.start, s.end, s.text) for s in verbose.segments] == [(s.start, s.end, s.text) for s in segments]
    plain = transcriptions.create(model="whisper", file=("talk.wav", wav(audio)), language="en")
    assert plain.text == text
    subtitles = transcriptions.create(model="whisper", file=("talk.wav", wav(audio)), language="en",
                                      response_format="srt")  # fmt: skip
    assert subtitles.splitlines()[:3] == ["1", f"{clock(segments[0].start, ',')} --> {clock(segments[0].end, ',')}",
                                          segments[0].text]  # fmt: skip
    webvtt = transcriptions.create(model="whisper", file=("talk.wav", wav(audio)), language="en",
                                   response_format="vtt")  # fmt: skip
    assert webvtt.startswith("WEBVTT\n\n")
    assert webvtt.count(" --> ") == len(segments)


def clock(seconds: float, separator: str) -> str:
    whole, milliseconds = divmod(round(seconds * 1000), 1000)
    return f"{whole // 3600:02d}:{whole // 60 % 60:02d}:{whole % 60:02d}{separator}{milliseconds:03d}"


@pytest.mark.slow
def test_logprobs_through_the_client_are_the_models_own_for_each_new_token(client: Callable[[str], Any]) -> None:
    tokenizer = zoo.words_tokenizer()
    ids = tokenizer.encode("w10 w20 w30")
    expected = reference_tokens(ids, 5, do_sample=False)
    model, _ = llama()
    entries = token_logprobs(model, ids, expected, top=2)
    answer = client("llama").completions.create(model="llama", prompt="w10 w20 w30", max_tokens=5, temperature=0,
                                                logprobs=2)  # fmt: skip
    given = answer.choices[0].logprobs
    assert given.tokens == [tokenizer.decode([token]) for token in expected]
    assert given.token_logprobs == pytest.approx([entry.logprob for entry in entries], abs=1e-5)
    assert [list(top) for top in given.top_logprobs] == [[tokenizer.decode([t]) for t, _ in e.top] for e in entries]
    chat = client("llama").chat.completions.create(model="llama", messages=CHAT, max_completion_tokens=4,
                                                   temperature=0, logprobs=True, top_logprobs=3)  # fmt: skip
    content = chat.choices[0].logprobs.content
    chat_tokens = reference_tokens(chat_ids(), 4, do_sample=False)
    assert [item.token for item in content] == [tokenizer.decode([token]) for token in chat_tokens]
    assert all(len(item.top_logprobs) == 3 and item.top_logprobs[0].token == item.token for item in content)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_through_the_client_ends_the_text_before_it_as_the_requests_generate_stops(
    client: Callable[[str], Any], stream: bool
) -> None:
    model, tokenizer = letters()
    prompt = tokenizer.encode("abc")
    free = reference_generate(model, prompt, 10)
    stop = tokenizer.decode(free[3:5])  # the 4th and 5th new tokens
    settings: dict[str, Any] = {"model": "letters", "prompt": "abc", "max_tokens": 10, "temperature": 0,
                                "stop": [stop]}  # fmt: skip
    if stream:
        chunks = list(client("letters").completions.create(**settings, stream=True))
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        answer = client("letters").completions.create(**settings)
        text, finish = answer.choices[0].text, answer.choices[0].finish_reason
    stopped = reference_generate(model, prompt, 10, stop_strings=[stop], tokenizer=tokenizer)
    full = tokenizer.decode(stopped, skip_special_tokens=True)
    assert len(stopped) < len(free)
    assert (text, finish) == (full[: full.index(stop)], "stop")


def reference_generate(model: PreTrainedModel, prompt: list[int], new: int, **settings: Any) -> list[int]:
    ids = torch.tensor([prompt])
    tokens = cachelife.generate(model, input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                do_sample=False, compile_step=False, **settings)  # fmt: skip
    assert isinstance(tokens, torch.Tensor)
    return [int(token) for token in tokens[0, ids.shape[1] :]]
