"""Beam search on pinned caches: reorders in place, replaced tensors detected, CUDA-graph skips explained.

Every generation test compares tokens with eager transformers beam search on a dynamic cache, and checks that
every layer, self- and cross-attention, still holds the tensors it was pinned with (same data pointers).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from torch._dynamo.utils import counters
from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter
from transformers import PreTrainedModel
from transformers.cache_utils import EncoderDecoderCache, StaticCache, StaticLayer

import cachelife
from cachelife.core import reorder
from cachelife.core.cache_lifecycle import CacheLifecycle
from cachelife.core.layer_lifecycle import Filled, Pinned
from cachelife.errors import ReplacedBuffersError
from cachelife.integration import skips
from cachelife.integration.call_arguments import cache_argument_name, find_cache
from cachelife.integration.guard import OnUnpinned
from cachelife.tools import zoo

NEW_TOKENS = 7
# (num_beams, extra settings): every option transformers' beam search takes, each at least once.
BEAM_SETTINGS: list[dict[str, Any]] = [
    {"num_beams": 2},
    {"num_beams": 3, "num_return_sequences": 2, "early_stopping": True},
    {"num_beams": 4, "early_stopping": False, "length_penalty": 0.5},
    {"num_beams": 5, "early_stopping": "never", "length_penalty": 2.0, "num_return_sequences": 5},
]


def transformer_class(name: str) -> Any:
    """A transformers class the stubs in typings/ do not describe."""
    return getattr(transformers, name)


def gemma2_sliding() -> zoo.ZooModel:
    """A decoder with sliding-window and full-attention layers (window 3, shorter than every prompt)."""
    config = transformer_class("Gemma2Config")(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, sliding_window=3, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model: PreTrainedModel = transformer_class("Gemma2ForCausalLM")(config).eval()

    def inputs(batch_size: int, length: int, seed: int) -> zoo.Inputs:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, 96, (batch_size, length), generator=generator)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    return zoo.ZooModel(model, inputs)


BUILDERS: dict[str, Callable[[], zoo.ZooModel]] = {
    "t5": lambda: zoo.build("t5"),
    "bart": lambda: zoo.build("bart"),
    "whisper": lambda: zoo.build("whisper"),
    "llama": lambda: zoo.build("llama"),
    "gemma2-sliding": gemma2_sliding,
}


class CachesSeen:
    """Records every distinct cache the model's forward is called with (a forward pre-hook)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.caches: list[object] = []

    def __enter__(self) -> CachesSeen:
        self.handle = self.model.register_forward_pre_hook(self.record, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()

    def record(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = find_cache(kwargs)
        if cache is not None and not any(cache is seen for seen in self.caches):
            self.caches.append(cache)


def settings_with_finishing_beams(built: zoo.ZooModel, inputs: zoo.Inputs, beams: dict[str, Any]) -> dict[str, Any]:
    """Beam settings whose end-of-sequence token is one greedy search emits early, so that beams finish and
    `early_stopping` and `length_penalty` change the result."""
    greedy = zoo.generate_tokens(built.model, inputs, do_sample=False, max_new_tokens=3, disable_compile=True)
    return {"do_sample": False, "max_new_tokens": NEW_TOKENS, "eos_token_id": int(greedy[0, -2]), **beams}


def eager_beam_search(built: zoo.ZooModel, inputs: zoo.Inputs, settings: dict[str, Any]) -> torch.Tensor:
    return zoo.generate_tokens(built.model, inputs, **settings, disable_compile=True)


def buffers_of(layer: StaticLayer) -> dict[str, torch.Tensor]:
    assert layer.keys is not None
    assert layer.values is not None
    return {"keys": layer.keys, "values": layer.values}


def static_cache(cache: StaticCache | EncoderDecoderCache) -> StaticCache:
    assert isinstance(cache, StaticCache)
    return cache


def assert_holds_pinned_tensors(state: CacheLifecycle) -> None:
    for layer in state.storage_layers:
        current = layer.state
        assert isinstance(current, Pinned | Filled), layer.describe()
        live = {name: tensor.data_ptr() for name, tensor in buffers_of(layer.layer).items()}
        pinned = dict(current.buffers.data_ptrs)
        assert live == {name: pinned[name] for name in live}, layer.describe()
        assert layer.replaced_tensors() == [], layer.describe()
        assert reorder.is_in_place(layer.layer), layer.describe()


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("beams", BEAM_SETTINGS, ids=lambda b: "-".join(f"{k}={v}" for k, v in b.items()))
def test_beam_search_with_generates_static_cache_equals_eager_and_keeps_every_address(
    name: str, beams: dict[str, Any]
) -> None:
    built = BUILDERS[name]()
    inputs = built.inputs(2, 6, 1)
    settings = settings_with_finishing_beams(built, inputs, beams)
    expected = eager_beam_search(built, inputs, settings)
    cachelife.enable(built.model, on_unpinned="raise")  # a replaced tensor would raise
    with CachesSeen(built.model) as seen:
        tokens = zoo.generate_tokens(built.model, inputs, **settings, cache_implementation="static")
    assert torch.equal(tokens, expected)
    assert len(seen.caches) == 1
    assert_holds_pinned_tensors(cachelife.lifecycle(seen.caches[0]))


@pytest.mark.parametrize("name", list(BUILDERS))
def test_beam_search_through_a_prepared_cache_equals_eager_and_keeps_every_address(name: str) -> None:
    built = BUILDERS[name]()
    model = built.model
    inputs = built.inputs(2, 6, 2)
    settings = settings_with_finishing_beams(built, inputs, {"num_beams": 3, "length_penalty": 1.5})
    expected = eager_beam_search(built, inputs, settings)
    encoder_length = _encoder_length(model, inputs)
    cache = cachelife.prepare_static_cache(model, batch_size=6, max_cache_len=32, encoder_length=encoder_length)
    state = cachelife.lifecycle(cache)
    before = [layer.state.buffers.data_ptrs for layer in state.layers if isinstance(layer.state, Pinned)]
    cachelife.enable(model, on_unpinned="raise")
    tokens = zoo.generate_tokens(model, inputs, **settings, **{cache_argument_name(model): cache})
    assert torch.equal(tokens, expected)
    assert_holds_pinned_tensors(state)
    assert [layer.state.buffers.data_ptrs for layer in state.layers if isinstance(layer.state, Filled)] == before


def _encoder_length(model: PreTrainedModel, inputs: zoo.Inputs) -> int | None:
    if not model.config.is_encoder_decoder:
        return None
    encoder_inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "input_features")}
    return int(model.get_encoder()(**encoder_inputs)[0].shape[1])


