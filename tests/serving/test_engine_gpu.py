"""GPU tests (marker `gpu`) of cachelife.Engine under cachelife's CUDA graphs (fp32): concurrent requests of
mixed lengths, greedy and seeded sampling, each equal to its own `cachelife.generate` call and, greedy or with
beams, to `model.generate`'s, at 1 and 3 steps per graph replay; beam requests as groups of rows; newcomers'
encoders run together; after `Engine.warm_up`, no new compilation."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import PreTrainedModel

import cachelife
from cachelife.model_rewrites.decode_attention import ATTENTION
from cachelife.serving.engine import Engine
from cachelife.tools import zoo
from support import HeldFirstForward, in_threads, several_sequence_requests, until

pytestmark = pytest.mark.gpu


def requests_of(built: zoo.ZooModel, count: int, *, sampling: bool) -> list[dict[str, Any]]:
    made = []
    for index in range(count):
        request = {**built.inputs(1, 3 + (5 * index) % 11, index), "max_new_tokens": 3 + (7 * index) % 17}
        if sampling and index % 2:
            request.update(do_sample=True, top_k=0, temperature=0.7)
        made.append(request)
    return made


@pytest.mark.parametrize("steps_per_call", [1, 3])
@pytest.mark.parametrize(
    ("name", "options"), [("llama-small", {}), ("whisper-small", {}), ("t5", {"encoder_length": 24})]
)
def test_concurrent_requests_under_graphs_equal_their_own_generate(
    name: str, options: dict[str, Any], steps_per_call: int
) -> None:
    built = zoo.build(name, device="cuda")
    requests = requests_of(built, 10, sampling=True)

    def seeded(index: int, request: dict[str, Any]) -> torch.Generator | None:
        return torch.Generator(device="cuda").manual_seed(index) if request.get("do_sample") else None

    with Engine(built.model, rows=4, max_length=48, steps_per_call=steps_per_call, **options) as engine:
        futures = [engine.submit(**request, generator=seeded(i, request)) for i, request in enumerate(requests)]
        results = [future.result(timeout=600) for future in futures]
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        expected = cachelife.generate(
            built.model, fallback=False, steps_per_call=steps_per_call, generator=seeded(index, request), **request
        )
        assert isinstance(expected, torch.Tensor)
        assert torch.equal(result, expected), index
        if not request.get("do_sample"):  # transformers samples from torch's global generator
            assert torch.equal(result, zoo.generate_tokens(built.model, request)), index


@pytest.mark.parametrize("steps_per_call", [1, 3])
@pytest.mark.parametrize(
    ("name", "options"), [("llama-small", {}), ("whisper-small", {}), ("t5", {"encoder_length": 24})]
)
def test_beam_requests_under_graphs_equal_their_own_generate(
    name: str, options: dict[str, Any], steps_per_call: int
) -> None:
    built = zoo.build(name, device="cuda")
    requests = requests_of(built, 8, sampling=False)
    for index, request in enumerate(requests):
        request.update(num_beams=3, length_penalty=(1.0, 0.5)[index % 2])
    with Engine(built.model, rows=7, max_length=48, steps_per_call=steps_per_call, **options) as engine:
        futures = [engine.submit(**request) for request in requests]
        results = [future.result(timeout=600) for future in futures]
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        expected = cachelife.generate(built.model, fallback=False, steps_per_call=steps_per_call, **request)
        assert isinstance(expected, torch.Tensor)
        assert torch.equal(result, expected), index
        assert torch.equal(result, zoo.generate_tokens(built.model, request)), index


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_bart_rows_under_graphs_read_their_own_positions(steps_per_call: int) -> None:
    """BART counts decoder positions from its cache: the engine's rows read their own from the decoder's row
    position table, written at every step of a replay. The table is scaled up so that a row read at another
    row's position shows in its tokens."""
    built = zoo.build("bart", device="cuda")
    table = built.model.get_decoder().embed_positions
    assert isinstance(table, torch.nn.Embedding)
    with torch.no_grad():
        table.weight.mul_(50.0)
    requests = requests_of(built, 10, sampling=False)
    with Engine(built.model, rows=4, max_length=48, steps_per_call=steps_per_call, encoder_length=24) as engine:
        results = [future.result(timeout=600) for future in [engine.submit(**request) for request in requests]]
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        assert torch.equal(result, zoo.generate_tokens(built.model, request)), index


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_several_sampled_sequences_under_graphs_equal_their_own_generate(steps_per_call: int) -> None:
    """A request's sampled sequences take a row each; its generator draws for them at once within a replay."""
    built = zoo.build("llama-small", device="cuda")
    requests = several_sequence_requests(built, 8)

    def seeded(index: int) -> torch.Generator:
        return torch.Generator(device="cuda").manual_seed(100 + index)

    with Engine(built.model, rows=4, max_length=48, steps_per_call=steps_per_call) as engine:
        futures = [engine.submit(**request, generator=seeded(index)) for index, request in enumerate(requests)]
        results = [future.result(timeout=600) for future in futures]
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        expected = cachelife.generate(
            built.model, fallback=False, steps_per_call=steps_per_call, generator=seeded(index), **request
        )
        assert isinstance(expected, torch.Tensor)
        assert torch.equal(result, expected), index


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_left_padded_requests_under_graphs_equal_generate(steps_per_call: int) -> None:
    """Prompts left-padded with their mask, or without it (`generate` infers it), beside unpadded ones: each row
    counts its positions from its first token and leaves its pads out, as `model.generate` does."""
    built = zoo.build("llama-small", device="cuda")
    requests: list[dict[str, Any]] = []
    for index in range(8):
        padded = zoo.left_padded(
            built.inputs(1, 6 + 3 * index, index), 1 + (5 * index) % 7, pad_token_id=0
        )  # the zoo's pad token
        if index % 2:
            del padded["attention_mask"]
        requests.append({**padded, "max_new_tokens": 8 + (7 * index) % 17})
        requests.append({**built.inputs(1, 3 + index, 20 + index), "max_new_tokens": 6 + index})
    with Engine(built.model, rows=4, max_length=64, steps_per_call=steps_per_call) as engine:
        results = [future.result(timeout=600) for future in [engine.submit(**request) for request in requests]]
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        assert torch.equal(result, zoo.generate_tokens(built.model, request)), index


