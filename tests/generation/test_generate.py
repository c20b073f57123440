"""cachelife.generate: the tokens of `model.generate` for every supported processor and beam option, and a
fallback (one WARNING) or an error for every unsupported feature.

Each processor test picks its setting from the model's own free output (a token it does produce, an n-gram
it does repeat) and checks that the setting changes the output, so that equality with `generate` tests the
processor and not its absence. Most tests run the step function eagerly (`compile_step=False`); the slow
ones compile it with inductor.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

import cachelife
from cachelife.errors import UnsupportedGenerationError
from cachelife.integration.runtime import runtime_of
from cachelife.tools import zoo

ENCODER_DECODER = ["t5", "bart", "marian", "whisper"]
ALL = [*ENCODER_DECODER, "llama"]
NEW = 12


def build(name: str) -> zoo.ZooModel:
    built = zoo.build(name)
    config = built.model.generation_config
    if name == "whisper":
        zoo.whisper_tiny_generation(config)
    if name in ("bart", "marian"):
        config.forced_eos_token_id = None  # set per test where it is the subject
    if name == "bart":
        config.eos_token_id = None  # the tiny BART ends every sequence at once; tests set end tokens themselves
    if name == "marian":
        config.bad_words_ids = None
        config.num_beams = 1
    return built


def inputs_of(built: zoo.ZooModel) -> zoo.Inputs:
    return built.inputs(2, 9, 1)


def reference(built: zoo.ZooModel, **settings: Any) -> torch.Tensor:
    return zoo.generate_tokens(built.model, inputs_of(built), **settings)


def ours(built: zoo.ZooModel, **settings: Any) -> torch.Tensor:
    return tokens(cachelife.generate(built.model, compile_step=False, fallback=False, **inputs_of(built), **settings))


def tokens(output: object) -> torch.Tensor:
    assert isinstance(output, torch.Tensor)
    return output


def assert_equal_and_effective(built: zoo.ZooModel, settings: dict[str, Any], off: dict[str, Any]) -> None:
    """Tokens equal generate's with `settings`, and differ from generate's with `off` (the processor off)."""
    expected = reference(built, **settings)
    got = ours(built, **settings)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert torch.equal(got, expected)
    without = reference(built, **{**settings, **off})
    assert without.shape != expected.shape or not torch.equal(without, expected), "the setting changed nothing"


def generated(built: zoo.ZooModel, **settings: Any) -> torch.Tensor:
    """The new tokens of generate's free greedy output (encoder-decoder: after the decoder prompt)."""
    out = reference(built, max_new_tokens=NEW, **settings)
    prompt = 9 if built.model.config.model_type == "llama" else 1
    if built.model.config.model_type == "whisper":
        prompt = 0  # Whisper's generate returns the tokens after its forced prompt... checked below
    return out[:, prompt:]


# -- greedy search and processors --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_greedy_equals_generate(name: str) -> None:
    built = build(name)
    for tokens in (1, 5, NEW):
        expected = reference(built, max_new_tokens=tokens)
        assert torch.equal(ours(built, max_new_tokens=tokens), expected)
    length = 14 if name == "llama" else 7
    assert torch.equal(ours(built, max_length=length), reference(built, max_length=length))


@pytest.mark.parametrize("name", ALL)
def test_suppress_tokens(name: str) -> None:
    built = build(name)
    free = generated(built, suppress_tokens=None)
    suppress = sorted({int(free[0, -3]), int(free[1, -2])})
    assert_equal_and_effective(built, {"max_new_tokens": NEW, "suppress_tokens": suppress}, {"suppress_tokens": None})


@pytest.mark.parametrize("name", ["t5", "bart", "whisper", "llama"])
def test_begin_suppress_tokens(name: str) -> None:
    built = build(name)
    settings: dict[str, Any] = {"max_new_tokens": NEW, "suppress_tokens": None, "begin_suppress_tokens": None}
    first = reference(built, **settings)
    column = 9 if name == "llama" else (-NEW if name == "whisper" else 1)
    begin = sorted({int(first[0, column]), int(first[1, column])})
    assert_equal_and_effective(built, {**settings, "begin_suppress_tokens": begin}, {"begin_suppress_tokens": None})


