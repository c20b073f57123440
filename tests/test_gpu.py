"""GPU tests (marker `gpu`): the compiled recipe with CUDA graphs, without and with cachelife.

Each recipe runs in a fresh process (`python -m cachelife recipe --json`): without cachelife the recipe
can kill its process with a segmentation fault, and CUDA-graph health counters are per process. Tokens
are always compared with eager dynamic-cache generation inside that process. With CACHELIFE_GPU_RESULTS
set to a file, every recipe report is appended to it as one JSON line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.cache_utils import EncoderDecoderCache, StaticCache

import cachelife
from cachelife.core.buffers import PinSpec
from cachelife.errors import CompiledRegionError
from cachelife.generation import graphs
from cachelife.generation.loop_settings import CudaGraphs
from cachelife.integration.call_arguments import cache_argument_name
from cachelife.integration.guard import DecodingGuard
from cachelife.integration.runtime import runtime_of
from cachelife.tools import zoo
from cachelife.tools.recipe import CudaGraphHealth

pytestmark = pytest.mark.gpu

ENCODER_DECODER = ("t5-small", "bart-small", "whisper-small")
ALL = (*ENCODER_DECODER, "llama-small")
SOURCE = Path(__file__).resolve().parents[1] / "src"


def run_recipe(*arguments: str, timeout: int = 900) -> dict[str, Any]:
    """Run the recipe in a fresh process; return its report, or the signal that killed it."""
    env = {**os.environ, "PYTHONPATH": f"{SOURCE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "cachelife", "recipe", "--json", *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    record: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT ")) if lines else {}
    record["arguments"] = list(arguments)
    record["returncode"] = done.returncode
    if done.returncode < 0:
        record["killed_by"] = signal.Signals(-done.returncode).name
    record["stderr_tail"] = done.stderr[-3000:]
    results = os.environ.get("CACHELIFE_GPU_RESULTS")
    if results:
        with open(results, "a", encoding="utf-8") as sink:
            sink.write(json.dumps(record) + "\n")
    return record


@pytest.mark.parametrize("name", ALL)
def test_vanilla_recipe_fails_without_cachelife(name: str) -> None:
    record = run_recipe("--model", name, "--without-cachelife")
    crashed = record["returncode"] < 0
    calls = record.get("calls", [])
    failed_call = any(call["error"] is not None or call["equal_to_eager"] is False for call in calls)
    assert crashed or failed_call, f"transformers' recipe unexpectedly succeeded: {record}"


@pytest.fixture(scope="module")
def recipes() -> dict[tuple[str, str], dict[str, Any]]:
    """One cachelife recipe run per model and compile mode, shared by the correctness and health tests."""
    return {}


def cachelife_recipe(recipes: dict[tuple[str, str], dict[str, Any]], name: str, mode: str) -> dict[str, Any]:
    if (name, mode) not in recipes:
        recipes[name, mode] = run_recipe("--model", name, "--compile", mode, "--calls", "3")
    return recipes[name, mode]


RECIPES = [
    pytest.param(name, mode, marks=pytest.mark.xdist_group(f"{name}-{mode}"))
    for mode in ("forward", "auto")
    for name in ALL
]


@pytest.mark.parametrize(("name", "compile_mode"), RECIPES)
def test_recipe_with_cachelife_equals_eager_on_three_calls(
    recipes: dict[tuple[str, str], dict[str, Any]], name: str, compile_mode: str
) -> None:
    record = cachelife_recipe(recipes, name, compile_mode)
    assert record["returncode"] == 0, record["stderr_tail"]
    assert record["ok"], record
    assert [call["equal_to_eager"] for call in record["calls"]] == [True, True, True]
    assert "Unallocated" not in record["table_at_first_forward"]


@pytest.mark.parametrize(("name", "compile_mode"), RECIPES)
def test_recipe_with_cachelife_is_healthy(
    recipes: dict[tuple[str, str], dict[str, Any]], name: str, compile_mode: str
) -> None:
    """CUDA-graph health: nothing skipped; the pool keeps addresses, so nothing is ever re-recorded."""
    record = cachelife_recipe(recipes, name, compile_mode)
    assert [call["health"]["cudagraph_skips"] for call in record["calls"]] == [0, 0, 0]
    assert [call["health"]["rerecords"] for call in record["calls"]] == [0, 0, 0]


@pytest.fixture(scope="module")
def beam_recipes() -> dict[str, dict[str, Any]]:
    """One beam-search recipe run (4 beams, compiled forward, 3 calls) per model."""
    return {}


def beam_recipe(recipes: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    if name not in recipes:
        recipes[name] = run_recipe(
            "--model", name, "--compile", "forward", "--calls", "3", "--num-beams", "4", "--batch-size", "2",
            "--new-tokens", "32",
        )  # fmt: skip
    return recipes[name]


@pytest.mark.parametrize("name", ALL)
def test_beam_search_with_a_compiled_forward_equals_eager_on_three_calls(
    beam_recipes: dict[str, dict[str, Any]], name: str
) -> None:
    record = beam_recipe(beam_recipes, name)
    assert record["returncode"] == 0, record["stderr_tail"]
    assert [call["equal_to_eager"] for call in record["calls"]] == [True, True, True], record


@pytest.mark.parametrize("name", ALL)
def test_beam_search_with_a_compiled_forward_keeps_its_cuda_graphs(
    beam_recipes: dict[str, dict[str, Any]], name: str
) -> None:
    """Beam reorders write into the pinned buffers: no skip at all, no re-record after the first call."""
    record = beam_recipe(beam_recipes, name)
    calls = record["calls"]
    assert [call["health"]["cudagraph_skips"] for call in calls] == [0, 0, 0], record["stderr_tail"]
    assert {call["health"]["rerecords"] for call in calls} == {calls[0]["health"]["rerecords"]}, record


# Capturing nothing (pinning refused before any kernel) leaves the graph empty, which torch warns about.
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
def test_pin_refuses_during_cuda_graph_capture() -> None:
    layer_cache = StaticCache(config=zoo.t5_tiny(), max_cache_len=8)
    layer = cachelife.lifecycle(layer_cache).layers[0]
    spec = PinSpec(
        batch_size=1,
        num_kv_heads=4,
        key_head_dim=16,
        value_head_dim=16,
        dtype=torch.float32,
        device=torch.device("cuda", torch.cuda.current_device()),
    )
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(CompiledRegionError, match="CUDA graph is being captured"), torch.cuda.graph(graph):
        layer.pin(spec)
    assert not layer.is_pinned


@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature:UserWarning")
def test_boundary_checks_never_synchronise_with_the_device() -> None:
    built = zoo.build("t5", device="cuda")
    model = built.model
    cache = cachelife.prepare_static_cache(model, batch_size=2, max_cache_len=16, encoder_length=9)
    assert isinstance(cache, EncoderDecoderCache)
    guard = DecodingGuard(on_unpinned="pin", pool_bytes=0)
    inputs = built.inputs(2, 9, 1)
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(**inputs)
    step = {
        "encoder_outputs": encoder_outputs,
        "decoder_input_ids": torch.zeros(2, 1, dtype=torch.long, device="cuda"),
        cache_argument_name(model): cache,
    }
    for _ in range(3):
        with synchronisation_is_an_error():
            guard.before_forward(model, (), step)
        with torch.no_grad():
            model(**step)  # transformers' own forward may synchronise; only cachelife's checks are held to it
        with synchronisation_is_an_error():
            guard.record_content(step, compiled=False)
    assert cachelife.lifecycle(cache).is_filled


@contextlib.contextmanager
def synchronisation_is_an_error() -> Iterator[None]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


GENERATE_CASES: dict[str, dict[str, Any]] = {
    # Whisper's prompt and suppress lists plus n-gram, repetition and minimum-length rules, greedy.
    "whisper": {
        "max_new_tokens": 12, "language": "de", "task": "translate", "no_repeat_ngram_size": 2,
        "repetition_penalty": 1.3, "min_new_tokens": 4,
    },
    # Beam search with its options (BART's tiny model would end at once: no end token here).
    "bart": {
        "max_new_tokens": 12, "num_beams": 3, "num_return_sequences": 2, "length_penalty": 2.0,
        "no_repeat_ngram_size": 2, "early_stopping": True,
    },
}  # fmt: skip


# torch's cudagraph trees capture an empty graph when they create their memory pool (CUDAGraphTreeManager).
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
@pytest.mark.parametrize("cuda_graphs", ["cachelife", "torch"])
@pytest.mark.parametrize("name", sorted(GENERATE_CASES))
def test_cachelife_generate_is_graph_captured_and_equals_generate(name: str, cuda_graphs: CudaGraphs) -> None:
    """`cachelife.generate` with CUDA graphs (fp32), cachelife's own or torch's cudagraph trees: tokens equal
    eager `generate` on three calls at 1 and 2 steps per call and on a call of another length, no CUDA-graph
    skip, and no capture, re-record or new graph after each setting's first call."""
    built = zoo.build(name, device="cuda")
    config = built.model.generation_config
    if name == "whisper":
        zoo.whisper_tiny_generation(config)
    else:
        config.eos_token_id = config.forced_eos_token_id = None
    model = cachelife.enable(built.model)
    inputs = built.inputs(2, 9, 1)
    settings = GENERATE_CASES[name]
    shorter = {**settings, "max_new_tokens": int(settings["max_new_tokens"]) - 3}
    expected, expected_shorter = (
        zoo.generate_tokens(model, inputs, **settings),
        zoo.generate_tokens(model, inputs, **shorter),
    )
    start = CudaGraphHealth.now()
    record = runtime_of(model)
    for steps in (1, 2):
        calls = []
        for index in range(3):
            calls.append(
                cachelife.generate(
                    model, fallback=False, steps_per_call=steps, cuda_graphs=cuda_graphs, **inputs, **settings
                )
            )
            if index == 0:
                after_first, captures = CudaGraphHealth.now(), record.captures
        other_length = cachelife.generate(
            model, fallback=False, steps_per_call=steps, cuda_graphs=cuda_graphs, **inputs, **shorter
        )
        assert all(isinstance(out, torch.Tensor) and torch.equal(out, expected) for out in calls), (steps, calls)
        assert isinstance(other_length, torch.Tensor)
        assert torch.equal(other_length, expected_shorter), steps
        end = CudaGraphHealth.now()
        assert (end.rerecords, end.graphs) == (after_first.rerecords, after_first.graphs), (steps, end)
        assert record.captures == captures, steps
        assert captures == (steps if cuda_graphs == "cachelife" else 0), captures
    assert end.cudagraph_skips == start.cudagraph_skips