def test_in_place_reorder_gathers_rows_into_the_same_tensors_without_reading_the_length() -> None:
    built = zoo.build("llama")
    cache = static_cache(cachelife.prepare_static_cache(built.model, batch_size=3, max_cache_len=8))
    layer = cache.layers[0]
    keys_before, values_before = layer.keys, layer.values
    assert keys_before is not None
    assert values_before is not None
    keys_before.copy_(torch.arange(3.0).view(3, 1, 1, 1).expand_as(keys_before))
    expected = keys_before.index_select(0, torch.tensor([2, 2, 0]))
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert layer.keys is keys_before
    assert layer.values is values_before
    assert torch.equal(layer.keys, expected)


def test_cross_attention_rows_shared_within_beams_are_left_in_place_by_generate() -> None:
    built = zoo.build("t5")
    inputs = built.inputs(2, 6, 3)
    cachelife.enable(built.model)
    with CachesSeen(built.model) as seen:
        zoo.generate_tokens(built.model, inputs, num_beams=3, max_new_tokens=4, cache_implementation="static")
    state = cachelife.lifecycle(seen.caches[0])
    assert all(reorder.rows_shared_within_beams(layer.layer) for layer in state.cross_attention)
    assert not any(reorder.rows_shared_within_beams(layer.layer) for layer in state.self_attention)
    keys = state.cross_attention[0].layer.keys
    assert keys is not None
    # Every beam of one input holds the same encoder keys, so skipping their reorder changes nothing.
    assert torch.equal(keys[0], keys[1])
    assert torch.equal(keys[0], keys[2])
    state.reset()
    assert not any(reorder.rows_shared_within_beams(layer.layer) for layer in state.cross_attention)