def test_a_mix_of_settings_under_graphs_shares_one_program_and_equals_generate() -> None:
    # Every everyday setting at once (greedy and sampling rows, penalties, suppressed tokens, minimum lengths, end
    # tokens of their own, n-gram bans), replayed from the per-row pipeline's graphs: each request equals its own
    # seeded cachelife.generate, and greedy ones model.generate.
    built = zoo.build("llama-small", device="cuda")
    settings = zoo.mixed_settings()
    requests = [{**request, **setting} for request, setting in zip(requests_of(built, len(settings), sampling=False),
                                                                    settings, strict=True)]  # fmt: skip

    def seeded(index: int) -> torch.Generator:
        return torch.Generator(device="cuda").manual_seed(100 + index)

    with Engine(built.model, rows=4, max_length=48) as engine:
        futures = [engine.submit(**request, generator=seeded(i)) for i, request in enumerate(requests)]
        results = [future.result(timeout=600) for future in futures]
        programs = engine.stats().programs
    assert programs <= 4  # the per-row pipeline's variants
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        expected = cachelife.generate(built.model, fallback=False, generator=seeded(index), **request)
        assert isinstance(expected, torch.Tensor)
        assert torch.equal(result, expected), (index, request)
        if not request.get("do_sample"):
            assert torch.equal(result, zoo.generate_tokens(built.model, request)), (index, request)


def test_newcomers_of_one_boundary_share_one_prefill_under_graphs_and_equal_generate() -> None:
    """Seven requests that wait while the first one's steps are held join at one boundary through one compiled
    forward; each equals its own `cachelife.generate` and `model.generate` (fp32, under cachelife's graphs)."""
    built = zoo.build("llama-small", device="cuda")
    requests = [{**built.inputs(1, length, length), "max_new_tokens": 4 + length % 5} for length in (2, 13, 7, 9, 4)]
    padded = zoo.left_padded(built.inputs(1, 8, 30), 3, pad_token_id=0)
    requests += [{**padded, "max_new_tokens": 6}, {**built.inputs(1, 11, 31), "max_new_tokens": 3}]
    with Engine(built.model, rows=8, max_length=48) as engine:
        held = threading.Event()
        advance = engine._batch.advance
        engine._batch.advance = lambda: (held.wait(), advance())[1]  # type: ignore[method-assign]
        first = engine.submit(**built.inputs(1, 5, 0), max_new_tokens=4)
        deadline = time.monotonic() + 300
        while engine.stats().decoding < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        futures = [engine.submit(**request) for request in requests]
        while engine.stats().waiting < len(requests) and time.monotonic() < deadline:
            time.sleep(0.01)
        held.set()
        results = [future.result(timeout=600) for future in futures]
        first.result(timeout=60)
        stats = engine.stats()
    assert (stats.joins, stats.prefills) == (8, 2)
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        expected = cachelife.generate(built.model, fallback=False, **request)
        assert isinstance(expected, torch.Tensor)
        assert torch.equal(result, expected), index
        assert torch.equal(result, zoo.generate_tokens(built.model, request)), index