@pytest.mark.parametrize("name", ["t5", "bart", "marian", "llama"])
def test_forced_bos_and_eos(name: str) -> None:
    built = build(name)
    if name != "llama":  # forced BOS applies at length 1: the decoder start token, never after a prompt
        bos = {"max_new_tokens": NEW, "forced_bos_token_id": 17}
        assert_equal_and_effective(built, bos, {"forced_bos_token_id": None})
    built.model.generation_config.eos_token_id = 5  # a token these models do not produce in 12 steps
    assert_equal_and_effective(built, {"max_new_tokens": NEW, "forced_eos_token_id": 5}, {"forced_eos_token_id": None})


@pytest.mark.parametrize("name", ALL)
def test_min_length_and_min_new_tokens_with_several_eos(name: str) -> None:
    built = build(name)
    free = generated(built, max_length=None)
    ends = sorted({int(free[0, 2]), int(free[1, 1])})  # end tokens the free output produces early
    built.model.generation_config.eos_token_id = ends
    assert_equal_and_effective(built, {"max_new_tokens": NEW, "min_new_tokens": 8}, {"min_new_tokens": 0})
    prompt = 9 if name == "llama" else 1
    assert_equal_and_effective(built, {"max_new_tokens": NEW, "min_length": prompt + 6}, {"min_length": 0})
    assert torch.equal(ours(built, max_new_tokens=NEW), reference(built, max_new_tokens=NEW))


@pytest.mark.parametrize("name", ALL)
def test_repetition_penalty_and_no_repeat_ngram(name: str) -> None:
    built = build(name)
    settings = {"max_new_tokens": 20}
    assert_equal_and_effective(built, {**settings, "repetition_penalty": 1.7}, {"repetition_penalty": 1.0})
    assert_equal_and_effective(built, {**settings, "no_repeat_ngram_size": 2}, {"no_repeat_ngram_size": 0})
    assert_equal_and_effective(
        built, {**settings, "no_repeat_ngram_size": 3, "repetition_penalty": 0.6}, {"no_repeat_ngram_size": 0}
    )


@pytest.mark.parametrize("name", ALL)
def test_bad_words_single_and_multi_token(name: str) -> None:
    built = build(name)
    free = generated(built)
    single = [[int(free[0, -4])]]
    pair = [[int(free[1, -6]), int(free[1, -5])]]
    settings = {"max_new_tokens": NEW}
    assert_equal_and_effective(built, {**settings, "bad_words_ids": single}, {"bad_words_ids": None})
    assert_equal_and_effective(built, {**settings, "bad_words_ids": pair + single}, {"bad_words_ids": None})


@pytest.mark.parametrize("name", ["t5", "bart", "marian"])
def test_decoder_prompt(name: str) -> None:
    built = build(name)
    start = int(built.model.generation_config.decoder_start_token_id)  # type: ignore[arg-type]
    prompt = torch.tensor([[start, 30, 31], [start, 40, 41]])
    assert_equal_and_effective(
        built,
        {"max_new_tokens": NEW, "decoder_input_ids": prompt, "no_repeat_ngram_size": 2},
        {"decoder_input_ids": None},
    )


def test_whisper_language_task_and_suppress_lists() -> None:
    built = build("whisper")
    for language, task in (("de", "translate"), ("en", "transcribe"), ("fr", None)):
        settings: dict[str, Any] = {"max_new_tokens": NEW, "language": language}
        if task is not None:
            settings["task"] = task
        expected = reference(built, **settings)
        assert torch.equal(ours(built, **settings), expected)
    assert not torch.equal(reference(built, max_new_tokens=NEW, language="de"), reference(built, max_new_tokens=NEW))


