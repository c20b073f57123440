"""Identical calls, identical tokens: the compiled step's attention backends (`cachelife.generation.repeatable`).

On the CPU: the step's attention is chosen among `REPEATABLE_ATTENTION` (seen by narrowing it to the math
backend, whose kernels then replace the CPU flash kernel in the compiled steps), the process's switches are
left as they were, eager steps' restriction of them holds across threads, and identical calls give identical
tokens and scores. On a GPU (`gpu`): four identical
calls, bf16, a left-padded batch, give identical tokens and scores on every path of `cachelife.generate` and
identical tokens for every request of an `Engine`. The cause, torch's cuDNN attention, exists on CUDA alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.generation.streamers import BaseStreamer
from transformers.utils import ModelOutput

import cachelife
from cachelife.generation import repeatable
from cachelife.serving.engine import Engine
from cachelife.tools import zoo

FLASH_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"
# The process's switch of each of torch's attention backends: how to read it, how to set it.
SWITCHES: dict[str, tuple[Callable[[], bool], Callable[[bool], None]]] = {
    "flash": (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
    "mem_efficient": (torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.enable_mem_efficient_sdp),
    "math": (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
    "cudnn": (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
}


def switches() -> dict[str, bool]:
    return {name: bool(read()) for name, (read, _) in SWITCHES.items()}


@pytest.fixture
def restored_switches() -> Iterator[None]:
    before = switches()
    yield
    for name, (_, write) in SWITCHES.items():
        write(before[name])


def left_padded(built: zoo.ZooModel, rows: int, length: int, step: int) -> dict[str, torch.Tensor]:
    """`rows` prompts of `length` positions, row i padded on the left by `step * i` pad tokens (0)."""
    ids = built.inputs(rows, length, 5)["input_ids"].clone()
    mask = torch.ones_like(ids)
    for row in range(rows):
        ids[row, : step * row] = 0
        mask[row, : step * row] = 0
    return {"input_ids": ids, "attention_mask": mask}


def attention_calls(run: Callable[[], object]) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    return {event.key: event.count for event in profile.key_averages() if event.key == FLASH_CPU}


@pytest.mark.slow
@pytest.mark.exhaustive
def test_the_compiled_steps_attention_is_chosen_among_the_repeatable_backends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Narrowed to the math backend (which inductor decomposes into plain products), the compiled steps call
    the CPU's flash attention kernel no more: only transformers' eager prefill does (two layers, one call each),
    where without the restriction each compiled step would call it too."""
    built = zoo.build("llama")
    model, inputs = cachelife.enable(built.model), built.inputs(2, 7, 0)
    settings: dict[str, Any] = {"max_new_tokens": 6, "min_new_tokens": 6}
    expected = zoo.generate_tokens(model, inputs, **settings)
    monkeypatch.setattr(repeatable, "REPEATABLE_ATTENTION", (SDPBackend.MATH,))
    tokens: list[object] = []
    calls = attention_calls(lambda: tokens.append(cachelife.generate(model, fallback=False, **inputs, **settings)))
    assert calls.get(FLASH_CPU) == 2  # the prefill's
    assert isinstance(tokens[0], torch.Tensor)
    assert torch.equal(tokens[0], expected)


@pytest.mark.slow
def test_a_compiled_step_is_kept_by_torchs_aot_autograd_cache() -> None:
    """The restriction's calls in the step's graph are marked cacheable: AOTAutograd looks the step up in its
    cache (a hit or a miss that saves it) instead of passing it by, which would run AOTAutograd on the step
    again in every process however warm its compile cache."""
    built = zoo.build("llama")
    model, inputs = cachelife.enable(built.model), built.inputs(1, 5, 0)
    counters.clear()
    cachelife.generate(model, fallback=False, **inputs, max_new_tokens=3, min_new_tokens=3)
    aot = dict(counters["aot_autograd"])
    assert aot.get("total", 0) >= 1, aot  # the step was compiled here
    assert aot.get("autograd_cache_bypass", 0) == 0, aot
    assert aot.get("autograd_cache_hit", 0) + aot.get("autograd_cache_saved", 0) == aot["total"], aot