def test_cachelife_generate_with_fast_kernels_is_graph_captured_and_equals_generate() -> None:
    """`compile_options=cachelife.FAST_KERNELS` (fp32, Whisper's case above): tokens equal eager `generate` on
    three calls, one capture on the first call and none after, no CUDA-graph skip."""
    built = zoo.build("whisper", device="cuda")
    zoo.whisper_tiny_generation(built.model.generation_config)
    model = cachelife.enable(built.model)
    inputs = built.inputs(2, 9, 1)
    settings = GENERATE_CASES["whisper"]
    expected = zoo.generate_tokens(model, inputs, **settings)
    start, record = CudaGraphHealth.now(), runtime_of(model)
    calls = [
        cachelife.generate(model, fallback=False, compile_options=cachelife.FAST_KERNELS, **inputs, **settings)
        for _ in range(3)
    ]
    assert all(isinstance(out, torch.Tensor) and torch.equal(out, expected) for out in calls), calls
    assert record.captures == 1, record.captures
    assert CudaGraphHealth.now().cudagraph_skips == start.cudagraph_skips


def _in_threads(calls: list[Any]) -> list[Any]:
    """Run every call in its own thread, all released together; their results in order."""
    barrier = threading.Barrier(len(calls))

    def run(call: Any) -> Any:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