def test_sampling_with_top_k_1_or_tiny_top_p_is_greedy() -> None:
    built = build("llama")
    expected = reference(built, max_new_tokens=NEW, do_sample=False)
    for warp in ({"top_k": 1}, {"top_p": 1e-6, "top_k": 0}, {"top_k": 1, "temperature": 0.5}):
        generator = torch.Generator().manual_seed(0)
        assert torch.equal(ours(built, max_new_tokens=NEW, do_sample=True, generator=generator, **warp), expected)


@pytest.mark.parametrize("name", ["t5", "llama"])
def test_sampling_is_reproducible_and_follows_temperature(name: str) -> None:
    built = build(name)

    def sample(seed: int, **warp: Any) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return ours(built, max_new_tokens=NEW, do_sample=True, generator=generator, **warp)

    assert torch.equal(sample(3, temperature=0.7, top_k=50), sample(3, temperature=0.7, top_k=50))
    assert not torch.equal(sample(3, temperature=1.5, top_k=0), sample(4, temperature=1.5, top_k=0))
    # Distribution sanity: a cold temperature is nearly greedy, a hot one is not.
    greedy = reference(built, max_new_tokens=NEW)
    cold = torch.stack([sample(seed, temperature=0.05, top_k=0) for seed in range(4)])
    hot = torch.stack([sample(seed, temperature=5.0, top_k=0) for seed in range(4)])
    assert (cold == greedy).float().mean() > (hot == greedy).float().mean()


# -- beam search -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_beam_search_equals_generate(name: str) -> None:
    built = build(name)
    assert_equal_and_effective(built, {"max_new_tokens": NEW, "num_beams": 3}, {"num_beams": 1})
    for beams, returned in ((2, 1), (4, 2), (5, 5)):
        settings = {"max_new_tokens": NEW, "num_beams": beams, "num_return_sequences": returned}
        assert torch.equal(ours(built, **settings), reference(built, **settings)), settings


@pytest.mark.parametrize("name", ["t5", "bart", "llama", "whisper"])
def test_beam_length_penalty_and_early_stopping(name: str) -> None:
    built = build(name)
    free = generated(built, max_length=None)
    built.model.generation_config.eos_token_id = [int(free[0, 3]), int(free[1, 5])]  # beams end at several lengths
    outputs = []
    for early_stopping in (True, False, "never"):
        for penalty in (-1.0, 0.0, 1.0, 2.0):
            settings = {
                "max_new_tokens": NEW, "num_beams": 4, "num_return_sequences": 2, "length_penalty": penalty,
                "early_stopping": early_stopping,
            }  # fmt: skip
            expected = reference(built, **settings)
            assert torch.equal(ours(built, **settings), expected), settings
            outputs.append(expected)
    assert any(not torch.equal(outputs[0], other) for other in outputs[1:] if other.shape == outputs[0].shape) or any(
        other.shape != outputs[0].shape for other in outputs
    )


def test_marian_real_config_and_bart_cnn_style_config() -> None:
    marian = zoo.build("marian")  # bad_words_ids [[pad]], 4 beams, forced EOS
    assert torch.equal(
        tokens(
            cachelife.generate(
                marian.model, compile_step=False, fallback=False, **inputs_of(marian), max_new_tokens=NEW
            )
        ),
        zoo.generate_tokens(marian.model, inputs_of(marian), max_new_tokens=NEW),
    )
    bart = build("bart")
    zoo.bart_cnn_generation(bart.model.generation_config)
    settings = {"min_length": 8, "max_length": 16}
    assert_equal_and_effective(bart, settings, {"no_repeat_ngram_size": 0, "forced_bos_token_id": None})


# -- fallback ----------------------------------------------------------------------------------------------


class _Custom(LogitsProcessor):
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores


class _Never(StoppingCriteria):
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)  # type: ignore[return-value]


