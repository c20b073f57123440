"""Encoder-length buckets: padded generation equals eager generation without padding, refusals, validation.

Every generation test compares tokens with eager transformers generation using a dynamic cache and no
padding. The compiled test at the end is slow (it compiles a model).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from torch._dynamo.utils import counters
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

import cachelife
from cachelife.core.cache_lifecycle import is_managed_cache
from cachelife.errors import InvalidBucketsError, UnsupportedGenerationError
from cachelife.generation.decode import decode
from cachelife.integration.buckets import BUCKETABLE_MODEL_TYPES, bucket_length, check_buckets
from cachelife.integration.call_arguments import find_cache
from cachelife.tools import zoo

NEW_TOKENS = 6
SETTINGS: dict[str, Any] = {"do_sample": False, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}
BUCKETS = (8, 16, 32)
# Inside a bucket, at a bucket's edge, just above an edge, and inside the largest bucket.
LENGTHS = (3, 8, 9, 16, 23)


def reference(model: PreTrainedModel, inputs: zoo.Inputs, **settings: Any) -> torch.Tensor:
    """Eager transformers generation with a dynamic cache and no padding."""
    return zoo.generate_tokens(model, inputs, **{**SETTINGS, **settings}, disable_compile=True)


def ragged(built: zoo.ZooModel, batch: int, length: int, seed: int) -> zoo.Inputs:
    """Inputs whose sequences have different real lengths (right-padded under the attention mask)."""
    inputs = built.inputs(batch, length, seed)
    for row in range(1, batch):
        inputs["attention_mask"][row, max(1, length - 2 * row) :] = 0
    return inputs


class SeenByForward:
    """Records, per cache, what the model's forward call received: the encoder length, the attention mask's
    shape, and the capacity of every cross-attention layer. Registered after `enable`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[tuple[int, tuple[int, ...] | None, set[int | None]]] = []
        # A weak reference: holding the cache would keep its buffers from returning to the pool.
        self._last: weakref.ref[object] | None = None
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = find_cache(kwargs)
        if cache is None or (self._last is not None and self._last() is cache):
            return
        self._last = weakref.ref(cache)
        mask = kwargs.get("attention_mask")
        capacities = (
            {layer.capacity for layer in cachelife.lifecycle(cache).cross_attention}
            if is_managed_cache(cache)
            else set()
        )
        length = int(kwargs["encoder_outputs"][0].shape[1])
        self.calls.append((length, None if mask is None else tuple(mask.shape), capacities))


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_generate_with_buckets_equals_eager_without_padding(name: str) -> None:
    built = zoo.build(name)
    model = built.model
    cases = [ragged(built, 3, length, length) for length in LENGTHS]
    expected = [reference(model, inputs) for inputs in cases]
    cachelife.enable(model, encoder_buckets=BUCKETS)
    seen = SeenByForward(model)
    for inputs, tokens in zip(cases, expected, strict=True):
        assert torch.equal(zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static"), tokens)
    buckets = [bucket_length(length, BUCKETS) for length in LENGTHS]
    assert buckets == [8, 8, 16, 16, 32]
    assert seen.calls == [(bucket, (3, bucket), {bucket}) for bucket in buckets]
    pool = cachelife.pool_of(model)
    assert pool is not None
    assert (pool.hits, pool.misses) == (2, 3)  # one pinned buffer set per bucket, reused within it


def test_beam_search_with_buckets_equals_eager() -> None:
    built = zoo.build("t5")
    inputs = ragged(built, 2, 5, 1)
    expected = reference(built.model, inputs, num_beams=3, num_return_sequences=2)
    cachelife.enable(built.model, encoder_buckets=BUCKETS)
    seen = SeenByForward(built.model)
    tokens = zoo.generate_tokens(
        built.model, inputs, **SETTINGS, num_beams=3, num_return_sequences=2, cache_implementation="static"
    )
    assert torch.equal(tokens, expected)
    assert seen.calls == [(8, (6, 8), {8})]


def test_generate_without_an_attention_mask_gets_one_with_the_padding_masked() -> None:
    built = zoo.build("bart")
    inputs = {"input_ids": built.inputs(2, 5, 1)["input_ids"]}
    expected = reference(built.model, inputs)
    cachelife.enable(built.model, encoder_buckets=BUCKETS)
    seen = SeenByForward(built.model)
    assert torch.equal(zoo.generate_tokens(built.model, inputs, **SETTINGS, cache_implementation="static"), expected)
    assert seen.calls == [(8, (2, 8), {8})]


def test_encoder_outputs_passed_to_generate_are_padded_and_left_unchanged() -> None:
    built = zoo.build("t5")
    model = built.model
    inputs = ragged(built, 2, 6, 1)
    expected = reference(model, inputs)
    with torch.no_grad():
        encoded = model.get_encoder()(**inputs)
    states = encoded.last_hidden_state
    cachelife.enable(model, encoder_buckets=BUCKETS)
    seen = SeenByForward(model)
    tokens = zoo.generate_tokens(
        model, {"encoder_outputs": encoded, "attention_mask": inputs["attention_mask"]}, **SETTINGS,
        cache_implementation="static",
    )  # fmt: skip
    assert torch.equal(tokens, expected)
    assert seen.calls == [(8, (2, 8), {8})]
    assert encoded.last_hidden_state is states
    assert tuple(states.shape[:2]) == (2, 6)


def test_a_length_above_every_bucket_is_not_padded_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    built = zoo.build("t5")
    inputs = built.inputs(2, 20, 1)
    expected = reference(built.model, inputs)
    cachelife.enable(built.model, encoder_buckets=(8, 16))
    seen = SeenByForward(built.model)
    with caplog.at_level(logging.WARNING, logger="cachelife"):
        tokens = zoo.generate_tokens(built.model, inputs, **SETTINGS, cache_implementation="static")
    assert torch.equal(tokens, expected)
    assert seen.calls == [(20, (2, 20), {20})]
    warnings = [record.getMessage() for record in caplog.records if record.name.startswith("cachelife")]
    assert len(warnings) == 1
    assert "encoder length 20 is above the largest encoder bucket 16: not padded" in warnings[0]


def test_dynamic_cache_generation_is_padded_too_and_equals_eager() -> None:
    built = zoo.build("bart")
    inputs = ragged(built, 2, 11, 3)
    expected = reference(built.model, inputs)
    cachelife.enable(built.model, encoder_buckets=BUCKETS)
    seen = SeenByForward(built.model)
    assert torch.equal(zoo.generate_tokens(built.model, inputs, **SETTINGS), expected)
    assert seen.calls == [(16, (2, 16), set())]


# -- which families may be bucketed ------------------------------------------------------------------------

VOCAB = 99


def tf(name: str) -> Any:
    """A transformers class by name (the families here need no stubs of their own)."""
    return getattr(transformers, name)


def t5_like(config_name: str, model_name: str) -> Callable[[], PreTrainedModel]:
    def build() -> PreTrainedModel:
        config = tf(config_name)(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=40, num_layers=2, num_decoder_layers=2, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        )  # fmt: skip
        model: PreTrainedModel = tf(model_name)(config)
        return model

    return build


def bart_like(config_name: str, model_name: str) -> Callable[[], PreTrainedModel]:
    def build() -> PreTrainedModel:
        config = tf(config_name)(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=2, encoder_ffn_dim=40, decoder_ffn_dim=40, max_position_embeddings=128,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        )  # fmt: skip
        model: PreTrainedModel = tf(model_name)(config)
        return model

    return build


FAMILIES: dict[str, Callable[[], PreTrainedModel]] = {
    "t5": t5_like("T5Config", "T5ForConditionalGeneration"),
    "mt5": t5_like("MT5Config", "MT5ForConditionalGeneration"),
    "umt5": t5_like("UMT5Config", "UMT5ForConditionalGeneration"),
    "longt5": t5_like("LongT5Config", "LongT5ForConditionalGeneration"),
    "bart": bart_like("BartConfig", "BartForConditionalGeneration"),
    "mbart": bart_like("MBartConfig", "MBartForConditionalGeneration"),
    "marian": bart_like("MarianConfig", "MarianMTModel"),
    "pegasus": bart_like("PegasusConfig", "PegasusForConditionalGeneration"),
    "blenderbot": bart_like("BlenderbotConfig", "BlenderbotForConditionalGeneration"),
    "blenderbot-small": bart_like("BlenderbotSmallConfig", "BlenderbotSmallForConditionalGeneration"),
    "plbart": bart_like("PLBartConfig", "PLBartForConditionalGeneration"),
    "m2m_100": bart_like("M2M100Config", "M2M100ForConditionalGeneration"),
    "mvp": bart_like("MvpConfig", "MvpForConditionalGeneration"),
}


def test_the_allow_list_is_exactly_the_tested_families() -> None:
    assert set(FAMILIES) == BUCKETABLE_MODEL_TYPES


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_allowed_family_generates_like_eager_with_buckets(model_type: str) -> None:
    torch.manual_seed(0)
    model = FAMILIES[model_type]().eval()
    assert model.config.model_type == model_type
    ids = torch.randint(4, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    settings = {"forced_bos_token_id": None, "forced_eos_token_id": None}  # some families set these by default
    expected = reference(model, inputs, **settings)
    cachelife.enable(model, encoder_buckets=(16,))
    seen = SeenByForward(model)
    tokens = zoo.generate_tokens(model, inputs, **SETTINGS, **settings, cache_implementation="static")
    assert torch.equal(tokens, expected)
    assert seen.calls == [(16, (3, 16), {16})]


def test_whisper_is_refused_because_its_decoder_ignores_the_encoder_mask() -> None:
    model = zoo.build("whisper").model
    before = dict(model.__dict__)
    with pytest.raises(UnsupportedGenerationError, match="Whisper's decoder takes no encoder attention mask"):
        cachelife.enable(model, encoder_buckets=(64,))
    assert dict(model.__dict__) == before
    assert not cachelife.is_enabled(model)


def test_why_whisper_is_refused_padding_changes_its_output() -> None:
    built = zoo.build("whisper")
    model = built.model
    with torch.no_grad():
        states = model.get_encoder()(**built.inputs(2, 0, 1)).last_hidden_state
        padded = torch.cat([states, states.new_zeros(2, 8, states.shape[2])], dim=1)
        mask = torch.cat([torch.ones(2, states.shape[1], dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)], 1)
        start = torch.ones(2, 1, dtype=torch.long)
        plain = model(encoder_outputs=BaseModelOutput(states), decoder_input_ids=start).logits
        masked = model(encoder_outputs=BaseModelOutput(padded), attention_mask=mask, decoder_input_ids=start).logits
    assert not torch.allclose(plain, masked, atol=1e-4)


def test_an_enabled_whisper_is_not_changed_by_a_refused_update() -> None:
    model = zoo.build("whisper").model
    cachelife.enable(model)
    with pytest.raises(UnsupportedGenerationError, match="model type 'whisper'"):
        cachelife.enable(model, encoder_buckets=(64,), on_unpinned="raise")
    guard = model.__dict__["_cachelife_guard"]
    assert (guard.on_unpinned, guard.encoder_buckets) == ("pin", None)


def test_decoder_only_and_unverified_models_are_refused() -> None:
    with pytest.raises(UnsupportedGenerationError, match="it is decoder-only: there is no encoder output to pad"):
        cachelife.enable(zoo.build("llama").model, encoder_buckets=(64,))
    torch.manual_seed(0)
    model = FAMILIES["bart"]()
    model.config.model_type = "fsmt"  # a family with a shape rule but no bucket test
    with pytest.raises(UnsupportedGenerationError, match="has not verified that its cross-attention honours"):
        cachelife.enable(model, encoder_buckets=(64,))


# -- settings ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "detail"),
    [
        ((), "got an empty tuple"),
        ([], "got an empty list"),
        ((64, 64), "64 follows 64"),
        ((128, 64), "64 follows 128"),
        ((0, 8), "the entry 0 is no positive int"),
        ((-8,), "the entry -8 is no positive int"),
        ((8.0, 16), "the entry 8.0 is no positive int"),
        ((True, 8), "the entry True is no positive int"),
        ("64", "got '64'"),
        (64, "got 64"),
        ({8, 16}, "got {8, 16}"),
    ],
)
def test_invalid_buckets_are_refused_and_change_nothing(bad: object, detail: str) -> None:
    model = zoo.build("t5").model
    before = dict(model.__dict__)
    with pytest.raises(InvalidBucketsError, match="strictly increasing sequence of positive ints") as raised:
        cachelife.enable(model, encoder_buckets=bad)  # type: ignore[arg-type]  # the misuse under test
    assert detail in str(raised.value)
    assert isinstance(raised.value, ValueError)
    assert dict(model.__dict__) == before


def test_buckets_are_normalised_to_a_tuple() -> None:
    assert check_buckets([8, 16, 512]) == (8, 16, 512)
    assert [bucket_length(length, (8, 16)) for length in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, None]


def test_enabling_again_updates_or_turns_off_the_buckets() -> None:
    built = zoo.build("t5")
    model = built.model
    inputs = built.inputs(2, 5, 1)
    cachelife.enable(model, encoder_buckets=(8,))
    seen = SeenByForward(model)
    zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static")
    cachelife.enable(model, encoder_buckets=(16,))
    zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static")
    cachelife.enable(model)
    zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static")
    assert [length for length, _, _ in seen.calls] == [8, 16, 5]


def test_disable_restores_the_model_exactly_and_stops_padding() -> None:
    built = zoo.build("t5")
    model = built.model
    inputs = built.inputs(2, 5, 1)
    expected = reference(model, inputs)
    # transformers records the static cache length it built on the model: let it do so before the snapshot.
    assert torch.equal(zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static"), expected)
    attributes = dict(model.__dict__)
    hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
    cachelife.enable(model, encoder_buckets=BUCKETS)
    assert torch.equal(zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static"), expected)
    cachelife.disable(model)
    assert dict(model.__dict__) == attributes
    assert (dict(model._forward_pre_hooks), dict(model._forward_hooks)) == hooks
    seen: list[int] = []

    def encoder_length(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append(int(kwargs["encoder_outputs"][0].shape[1]))

    handle = model.register_forward_pre_hook(encoder_length, with_kwargs=True)
    assert torch.equal(zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static"), expected)
    handle.remove()
    assert set(seen) == {5}


# -- the decode loop ---------------------------------------------------------------------------------------


def decode_expected(model: PreTrainedModel, inputs: zoo.Inputs, tokens: int) -> torch.Tensor:
    return zoo.generate_tokens(model, inputs, do_sample=False, max_new_tokens=tokens, disable_compile=True)


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_decode_loop_with_buckets_equals_generate(name: str) -> None:
    built = zoo.build(name)
    model = built.model
    model.generation_config.forced_eos_token_id = None  # BART's default; decode refuses it
    cases = [ragged(built, 3, length, length) for length in (3, 8, 9)]
    expected = [decode_expected(model, inputs, 7) for inputs in cases]
    cachelife.enable(model)
    seen = SeenByForward(model)
    for inputs, tokens in zip(cases, expected, strict=True):
        out = decode(model, inputs, max_new_tokens=7, compile_step=False, encoder_buckets=BUCKETS)
        assert torch.equal(out, tokens)
    assert [(length, mask, capacities) for length, mask, capacities in seen.calls] == [
        (8, (3, 8), {8}),
        (8, (3, 8), {8}),
        (16, (3, 16), {16}),
    ]
    pool = cachelife.pool_of(model)
    assert pool is not None
    assert pool.hits == 1  # lengths 3 and 8 decoded on the same pinned buffers


def test_decode_loop_refuses_buckets_it_cannot_pad_safely() -> None:
    whisper = zoo.build("whisper")
    with pytest.raises(UnsupportedGenerationError, match="Whisper's decoder takes no encoder attention mask"):
        decode(whisper.model, whisper.inputs(1, 0, 1), max_new_tokens=2, encoder_buckets=(64,))
    t5 = zoo.build("t5")
    with pytest.raises(InvalidBucketsError, match=r"got \(16, 8\) \(8 follows 16\)"):
        decode(t5.model, t5.inputs(1, 5, 1), max_new_tokens=2, encoder_buckets=(16, 8))


# -- compiled ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.exhaustive
def test_compiled_forward_recompiles_nothing_within_a_bucket_and_equals_eager() -> None:
    torch._dynamo.reset()
    counters.clear()
    built = zoo.build("t5")
    model = built.model
    lengths = (9, 13, 16, 11)  # all in bucket 16
    cases = [ragged(built, 2, length, length) for length in lengths]
    expected = [reference(model, inputs) for inputs in cases]
    other = ragged(built, 2, 12, 12)
    other_expected = reference(model, other)
    cachelife.enable(model, encoder_buckets=(16, 32))
    cachelife.compile_forward(model, fullgraph=True)
    graphs = []
    for inputs, tokens in zip(cases, expected, strict=True):
        assert torch.equal(zoo.generate_tokens(model, inputs, **SETTINGS, cache_implementation="static"), tokens)
        graphs.append(int(counters["stats"]["unique_graphs"]))
    assert graphs[0] >= 1  # the forward call really ran compiled
    assert graphs == [graphs[0]] * len(lengths)  # and no later length inside the bucket compiled anything

    # The counter does see recompilation: without buckets, a second encoder length compiles again.
    cachelife.enable(model)
    assert torch.equal(zoo.generate_tokens(model, other, **SETTINGS, cache_implementation="static"), other_expected)
    assert int(counters["stats"]["unique_graphs"]) > graphs[-1]