@pytest.mark.parametrize("name", ["t5-small", "llama-small"])
def test_concurrent_calls_with_cachelife_graphs_equal_sequential_ones(name: str) -> None:
    """Four threads on one enabled model (fp32, cachelife's CUDA graphs, greedy and 2 beams), after sequential
    calls of the same shape and before one more: every output equals eager `generate`'s, and the process keeps
    capturing and replaying correctly afterwards."""
    built = zoo.build(name, device="cuda")
    config = built.model.generation_config
    config.eos_token_id = config.forced_eos_token_id = None
    model = cachelife.enable(built.model)
    inputs = [built.inputs(2, 9, seed) for seed in range(4)]
    for beams in (1, 2):
        settings: dict[str, Any] = {"max_new_tokens": 24, "num_beams": beams}
        expected = [zoo.generate_tokens(model, one, **settings) for one in inputs]

        def call(one: dict[str, Any], settings: dict[str, Any] = settings) -> Any:
            return lambda: cachelife.generate(model, fallback=False, **one, **settings)

        sequential = [call(one)() for one in inputs]
        together = _in_threads([call(one) for one in inputs])
        after = call(inputs[0])()
        for got, want in zip([*sequential, *together, after], [*expected, *expected, expected[0]], strict=True):
            assert isinstance(got, torch.Tensor)
            assert torch.equal(got, want), (beams, got, want)


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
def test_concurrent_first_calls_on_two_models_capture_correctly() -> None:
    """Two models compiled and captured for the first time in two threads at once (the captures share the
    device's capture stream and the compiler), then both again together: tokens equal eager `generate`'s."""
    models = [zoo.build("t5-small", device="cuda"), zoo.build("bart-small", device="cuda")]
    for built in models:
        config = built.model.generation_config
        config.eos_token_id = config.forced_eos_token_id = None
        cachelife.enable(built.model)
    inputs = [built.inputs(2, 9, 1) for built in models]
    expected = [zoo.generate_tokens(b.model, i, max_new_tokens=16) for b, i in zip(models, inputs, strict=True)]

    def call(built: zoo.ZooModel, one: dict[str, Any]) -> Any:
        return lambda: cachelife.generate(built.model, fallback=False, **one, max_new_tokens=16)

    for _ in range(2):
        got = _in_threads([call(b, i) for b, i in zip(models, inputs, strict=True)])
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True)), got


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
def test_a_failed_capture_leaves_the_next_capture_working() -> None:
    """A capture invalidated by an operation it must not run (a copy to the host) raises, and leaves the
    thread's stream and the memory pool as they were: the next capture on the same pool succeeds."""
    device = torch.device("cuda")
    pool = torch.cuda.graph_pool_handle()
    before = torch.cuda.current_stream(device)
    source = torch.arange(4.0, device=device)
    target = torch.zeros(4, device=device)

    def synchronising() -> None:
        (source * 2).cpu()

    with pytest.raises(RuntimeError, match="captur"):
        graphs.capture_cuda(lambda: None, synchronising, device, pool)
    assert torch.cuda.current_stream(device) == before

    def doubling() -> None:
        target.copy_(source * 2)

    graph = graphs.capture_cuda(doubling, doubling, device, pool)
    target.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert target.tolist() == [0.0, 2.0, 4.0, 6.0]