@pytest.mark.parametrize(
    ("name", "options"), [("llama-small", {}), ("whisper-small", {}), ("t5", {"encoder_length": 24})]
)
def test_on_the_gpu_the_rows_decode_with_the_decode_kernel_and_equal_generate(
    name: str, options: dict[str, Any]
) -> None:
    """`attention="auto"` on CUDA (`step_attention`): cachelife's decode kernel while the engine serves, the
    model's SDPA back after; tokens equal `model.generate`'s (on SDPA). The test that "auto" waits on to become
    the engine's default."""
    built = zoo.build(name, device="cuda")
    requests = requests_of(built, 6, sampling=False)
    expected = [zoo.generate_tokens(built.model, request) for request in requests]
    with Engine(built.model, rows=4, max_length=48, attention="auto", **options) as engine:
        assert built.model.config._attn_implementation == ATTENTION
        results = [future.result(timeout=600) for future in [engine.submit(**request) for request in requests]]
    assert built.model.config._attn_implementation == "sdpa"
    for index, (result, tokens) in enumerate(zip(results, expected, strict=True)):
        assert torch.equal(result, tokens), index


@pytest.mark.parametrize(("name", "encoder_length"), [("whisper-small", None), ("t5", 24)])
def test_newcomers_encoders_run_together_under_graphs_and_equal_generate(
    name: str, encoder_length: int | None, held_encoder: Callable[[PreTrainedModel], HeldFirstForward]
) -> None:
    """Five newcomers whose encoder calls arrive while the first one's forward is held: two encoder forwards, and
    every request's tokens equal `model.generate`'s (fp32, under cachelife's graphs)."""
    built = zoo.build(name, device="cuda")
    batch = [{**built.inputs(1, 2 + (5 * index) % 9, index), "max_new_tokens": 3 + index} for index in range(5)]
    held = held_encoder(built.model)
    with Engine(built.model, rows=4, max_length=48, encoder_length=encoder_length) as engine:
        futures: dict[int, Any] = {}

        def submit(index: int) -> None:
            futures[index] = engine.submit(**batch[index])

        in_threads(len(batch), submit, held, lambda: engine.stats().encoder_calls)
        results = {index: future.result(timeout=600) for index, future in futures.items()}
        stats = engine.stats()
    assert (stats.encoder_calls, stats.encoder_forwards) == (5, 2)
    for index, request in enumerate(batch):
        assert torch.equal(results[index], zoo.generate_tokens(built.model, request)), index


def test_after_the_warm_up_under_graphs_newcomers_compile_nothing_and_equal_generate() -> None:
    """`Engine.warm_up` under cachelife's graphs: newcomers alone and together afterwards compile no new graph,
    and their tokens equal `model.generate`'s (fp32)."""
    built = zoo.build("llama-small", device="cuda")
    with Engine(built.model, rows=4, max_length=48) as engine:
        engine.warm_up(**built.inputs(1, 12, 0), max_new_tokens=6)
        compiled = counters["stats"]["unique_graphs"]
        requests = [{**built.inputs(1, length, length), "max_new_tokens": 5} for length in (7, 15, 4, 9, 11)]
        results = [engine.submit(**requests[0]).result(timeout=600)]
        together = engine._gate.at_once(lambda: [engine.submit(**request) for request in requests[1:]])
        results += [future.result(timeout=600) for future in together]
    assert counters["stats"]["unique_graphs"] == compiled
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        assert torch.equal(result, zoo.generate_tokens(built.model, request)), index


@pytest.mark.parametrize("name", ["llama-small", "whisper-small"])
def test_placing_a_newcomer_does_not_wait_for_the_device(name: str) -> None:
    """A newcomer's placement (its cache rows, settings and first token) queues its work behind the step in flight
    without a synchronizing CUDA call (torch's sync debug mode raises on one); the tokens still equal
    `model.generate`'s. The first request captures the placement's graph (a capture synchronises) unwatched; the
    others come one at a time, so that no request thread runs while the mode is on."""
    built = zoo.build(name, device="cuda")
    requests = [{**built.inputs(1, 6, index), "max_new_tokens": 4} for index in range(4)]  # one prefill shape
    with Engine(built.model, rows=4, max_length=48) as engine:
        first = engine.submit(**requests[0]).result(timeout=600)
        place = engine._batch._place

        def watched(*args: Any, **kwargs: Any) -> int:
            torch.cuda.set_sync_debug_mode("error")
            try:
                return place(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        engine._batch._place = watched  # type: ignore[method-assign]
        futures = []
        for index, request in enumerate(requests[1:], start=2):  # the first request was join 1
            future = engine.submit(**request)
            futures.append(future)
            until(lambda: engine.stats().joins >= index or future.done(), 600)  # noqa: B023 (called at once)
        results = [first, *(future.result(timeout=600) for future in futures)]
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        assert torch.equal(result, zoo.generate_tokens(built.model, request)), index