def test_a_deep_copy_of_a_pinned_cache_reorders_its_own_tensors() -> None:
    built = zoo.build("llama")
    cache = static_cache(cachelife.prepare_static_cache(built.model, batch_size=2, max_cache_len=4))
    keys = buffers_of(cache.layers[0])["keys"]
    keys.copy_(torch.arange(2.0).view(2, 1, 1, 1).expand_as(keys))
    twin = copy.deepcopy(cache)
    twin.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(buffers_of(twin.layers[0])["keys"][0], keys[1])
    assert torch.equal(keys[0], torch.zeros_like(keys[0]))  # the original is untouched


def test_release_gives_a_layer_back_transformers_reorder() -> None:
    built = zoo.build("llama")
    cache = static_cache(cachelife.prepare_static_cache(built.model, batch_size=2, max_cache_len=8))
    layer = cache.layers[0]
    assert "reorder_cache" in layer.__dict__
    cachelife.lifecycle(cache).release()
    assert "reorder_cache" not in layer.__dict__
    assert layer.reorder_cache.__func__ is type(layer).reorder_cache


def test_an_unmanaged_cache_keeps_transformers_reorder() -> None:
    built = zoo.build("llama")
    cache = transformers.StaticCache(config=built.model.config, max_cache_len=8)
    assert not any("reorder_cache" in layer.__dict__ for layer in cache.layers)


class ReplacesKeysAtStep:
    """A decoder pre-hook that swaps one layer's keys for a copy at one step, as code outside cachelife might."""

    def __init__(self, cache_layer: Callable[[], Any], step: int) -> None:
        self.cache_layer = cache_layer
        self.step = step
        self.calls = 0

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.calls += 1
        if self.calls == self.step:
            layer = self.cache_layer()
            layer.keys = layer.keys.clone()


def _replacing_run(on_unpinned: OnUnpinned) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    built = zoo.build("llama")
    model = built.model
    inputs = built.inputs(2, 5, 4)
    expected = zoo.generate_tokens(model, inputs, do_sample=False, max_new_tokens=6, disable_compile=True)
    cache = static_cache(cachelife.prepare_static_cache(model, batch_size=2, max_cache_len=16))
    layer = cache.layers[1]
    pinned_keys = layer.keys
    cachelife.enable(model, on_unpinned=on_unpinned)
    hook = model.get_decoder().register_forward_pre_hook(ReplacesKeysAtStep(lambda: layer, 3), with_kwargs=True)
    try:
        tokens = zoo.generate_tokens(
            model, inputs, do_sample=False, max_new_tokens=6, **{cache_argument_name(model): cache}
        )
    finally:
        hook.remove()
    assert layer.keys is pinned_keys
    return tokens, expected, [layer]


def test_replaced_tensors_are_restored_at_the_next_boundary_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="cachelife"):
        tokens, expected, _ = _replacing_run("pin")
    assert torch.equal(tokens, expected)
    warnings = [r.getMessage() for r in caplog.records if "not pinned with" in r.getMessage()]
    assert len(warnings) == 1
    assert "layer 1 (self-attention): keys" in warnings[0]
    assert "copied their content back" in warnings[0]
    assert "on_unpinned='raise'" in warnings[0]


def test_replaced_tensors_raise_when_asked_to() -> None:
    with pytest.raises(ReplacedBuffersError, match=r"layer 1 \(self-attention\): keys.*write into it in place"):
        _replacing_run("raise")