def test_a_users_own_cacheable_functions_stay_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._inductor.config, "unsafe_marked_cacheable_functions", {"my.op": "v1"})
    marked = repeatable.cacheable_switch_calls()
    assert marked["my.op"] == "v1"
    assert marked["torch.nn.attention._sdpa_kernel"] == torch.__version__
    assert marked["torch.nn.attention._backend_from_string"] == torch.__version__
    assert torch._inductor.config.unsafe_marked_cacheable_functions == {"my.op": "v1"}  # left as it was


def test_cudnn_attention_is_left_out_and_math_attention_is_always_there() -> None:
    assert SDPBackend.CUDNN_ATTENTION not in repeatable.REPEATABLE_ATTENTION
    assert SDPBackend.MATH in repeatable.REPEATABLE_ATTENTION  # every input has a backend


class SwitchWatch(BaseStreamer):
    """Records the process's attention switches each time the loop hands over tokens."""

    def __init__(self) -> None:
        self.seen: list[dict[str, bool]] = []

    def put(self, value: torch.Tensor) -> None:
        self.seen.append(switches())

    def end(self) -> None:
        self.seen.append(switches())


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.usefixtures("restored_switches")
def test_the_process_attention_switches_are_left_as_they_were() -> None:
    """A user's own choice (cuDNN's and flash attention switched off here) holds while a compiled call decodes
    and after it: cachelife's restriction lives in the compiled step, not in the process's switches."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_flash_sdp(False)
    before = switches()
    built = zoo.build("llama")
    model, watch = cachelife.enable(built.model), SwitchWatch()
    cachelife.generate(model, fallback=False, streamer=watch, **built.inputs(1, 5, 0), max_new_tokens=4)
    assert switches() == before
    assert len(watch.seen) >= 4
    assert all(state == before for state in watch.seen)


@pytest.mark.usefixtures("restored_switches")
def test_eager_steps_restrict_the_switches_once_for_all_threads_and_give_them_back() -> None:
    """Eager steps on CUDA run within `restricted_switches`: threads that enter and leave in any order see
    cuDNN's attention off while any is within, and the user's switches (flash attention off here) come back
    when the last one leaves."""
    torch.backends.cuda.enable_flash_sdp(False)
    before = switches()
    inside: list[dict[str, bool]] = []
    entered, release = threading.Barrier(3), threading.Event()

    def step() -> None:
        with repeatable.restricted_switches():
            entered.wait()
            release.wait()
            inside.append(switches())

    threads = [threading.Thread(target=step) for _ in range(2)]
    for thread in threads:
        thread.start()
    entered.wait()
    inside.append(switches())
    release.set()
    for thread in threads:
        thread.join()
    assert inside == [{**before, "cudnn": False}] * 3  # flash stays off: the restriction keeps the user's choice
    assert switches() == before


def generate_output(model: PreTrainedModel, **settings: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """`cachelife.generate`'s tokens and scores."""
    output = cachelife.generate(model, fallback=False, return_dict_in_generate=True, output_scores=True, **settings)
    if not isinstance(output, ModelOutput):
        pytest.fail(f"cachelife.generate returned a {type(output).__name__}")
    return output["sequences"], tuple(output["scores"])


def assert_repeats(outputs: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]) -> None:
    """Every call's tokens and scores equal the first call's, bit for bit."""
    first_tokens, first_scores = outputs[0]
    for call, (tokens, scores) in enumerate(outputs[1:], start=2):
        assert torch.equal(tokens, first_tokens), f"call {call}: other tokens than call 1"
        assert len(scores) == len(first_scores)
        for step, (score, first) in enumerate(zip(scores, first_scores, strict=True)):
            assert torch.equal(score, first), f"call {call}, step {step}: other scores than call 1"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.exhaustive), torch.bfloat16])