def _fallback_cases() -> list[tuple[str, dict[str, Any], str]]:
    return [
        ("t5", {"logits_processor": LogitsProcessorList([_Custom()])}, "logits_processor"),
        (
            "llama",
            {"logits_processor": LogitsProcessorList([_Custom()]), "do_sample": True, "top_k": 0},
            "logits_processor",
        ),
        (
            "t5",
            {"stopping_criteria": StoppingCriteriaList([_Never()]), "num_beams": 2},
            "stopping_criteria (a _Never) with beam search",
        ),
        ("t5", {"prefix_allowed_tokens_fn": lambda batch, ids: [3, 4]}, "prefix_allowed_tokens_fn"),
        (
            "t5",
            {"return_dict_in_generate": True, "num_beams": 2, "output_hidden_states": True},
            "output_hidden_states",
        ),
        ("t5", {"return_dict_in_generate": True, "output_attentions": True}, "output_attentions"),
        ("t5", {"encoder_repetition_penalty": 1.3}, "encoder_repetition_penalty"),
        ("llama", {"padded": True}, "right-padded prompts for a decoder-only model"),
    ]


@pytest.mark.parametrize(("name", "settings", "feature"), _fallback_cases())
def test_unsupported_features_fall_back_with_one_warning_or_raise(
    name: str, settings: dict[str, Any], feature: str, caplog: pytest.LogCaptureFixture
) -> None:
    built = build(name)
    inputs = inputs_of(built)
    if settings.pop("padded", False):
        inputs["attention_mask"] = inputs["attention_mask"].clone()
        inputs["attention_mask"][0, -3:] = 0
    if name == "whisper":
        setattr(built.model.generation_config, "no_timestamps_token_id", 262)  # noqa: B010 - a Whisper field, not a stubbed one
    torch.manual_seed(7)  # a fallback samples as transformers does, from torch's global generator
    with caplog.at_level(logging.WARNING, logger="cachelife"):
        got = cachelife.generate(built.model, compile_step=False, **inputs, max_new_tokens=6, **settings)
    warnings = [r for r in caplog.records if r.name.startswith("cachelife") and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert feature in warnings[0].getMessage()
    torch.manual_seed(7)
    expected = built.model.generate(**inputs, max_new_tokens=6, **settings)
    assert type(got) is type(expected)
    tokens = got if isinstance(got, torch.Tensor) else got["sequences"]
    assert torch.equal(tokens, expected if isinstance(expected, torch.Tensor) else expected["sequences"])
    if settings.get("do_sample"):  # it sampled: greedy decoding gives other tokens
        assert not torch.equal(tokens, zoo.generate_tokens(built.model, inputs, max_new_tokens=6))
    with pytest.raises(UnsupportedGenerationError, match=feature.replace("(", r"\(").replace(")", r"\)")):
        cachelife.generate(built.model, compile_step=False, fallback=False, **inputs, max_new_tokens=6, **settings)


@pytest.mark.parametrize("ignored", [{"output_scores": True}, {"output_logits": True}, {"tokenizer": object()}])
def test_arguments_generate_ignores_alone_decode_on_the_fast_path(ignored: dict[str, Any]) -> None:
    built = build("t5")
    expected = reference(built, max_new_tokens=6)
    assert torch.equal(ours(built, max_new_tokens=6, **ignored), expected)


def test_a_fallback_warns_once_per_model_and_feature_naming_the_way_out(caplog: pytest.LogCaptureFixture) -> None:
    built, other = build("t5"), build("t5")
    settings: dict[str, Any] = {"max_new_tokens": 4, "encoder_repetition_penalty": 1.3}
    with caplog.at_level(logging.WARNING, logger="cachelife"):
        for model in (built.model, built.model, other.model):
            cachelife.generate(model, compile_step=False, **inputs_of(built), **settings)
        constrained: dict[str, Any] = {"max_new_tokens": 4, "prefix_allowed_tokens_fn": lambda batch, ids: [3, 4]}
        cachelife.generate(built.model, compile_step=False, **inputs_of(built), **constrained)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 3, messages  # once per model for the penalty, once for the other feature
    assert "leave out encoder_repetition_penalty to decode on cachelife's fast path" in messages[0]
    assert "fallback=False" in messages[0]
    assert "leave out prefix_allowed_tokens_fn" in messages[2]


def test_assistants_fall_back() -> None:
    built = build("whisper")
    with pytest.raises(UnsupportedGenerationError, match="assistant_model"):
        cachelife.generate(
            built.model, fallback=False, assistant_model=built.model, **inputs_of(built), max_new_tokens=4
        )


def test_state_buffers_are_kept_for_the_most_recent_shapes_only() -> None:
    built = build("t5")
    model = cachelife.enable(built.model)

    def call(batch: int) -> torch.Tensor:
        inputs = built.inputs(batch, 9, 1)
        got = tokens(cachelife.generate(model, compile_step=False, fallback=False, **inputs, max_new_tokens=4))
        assert torch.equal(got, zoo.generate_tokens(model, inputs, max_new_tokens=4))
        return got

    call(1)
    first_keys = set(runtime_of(model).states.keys())
    assert len(first_keys) == 4  # greedy state, noise, encoder output, encoder mask
    for batch in range(2, 11):  # 9 more shapes, 4 keys each: more than the runtime keeps
        call(batch)
        assert len(runtime_of(model).states.keys()) <= runtime_of(model).states.limit
    kept = runtime_of(model).states.keys()
    assert len(kept) == runtime_of(model).states.limit
    assert not first_keys & set(kept)  # the least recently used went first
    call(10)  # the newest shape again: its buffers are reused, nothing is added or dropped
    assert set(runtime_of(model).states.keys()) == set(kept)
    call(1)  # an evicted shape gets new buffers and the same tokens
    assert first_keys <= set(runtime_of(model).states.keys())


# -- compiled ----------------------------------------------------------------------------------------------


def _frames() -> int:
    return int(counters["stats"]["unique_graphs"])


@pytest.mark.slow
def test_compiled_greedy_with_processors_reuses_graph_and_buffers() -> None:
    torch._dynamo.reset()
    built = build("whisper")
    model = cachelife.enable(built.model)
    settings: dict[str, Any] = {
        "max_new_tokens": NEW, "language": "de", "task": "translate", "no_repeat_ngram_size": 2,
        "repetition_penalty": 1.3, "min_new_tokens": 4, "bad_words_ids": [[5], [6, 7]],
    }  # fmt: skip
    expected = reference(built, **settings)
    first = tokens(cachelife.generate(model, fallback=False, **inputs_of(built), **settings))
    assert torch.equal(first, expected)
    graphs = _frames()
    pool = cachelife.pool_of(model)
    assert pool is not None
    hits, misses = pool.hits, pool.misses
    second = tokens(cachelife.generate(model, fallback=False, **inputs_of(built), **settings))
    assert torch.equal(second, expected)
    assert _frames() == graphs  # no recompilation
    shorter = {**settings, "max_new_tokens": NEW - 3}  # another length in the same 64-column buffer
    assert torch.equal(
        tokens(cachelife.generate(model, fallback=False, **inputs_of(built), **shorter)), reference(built, **shorter)
    )
    assert _frames() == graphs
    assert pool.hits > hits
    assert pool.misses == misses  # the second call decoded on the first call's cache buffers


@pytest.mark.slow
@pytest.mark.exhaustive
def test_compiled_beam_search_reuses_graph_and_buffers() -> None:
    torch._dynamo.reset()
    built = build("bart")
    model = cachelife.enable(built.model)
    settings: dict[str, Any] = {
        "max_new_tokens": NEW, "num_beams": 3, "num_return_sequences": 2, "length_penalty": 2.0,
        "no_repeat_ngram_size": 2, "early_stopping": True,
    }  # fmt: skip
    expected = reference(built, **settings)
    for steps in (1, 3):
        out = cachelife.generate(model, fallback=False, steps_per_call=steps, **inputs_of(built), **settings)
        assert torch.equal(tokens(out), expected)
    graphs = _frames()
    out = cachelife.generate(model, fallback=False, steps_per_call=3, **inputs_of(built), **settings)
    assert torch.equal(tokens(out), expected)
    shorter = {**settings, "max_new_tokens": NEW - 4}
    out = cachelife.generate(model, fallback=False, steps_per_call=3, **inputs_of(built), **shorter)
    assert torch.equal(tokens(out), reference(built, **shorter))
    assert _frames() == graphs


@pytest.mark.slow
@pytest.mark.exhaustive
def test_compiled_bf16_beam_search_equals_a_compiled_forward_with_eager_casts() -> None:
    """bf16: the step rounds at every cast as eager does (inductor's emulate_precision_casts), so its tokens
    equal `generate` with a forward compiled the same way, whatever inductor fuses across the model's last
    layers and the processors (without it, 13 of 84 tokens of this case differed; 5 with it on one side)."""
    torch._dynamo.reset()

    def bart_small() -> zoo.ZooModel:
        built = zoo.build("bart-small", dtype=torch.bfloat16)
        zoo.bart_cnn_generation(built.model.generation_config)  # 4 beams, no-repeat 3, length penalty 2.0
        return built

    forward = bart_small()
    cachelife.enable(forward.model, options=cachelife.EXACT)  # transformers' own modules: the reference
    cachelife.compile_forward(forward.model, fullgraph=True, options={"emulate_precision_casts": True})
    model = cachelife.enable(bart_small().model)
    inputs = forward.inputs(4, 24, 1)
    settings: dict[str, Any] = {"max_new_tokens": 20, "min_new_tokens": 20}
    expected = tokens(forward.model.generate(**inputs, **settings, cache_implementation="static"))
    assert torch.equal(tokens(cachelife.generate(model, fallback=False, **inputs, **settings)), expected)


@pytest.mark.parametrize("name", ["t5", "llama"])
def test_several_steps_per_call_and_late_stop_checks(name: str) -> None:
    built = build(name)
    free = generated(built)
    built.model.generation_config.eos_token_id = int(free[0, 4])  # one row ends early, the other runs on
    cases: list[dict[str, Any]] = [
        {"max_new_tokens": NEW},
        {"max_new_tokens": NEW, "num_beams": 3, "num_return_sequences": 2},
    ]
    for settings in cases:
        expected = reference(built, **settings)
        for steps, every in ((3, 1), (4, 16), (5, 2)):
            out = cachelife.generate(
                built.model, compile_step=False, fallback=False, steps_per_call=steps, stop_check_every=every,
                **inputs_of(built), **settings,
            )  # fmt: skip
            assert torch.equal(tokens(out), expected), (settings, steps, every)


def test_a_generate_that_does_not_call_the_decoding_method_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    built = build("t5")
    model = built.model
    original = model.generate

    def ignores_custom_generate(**kwargs: Any) -> Any:  # as a model's own generate that drops the argument
        kwargs.pop("custom_generate", None)
        return original(**kwargs)

    model.generate = ignores_custom_generate  # type: ignore[method-assign,assignment]
    with caplog.at_level(logging.WARNING, logger="cachelife"):
        got = cachelife.generate(model, compile_step=False, **inputs_of(built), max_new_tokens=6)
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("cachelife")]
    assert len(warnings) == 1
    assert "did not call cachelife's decoding method" in warnings[0]
    assert torch.equal(tokens(got), zoo.generate_tokens(model, inputs_of(built), max_new_tokens=6))
    with pytest.raises(UnsupportedGenerationError, match="did not call"):
        cachelife.generate(model, compile_step=False, fallback=False, **inputs_of(built), max_new_tokens=6)
