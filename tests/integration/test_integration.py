"""cachelife inside transformers, eagerly (fast): enable/disable, the decoding boundary, prepare_static_cache.

Every generation test compares tokens with eager transformers generation using a dynamic cache.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import LlamaForCausalLM, PreTrainedModel, T5ForConditionalGeneration
from transformers.cache_utils import EncoderDecoderCache, StaticCache, StaticLayer

import cachelife
from cachelife.core.cache_lifecycle import CacheLifecycle, is_managed_cache, static_parts
from cachelife.core.layer_lifecycle import Filled, Pinned
from cachelife.core.shapes import CacheShapes, LayerShape
from cachelife.errors import CacheShapeError, InvalidArgumentError, UnpinnedCacheError, UnsupportedCacheError
from cachelife.integration.call_arguments import cache_argument_name, find_cache
from cachelife.integration.compiled import eager_forward, is_compiled
from cachelife.tools import zoo

NEW_TOKENS = 6
SETTINGS: dict[str, Any] = {"do_sample": False, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}
ENCODER_DECODER = ("t5", "bart", "whisper")


def reference(built: zoo.ZooModel, inputs: zoo.Inputs) -> torch.Tensor:
    """Eager transformers generation with a dynamic cache."""
    return zoo.generate_tokens(built.model, inputs, **SETTINGS, disable_compile=True)


def decoder_of(model: PreTrainedModel) -> torch.nn.Module:
    return model.get_decoder()


class FirstCallRecorder:
    """A forward pre-hook on the decoder that records every layer's state when the decoder first runs."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.states: list[list[str]] = []
        self.lifecycles: list[CacheLifecycle] = []
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = find_cache(kwargs)
        if cache is None or not is_managed_cache(cache):
            return
        state = cachelife.lifecycle(cache)
        if not self.lifecycles or self.lifecycles[-1] is not state:
            self.lifecycles.append(state)
            self.states.append([type(layer.state).__name__ for layer in state.layers])


@pytest.mark.parametrize("name", [*ENCODER_DECODER, "llama"])
def test_generate_with_static_cache_pins_before_the_first_forward(name: str) -> None:
    built = zoo.build(name)
    inputs = built.inputs(2, 9, 1)
    expected = reference(built, inputs)
    cachelife.enable(built.model)
    recorder = FirstCallRecorder(decoder_of(built.model))
    for _ in range(2):
        tokens = zoo.generate_tokens(built.model, inputs, **SETTINGS, cache_implementation="static")
        assert torch.equal(tokens, expected)
    assert len(recorder.states) == 2  # a fresh cache per generate call, as transformers builds it
    for states, state in zip(recorder.states, recorder.lifecycles, strict=True):
        assert states == ["Pinned"] * len(states)
        assert {layer.role for layer in state.layers} == ({"self", "cross"} if name != "llama" else {"self"})
        assert all(isinstance(layer.state, Filled) for layer in state.layers)


def test_generate_without_enable_leaves_caches_to_lazy_allocation() -> None:
    built = zoo.build("t5")
    recorder = FirstCallRecorder(decoder_of(built.model))
    zoo.generate_tokens(built.model, built.inputs(2, 9, 1), **SETTINGS, cache_implementation="static")
    assert recorder.states == [["Unallocated"] * 4]


def test_dynamic_cache_generation_is_left_alone() -> None:
    built = zoo.build("bart")
    inputs = built.inputs(2, 9, 1)
    expected = reference(built, inputs)
    cachelife.enable(built.model)
    recorder = FirstCallRecorder(decoder_of(built.model))
    assert torch.equal(zoo.generate_tokens(built.model, inputs, **SETTINGS), expected)
    assert recorder.states == []


def test_beams_and_return_sequences_size_the_batch() -> None:
    built = zoo.build("t5")
    inputs = built.inputs(2, 9, 1)
    settings = {**SETTINGS, "num_beams": 3, "num_return_sequences": 2}
    expected = zoo.generate_tokens(built.model, inputs, **settings, disable_compile=True)
    cachelife.enable(built.model)
    recorder = FirstCallRecorder(decoder_of(built.model))
    tokens = zoo.generate_tokens(built.model, inputs, **settings, cache_implementation="static")
    assert torch.equal(tokens, expected)
    first = recorder.lifecycles[0].layers[0].state
    assert isinstance(first, Pinned | Filled)
    assert first.buffers.key_shape[0] == 6  # batch 2 x 3 beams