def test_identical_calls_give_identical_tokens_and_scores_on_the_cpu(dtype: torch.dtype) -> None:
    built = zoo.build("llama", dtype=dtype)
    model = cachelife.enable(built.model)
    inputs = left_padded(built, 3, 12, 4)
    for compile_step in (True, False):
        settings = {**inputs, "max_new_tokens": 8, "compile_step": compile_step}
        assert_repeats([generate_output(model, **settings) for _ in range(3)])


# -- on a GPU: the padded Llama batch that did not repeat with cuDNN's attention -----------------------------

CALLS = 4
NEW = 64


def llama_1b_layers(layers: int = 2) -> LlamaForCausalLM:
    """The Llama-3.2-1B shape (hidden 2048, 32 query heads and 8 key/value heads of 64) with `layers` layers and
    a smaller vocabulary, bf16 on the GPU, random weights (seed 0)."""
    config = LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


def padded_batch(model: PreTrainedModel, *, padded: bool) -> dict[str, torch.Tensor]:
    """8 prompts of 128 positions, row i left-padded by 17 * i pad tokens (with `padded`), as a tokenizer with
    `padding=True` gives them."""
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(5, 32000, (8, 128), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(8 if padded else 0):
        ids[row, : 17 * row] = 0
        mask[row, : 17 * row] = 0
    return {"input_ids": ids.to(model.device), "attention_mask": mask.to(model.device)}


GPU_PATHS: dict[str, dict[str, Any]] = {
    "enabled": {},
    "enabled-4-steps": {"steps_per_call": 4},
    "not-enabled": {},
    "eager-step": {"compile_step": False},
    "kernel-options": {"compile_options": cachelife.FAST_KERNELS},
    "torch-graphs": {"cuda_graphs": "torch"},
}


# Every path on the padded batch, and the default one without padding too.
GPU_CASES = [*((path, True) for path in GPU_PATHS), ("enabled", False)]


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
@pytest.mark.parametrize(
    ("path", "padded"), GPU_CASES, ids=[f"{path}-{'padded' if padded else 'unpadded'}" for path, padded in GPU_CASES]
)
def test_four_identical_calls_give_identical_tokens_and_scores_on_cuda(path: str, padded: bool) -> None:
    model = llama_1b_layers()
    if path == "kernel-options":
        cachelife.enable(
            model, options=cachelife.Options(fuse_projections=True, decode_attention=True, small_linear=True)
        )
    elif path != "not-enabled":
        cachelife.enable(model)
    inputs = padded_batch(model, padded=padded)
    settings = {**inputs, "max_new_tokens": NEW, "min_new_tokens": NEW, **GPU_PATHS[path]}
    assert_repeats([generate_output(model, **settings) for _ in range(CALLS)])


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
def test_four_identical_rounds_of_engine_requests_give_identical_tokens_on_cuda() -> None:
    """The padded batch's prompts (padding removed: a request is one sequence) as 8 requests on 8 rows, four
    rounds on one engine: each request's tokens are the same in every round."""
    model = llama_1b_layers()
    inputs = padded_batch(model, padded=True)
    prompts = [ids[mask.bool()][None] for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"], strict=True)]
    rounds: list[list[torch.Tensor]] = []
    with Engine(model, rows=8, max_length=128 + NEW) as engine:
        for _ in range(CALLS):
            futures = [engine.submit(input_ids=ids, max_new_tokens=NEW, min_new_tokens=NEW) for ids in prompts]
            rounds.append([future.result(timeout=600) for future in futures])
    for number, tokens in enumerate(rounds[1:], start=2):
        for request, (got, first) in enumerate(zip(tokens, rounds[0], strict=True)):
            assert torch.equal(got, first), f"round {number}, request {request}: other tokens than round 1"