def test_replaced_tensors_that_do_not_fit_are_refused_and_nothing_changes() -> None:
    built = zoo.build("llama")
    cache = static_cache(cachelife.prepare_static_cache(built.model, batch_size=2, max_cache_len=8))
    state = cachelife.lifecycle(cache)
    layer = state.layers[0]
    foreign = torch.zeros(1, 2, 8, 8)
    cache.layers[0].keys = foreign
    assert state.replaced()[0][1] == ["keys"]
    with pytest.raises(ReplacedBuffersError, match=r"keys is now \(1, 2, 8, 8\) float32 on cpu, pinned as \(2,"):
        layer.restore_buffers()
    assert cache.layers[0].keys is foreign
    assert isinstance(layer.state, Pinned)


class SkipsOnce:
    """Stands in for a compiled forward during which torch logged one CUDA-graph skip (a CPU never skips)."""

    def __init__(self, forward: Callable[..., Any], reason: str) -> None:
        self.forward = forward
        self.reason = reason
        self.done = False
        self._torchdynamo_orig_callable = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.done:
            self.done = True
            log_cudagraph_skip_and_bump_counter(f"skipping cudagraphs due to {self.reason}")
        return self.forward(*args, **kwargs)


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("mutated inputs (12 instances). Found from : \n File x.py", "a buffer of your own"),
        ("cpu device (arg3_1). Found from : \n File x.py", "move every input"),
        ("something new in torch", "no advice for"),
    ],
)
def test_a_cudagraph_skip_is_reported_with_torchs_reason_and_its_fix(
    caplog: pytest.LogCaptureFixture, reason: str, expected: str
) -> None:
    built = zoo.build("llama")
    model = built.model
    cachelife.enable(model)
    before = counters["inductor"]["cudagraph_skips"]
    model.forward = SkipsOnce(model.forward, reason)  # type: ignore[method-assign]  # a stand-in compiled forward
    try:
        with caplog.at_level(logging.WARNING, logger="cachelife"):
            for _ in range(2):
                zoo.generate_tokens(model, built.inputs(2, 5, 1), max_new_tokens=3, cache_implementation="static")
    finally:
        counters["inductor"]["cudagraph_skips"] = before
    warnings = [r.getMessage() for r in caplog.records if "skipped CUDA graphs" in r.getMessage()]
    assert len(warnings) == 1
    assert "for 1 compiled graph(s) while LlamaForCausalLM decoded" in warnings[0]
    assert f"'{reason.splitlines()[0]}'" in warnings[0]
    assert expected in warnings[0]
    # torch 2.13 keys its compile cache on static inputs: the stale-cache advice would mislead.
    assert "TORCHINDUCTOR_CACHE_DIR" not in warnings[0]
    assert ("pinned_compile_cache" in warnings[0]) == skips.compile_cache_likely(
        reason, caches_hold_pinned_tensors=True, torch_version=torch.__version__
    )


def test_the_compile_cache_is_suspected_only_for_mutated_inputs_on_old_torch_with_intact_caches() -> None:
    likely = skips.compile_cache_likely
    assert likely("mutated inputs (3 instances)", caches_hold_pinned_tensors=True, torch_version="2.11.0+cu130")
    assert likely("mutated inputs (3 instances)", caches_hold_pinned_tensors=True, torch_version="2.12.1")
    assert not likely("mutated inputs (3 instances)", caches_hold_pinned_tensors=True, torch_version="2.13.0+cpu")
    assert not likely("mutated inputs (3 instances)", caches_hold_pinned_tensors=False, torch_version="2.11.0")
    assert not likely("cpu device (arg0)", caches_hold_pinned_tensors=True, torch_version="2.11.0")
    text = skips.describe(["mutated inputs (1 instances)"], caches_hold_pinned_tensors=True)
    assert ("pinned_compile_cache" in text) == (torch.__version__ < "2.13")