class ReplacesCrossCache(T5ForConditionalGeneration):
    """A model whose own cache preparation swaps in a fresh, unallocated cross-attention cache."""

    def _prepare_cache_for_generation(self, *args: Any, **kwargs: Any) -> None:
        super()._prepare_cache_for_generation(*args, **kwargs)
        model_kwargs = kwargs["model_kwargs"] if "model_kwargs" in kwargs else args[1]
        cache = find_cache(model_kwargs)
        if isinstance(cache, EncoderDecoderCache) and isinstance(cache.cross_attention_cache, StaticCache):
            length = cache.cross_attention_cache.layers[0].max_cache_len
            cache.cross_attention_cache = StaticCache(config=self.config, max_cache_len=length)


def test_model_override_that_replaces_the_cross_cache_still_decodes_pinned() -> None:
    torch.manual_seed(0)
    model = ReplacesCrossCache(zoo.t5_tiny()).eval()
    built = zoo.ZooModel(model, zoo.build("t5").inputs)
    inputs = built.inputs(2, 9, 1)
    expected = reference(built, inputs)
    cachelife.enable(model)
    recorder = FirstCallRecorder(decoder_of(model))
    assert torch.equal(zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static"), expected)
    assert recorder.states == [["Pinned"] * 4]


class ReplacesCacheAtDecodeTime(T5ForConditionalGeneration):
    """Replaces the cross-attention cache after preparation, on the way into the first forward call."""

    def prepare_inputs_for_generation(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        inputs: dict[str, Any] = super().prepare_inputs_for_generation(*args, **kwargs)
        cache = find_cache(inputs)
        if (
            isinstance(cache, EncoderDecoderCache)
            and isinstance(cache.cross_attention_cache, StaticCache)
            and not cache.is_updated.get(0, False)
        ):
            length = cache.cross_attention_cache.layers[0].max_cache_len
            if cache.cross_attention_cache.layers[0].is_initialized:
                cache.cross_attention_cache = StaticCache(config=self.config, max_cache_len=length)
        return inputs


def late_replacing_model() -> zoo.ZooModel:
    torch.manual_seed(0)
    return zoo.ZooModel(ReplacesCacheAtDecodeTime(zoo.t5_tiny()).eval(), zoo.build("t5").inputs)


def test_boundary_pins_a_cache_replaced_after_preparation_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    built = late_replacing_model()
    inputs = built.inputs(2, 9, 1)
    expected = reference(built, inputs)
    cachelife.enable(built.model)
    recorder = FirstCallRecorder(decoder_of(built.model))
    with caplog.at_level(logging.WARNING, logger="cachelife"):
        tokens = zoo.generate_tokens(built.model, inputs, **SETTINGS, cache_implementation="static")
    assert torch.equal(tokens, expected)
    assert recorder.states == [["Pinned"] * 4]
    warnings = [r.getMessage() for r in caplog.records if r.name == "cachelife.integration.guard"]
    assert len(warnings) == 1
    assert "layer 0 (cross-attention), layer 1 (cross-attention)" in warnings[0]
    assert "pinned there" in warnings[0]


def test_boundary_refuses_a_late_cache_when_asked_to() -> None:
    built = late_replacing_model()
    cachelife.enable(built.model, on_unpinned="raise")
    with pytest.raises(UnpinnedCacheError, match=r"2 of 4 cache layers are not pinned: layer 0 \(cross-attention\)"):
        zoo.generate_tokens(built.model, built.inputs(2, 9, 1), **SETTINGS, cache_implementation="static")


def test_forward_with_an_unpinned_hand_built_cache() -> None:
    built = zoo.build("llama")
    model = built.model
    cachelife.enable(model)
    cache = StaticCache(config=model.config, max_cache_len=16)
    ids = built.inputs(2, 5, 1)["input_ids"]
    eager = model(input_ids=ids, **{cache_argument_name(model): StaticCache(config=model.config, max_cache_len=16)})
    out = model(input_ids=ids, **{cache_argument_name(model): cache})
    assert torch.equal(out.logits, eager.logits)
    assert cachelife.lifecycle(cache).is_filled


def test_encoder_longer_than_the_pinned_cross_cache_is_refused() -> None:
    built = zoo.build("bart")
    model = built.model
    cachelife.enable(model)
    cache = cachelife.prepare_static_cache(model, batch_size=2, max_cache_len=8, encoder_length=4)
    inputs = built.inputs(2, 9, 1)
    with pytest.raises(
        CacheShapeError, match="encoder output has 9 positions but layer 0 \\(cross-attention\\) holds 4"
    ):
        zoo.generate_tokens(model, inputs, **SETTINGS, **{cache_argument_name(model): cache})
    assert all(isinstance(layer.state, Pinned) for layer in cachelife.lifecycle(cache).layers)


@pytest.mark.parametrize("name", [*ENCODER_DECODER, "llama"])
def test_prepare_static_cache_is_pinned_and_generates_like_eager(name: str) -> None:
    built = zoo.build(name)
    model = built.model
    inputs = built.inputs(2, 9, 1)
    expected = reference(built, inputs)
    encoder_length = None
    if model.config.is_encoder_decoder:
        encoder_length = int(model.get_encoder()(**_encoder_inputs(inputs))[0].shape[1])
    cache = cachelife.prepare_static_cache(model, batch_size=2, max_cache_len=32, encoder_length=encoder_length)
    state = cachelife.lifecycle(cache)
    state.require_pinned()
    if encoder_length is None:
        assert isinstance(cache, StaticCache)
    else:
        assert isinstance(cache, EncoderDecoderCache)
        _, _, cross = static_parts(cache)
        assert cross is not None
        assert all(type(layer) is StaticLayer for layer in cross.layers)
        assert {layer.buffers.key_shape[2] for layer in state.cross_attention} == {encoder_length}
    cachelife.enable(model)  # so that the forward calls record the content they write
    tokens = zoo.generate_tokens(model, inputs, **SETTINGS, **{cache_argument_name(model): cache})
    assert torch.equal(tokens, expected)
    assert state.is_filled


def _encoder_inputs(inputs: zoo.Inputs) -> zoo.Inputs:
    return {key: value for key, value in inputs.items() if key in ("input_ids", "attention_mask", "input_features")}


def test_prepare_static_cache_checks_its_arguments() -> None:
    t5, llama = zoo.build("t5").model, zoo.build("llama").model
    with pytest.raises(CacheShapeError, match="encoder-decoder model: pass encoder_length"):
        cachelife.prepare_static_cache(t5, batch_size=2, max_cache_len=8)
    with pytest.raises(CacheShapeError, match="decoder-only"):
        cachelife.prepare_static_cache(llama, batch_size=2, max_cache_len=8, encoder_length=3)
    for bad in (0, -1, 2.5, True):  # wrong values, and wrong types on purpose
        with pytest.raises(CacheShapeError, match="batch_size must be a positive int"):
            cachelife.prepare_static_cache(llama, batch_size=bad, max_cache_len=8)  # type: ignore[arg-type]
    with pytest.raises(CacheShapeError, match="max_cache_len must be a positive int"):
        cachelife.prepare_static_cache(llama, batch_size=1, max_cache_len=0)


def test_prepare_static_cache_sizes_t5_by_its_decoder() -> None:
    torch.manual_seed(0)
    config = zoo.t5_tiny()
    config.num_decoder_layers = 3
    model = T5ForConditionalGeneration(config).eval()
    cache = cachelife.prepare_static_cache(model, batch_size=1, max_cache_len=4, encoder_length=5)
    _, own, cross = static_parts(cache)
    assert len(own.layers) == 3
    assert cross is not None
    assert len(cross.layers) == 3


def test_enable_is_idempotent_and_disable_restores_the_model_exactly() -> None:
    model = zoo.build("t5").model
    attributes = dict(model.__dict__)
    hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
    cachelife.enable(model)
    assert cachelife.is_enabled(model)
    assert cachelife.enable(model) is model
    assert len(model._forward_pre_hooks) == 1
    cachelife.disable(model)
    cachelife.disable(model)
    assert not cachelife.is_enabled(model)
    assert dict(model.__dict__) == attributes
    assert (dict(model._forward_pre_hooks), dict(model._forward_hooks)) == hooks
    assert type(model)._prepare_cache_for_generation is T5ForConditionalGeneration._prepare_cache_for_generation


def test_disable_restores_an_instance_attribute_that_was_there_before() -> None:
    model = zoo.build("llama").model
    own = model.get_compiled_call
    model.__dict__["get_compiled_call"] = own
    cachelife.enable(model)
    assert model.__dict__["get_compiled_call"] is not own
    cachelife.disable(model)
    assert model.__dict__["get_compiled_call"] is own


def test_enable_refuses_what_it_cannot_guard() -> None:
    with pytest.raises(UnsupportedCacheError, match="needs a transformers generation model"):
        cachelife.enable(torch.nn.Linear(2, 2))  # type: ignore[arg-type]  # the misuse under test
    model = zoo.build("t5").model
    model.config.model_type = "unknown-seq2seq"
    before = dict(model.__dict__)
    with pytest.raises(
        UnsupportedCacheError, match="no shape rule for encoder-decoder models of type 'unknown-seq2seq'"
    ):
        cachelife.enable(model)
    assert dict(model.__dict__) == before
    with pytest.raises(InvalidArgumentError, match="on_unpinned must be 'pin' or 'raise'") as raised:
        cachelife.enable(model, on_unpinned="ignore")  # type: ignore[arg-type]  # the misuse under test
    assert isinstance(raised.value, ValueError)


class DeclaredT5(T5ForConditionalGeneration):
    """A model author's class that declares its cache shapes (the DeclaresCacheShapes extension point)."""

    declared: CacheShapes

    def cachelife_cache_shapes(self) -> CacheShapes:
        return self.declared


def test_declared_shapes_win_over_inference() -> None:
    torch.manual_seed(0)
    model = DeclaredT5(zoo.t5_tiny()).eval()
    assert isinstance(model, cachelife.DeclaresCacheShapes)
    model.declared = CacheShapes.uniform(2, LayerShape(4, 16, 16), LayerShape(4, 16, 16))
    cache = cachelife.prepare_static_cache(model, batch_size=1, max_cache_len=4, encoder_length=3)
    assert cachelife.lifecycle(cache).is_pinned
    model.declared = CacheShapes.uniform(2, LayerShape(2, 8, 8), LayerShape(4, 16, 16))
    cache = cachelife.prepare_static_cache(model, batch_size=1, max_cache_len=4, encoder_length=3)
    first = cachelife.lifecycle(cache).layers[0].state
    assert isinstance(first, Pinned)
    assert first.buffers.key_shape == (1, 2, 4, 8)


class T5WithLifecycle(cachelife.CacheLifecycleMixin, T5ForConditionalGeneration):
    """What a model author writes to ship cachelife with a model class."""


def test_mixin_enables_every_instance() -> None:
    torch.manual_seed(0)
    model = T5WithLifecycle(zoo.t5_tiny()).eval()
    assert cachelife.is_enabled(model)
    built = zoo.ZooModel(model, zoo.build("t5").inputs)
    inputs = built.inputs(2, 9, 1)
    expected = reference(built, inputs)
    recorder = FirstCallRecorder(decoder_of(model))
    assert torch.equal(zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static"), expected)
    assert recorder.states == [["Pinned"] * 4]


class LlamaWithLifecycle(cachelife.CacheLifecycleMixin, LlamaForCausalLM):
    """A decoder-only model class shipped with cachelife: fused projections by default."""


def test_a_mixin_model_from_pretrained_fuses_its_loaded_weights(tmp_path: Path) -> None:
    """`from_pretrained` builds the model on the meta device, where `__init__`'s `enable` finds nothing to fuse;
    the mixin applies the rewrites again to the loaded weights, and the tokens stay `generate`'s."""
    built = zoo.build("llama")
    inputs = built.inputs(2, 7, 1)
    expected = zoo.generate_tokens(built.model, inputs, **SETTINGS)
    built.model.save_pretrained(tmp_path)
    # transformers 5.25 loads hub kernels by default, which needs the `kernels` package; the weights are asked here.
    model = LlamaWithLifecycle.from_pretrained(tmp_path, use_kernels=False).eval()
    assert cachelife.is_enabled(model)
    fused = {buffer.untyped_storage().data_ptr() for name, buffer in model.named_buffers() if "cachelife_fused" in name}
    attention = model.model.layers[0].self_attn
    assert {attention.q_proj.weight.untyped_storage().data_ptr()} <= fused
    assert torch.equal(zoo.generate_tokens(model, inputs, **SETTINGS), expected)
    out = cachelife.generate(model, fallback=False, compile_step=False, **inputs, **SETTINGS)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, expected)


def test_mixin_refuses_classes_that_are_no_model() -> None:
    class NotAModel(cachelife.CacheLifecycleMixin):
        pass

    with pytest.raises(UnsupportedCacheError, match="must be mixed into a transformers PreTrainedModel"):
        NotAModel()


def test_a_latent_attention_model_pins_key_and_value_dims_that_differ_and_equals_eager() -> None:
    """DeepSeek-V3 caches its compressed latents: keys of kv_lora_rank, values of qk_rope_head_dim."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(  # type: ignore[attr-defined]  # not in typings/: used here only
        vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=64, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
        n_group=1, topk_group=1, pad_token_id=0, eos_token_id=None, bos_token_id=1,
    )  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(config).eval()  # type: ignore[attr-defined]  # likewise
    input_ids = torch.randint(3, 97, (2, 5))
    expected = model.generate(input_ids=input_ids, **SETTINGS)
    cachelife.enable(model, on_unpinned="raise")
    seen: list[list[tuple[int, ...]]] = []

    def record(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = find_cache(kwargs)
        if not seen and cache is not None:
            states = [layer.state for layer in cachelife.lifecycle(cache).layers]
            seen.append([(*s.buffers.key_shape, s.buffers.value_shape[-1]) for s in states if isinstance(s, Pinned)])

    model.register_forward_pre_hook(record, with_kwargs=True)
    tokens = model.generate(input_ids=input_ids, **SETTINGS, cache_implementation="static")
    assert torch.equal(tokens, expected)
    assert [[(batch, heads, keys, values) for batch, heads, _, keys, values in layers] for layers in seen] == [
        [(2, 1, 16, 8)] * 3
    ]


def test_compile_forward_installs_one_compiled_forward_and_restore_forward_undoes_it() -> None:
    model = zoo.build("llama").model
    eager = model.forward
    compiled = cachelife.compile_forward(model, backend="eager", fullgraph=True)
    assert model.forward is compiled
    assert is_compiled(model.forward)
    assert eager_forward(model) == eager
    again = cachelife.compile_forward(model, backend="eager")
    assert model.forward is again
    assert again is not compiled
    assert eager_forward(model) == eager  # compiled from the eager forward, not wrapped around the first one
    cachelife.restore_forward(model)
    assert "forward" not in model.__dict__
    assert model.forward == eager
    assert not is_compiled(model.forward)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (None, {"emulate_precision_casts": True}),
        ("reduce-overhead", {"triton.cudagraphs": True, "emulate_precision_casts": True}),
    ],
)
def test_compile_forward_adds_options_to_the_modes_own(
    mode: str | None, expected: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.compile takes a mode or options, not both: options are merged with what the mode sets."""
    model = zoo.build("llama").model
    seen: list[dict[str, Any]] = []

    def fake_compile(function: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return function

    monkeypatch.setattr(torch, "compile", fake_compile)
    cachelife.compile_forward(model, mode=mode, options={"emulate_precision_casts": True})
    cachelife.compile_forward(model, mode=mode)
    assert seen[0]["options"] == expected
    assert "mode" not in seen[0]
    assert seen[1]["mode"] == mode
    assert "options" not in seen[1]
