"""Whisper on the fast path: timestamps, long-form audio (one `generate` call per segment), segments, prompts,
conditioning on earlier segments and temperature fallback, each equal to `model.generate` with
`fallback=False` (a segment that fell back would raise), and what still falls back, by name.

The zoo's tiny Whisper is made to listen to its input (`build`): with random weights its encoder output is
almost only the positional embedding, so every row and every segment would decode the same tokens. Its 37
timestamp tokens (263-299) get chosen by Whisper's own rule (their summed probability beats any text token's),
as the short- and long-form tests check, so that equality with `generate` tests the timestamp rules and not
their absence.
"""

from __future__ import annotations

import unittest.mock
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import logits_process as lp

import cachelife
from cachelife.errors import UnsupportedGenerationError
from cachelife.generation import method as cachelife_generation_method
from cachelife.generation.processors import tensor_processors, unsupported_processor
from cachelife.tools import zoo

NO_TIMESTAMPS = 262
TIMESTAMP_BEGIN = NO_TIMESTAMPS + 1
FRAMES = 64  # one segment of the tiny Whisper: 2 * max_source_positions
NEW = 20


def build() -> PreTrainedModel:
    """The tiny Whisper with its convolutions and cross-attention outputs scaled up, so that the audio decides."""
    model = zoo.build("whisper").model
    zoo.whisper_tiny_generation(model.generation_config)
    with torch.no_grad():
        for name in ("model.encoder.conv1.weight", "model.encoder.conv2.weight"):
            model.get_parameter(name).mul_(30)
        for layer in range(2):
            model.get_parameter(f"model.decoder.layers.{layer}.encoder_attn.out_proj.weight").mul_(10)
    return model


def features(batch: int, frames: int, seed: int = 0) -> torch.Tensor:
    """Log-mel-like features whose mean changes every 8 frames, so that segments differ."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch, 16, frames, generator=generator)
    blocks = torch.randn(batch, 16, frames // 8 + 1, generator=generator).repeat_interleave(8, dim=-1)
    return noise + 3 * blocks[..., :frames]


def long_form(batch: int) -> dict[str, Any]:
    """Three segments of audio; with a batch, the second row 130 frames long (an attention mask)."""
    inputs: dict[str, Any] = {"input_features": features(batch, 200)}
    if batch > 1:
        mask = torch.ones(batch, 200, dtype=torch.long)
        mask[1, 130:] = 0
        inputs["attention_mask"] = mask
    return inputs


def reference(model: PreTrainedModel, **settings: Any) -> Any:
    return model.generate(**settings)


def ours(model: PreTrainedModel, **settings: Any) -> Any:
    return cachelife.generate(model, compile_step=False, fallback=False, **settings)


def sequences(output: Any) -> torch.Tensor:
    tokens = output if isinstance(output, torch.Tensor) else output["sequences"]
    assert isinstance(tokens, torch.Tensor)
    return tokens


def timestamps_per_row(tokens: torch.Tensor) -> list[int]:
    return [int(count) for count in (tokens >= TIMESTAMP_BEGIN).sum(dim=-1)]


def assert_segments_equal(got: Any, expected: Any) -> None:
    """Segments as Whisper's generate returns them (`return_segments=True`): tokens, times and token indices."""
    assert torch.equal(sequences(got), sequences(expected))
    assert len(got["segments"]) == len(expected["segments"])
    for row, (mine, theirs) in enumerate(zip(got["segments"], expected["segments"], strict=True)):
        assert len(mine) == len(theirs), row
        for segment, other in zip(mine, theirs, strict=True):
            assert torch.equal(segment["tokens"], other["tokens"]), row
            assert torch.equal(segment["start"], other["start"]), row
            assert torch.equal(segment["end"], other["end"]), row
            assert segment["idxs"] == other["idxs"], row


class GenerateCalls:
    """Counts the `generate` calls Whisper's generate makes (one per segment and temperature), by the encoder
    forwards (with a language given: no detection forward), and the static caches cachelife leased for them
    (one per call of its decoding method, from the pool of an enabled model)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.calls = 0
        model.get_submodule("model.encoder").register_forward_hook(self.count)
        pool = cachelife.pool_of(model)
        assert pool is not None
        self.pool = pool

    def count(self, module: torch.nn.Module, args: tuple[Any, ...], output: object) -> None:
        self.calls += 1

    @property
    def leases(self) -> int:
        return self.pool.hits + self.pool.misses


# -- the timestamp rules, score by score -------------------------------------------------------------------


def _timestamp_processor(
    begin_index: int, max_initial: int | None, from_logprob: bool
) -> lp.WhisperTimeStampLogitsProcessor:
    config = GenerationConfig(eos_token_id=20, bos_token_id=1)
    setattr(config, "no_timestamps_token_id", 25)  # noqa: B010 - a Whisper field, not a stubbed one
    setattr(config, "max_initial_timestamp_index", max_initial)  # noqa: B010 - a Whisper field
    processor = lp.WhisperTimeStampLogitsProcessor(config, begin_index=1, _detect_timestamp_from_logprob=from_logprob)
    processor.begin_index = begin_index  # what set_begin_index does (untyped) when Whisper's generate moves it
    return processor


@pytest.mark.parametrize("max_initial", [None, 0, 3])
@pytest.mark.parametrize("from_logprob", [True, False])
def test_timestamp_rules_equal_transformers_own_on_the_same_scores(max_initial: int | None, from_logprob: bool) -> None:
    vocab, rows, width = 40, 6, 16  # timestamps 26-39, text below the end token 20
    generator = torch.Generator().manual_seed(7)
    changed = 0
    for begin in (1, 3):
        processor = _timestamp_processor(begin, max_initial, from_logprob)
        assert unsupported_processor([processor]) is None
        (converted,) = tensor_processors([processor], vocab_size=vocab, device=torch.device("cpu"))
        for length in range(begin, begin + 8):
            for _ in range(20):
                text = torch.randint(0, vocab, (rows, length), generator=generator)
                stamps = torch.randint(26, vocab, (rows, length), generator=generator)
                tokens = torch.where(torch.rand(rows, length, generator=generator) < 0.5, stamps, text)
                scores = torch.randn(rows, vocab, generator=generator) * 2
                scores[:, 26:] += float(torch.randn((), generator=generator))  # timestamps likelier, or less
                expected = processor(tokens, scores.clone())
                buffer = torch.full((rows, width), 30, dtype=torch.long)  # garbage past the length
                buffer[:, :length] = tokens
                got = converted(buffer, torch.tensor(length), scores.clone())
                assert torch.equal(got, expected), (begin, length)
                changed += int((expected != scores).any(dim=-1).sum())
    assert changed > 0


def test_timestamp_rules_with_several_end_tokens_fall_back_by_name() -> None:
    processor = _timestamp_processor(1, None, True)
    processor.eos_token_id = [20, 21]
    assert unsupported_processor([processor]) == (
        "Whisper's timestamp rules with several end tokens (transformers' own slices by one)"
    )


# -- short-form --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beams", [1, 3])
def test_short_form_timestamps_equal_generate(beams: int) -> None:
    model = build()
    settings: dict[str, Any] = {"input_features": features(2, FRAMES), "max_new_tokens": NEW, "num_beams": beams}
    expected = reference(model, **settings, return_timestamps=True)
    assert torch.equal(ours(model, **settings, return_timestamps=True), expected)
    assert min(timestamps_per_row(expected)) >= 2
    assert not torch.equal(reference(model, **settings), expected)  # the rules changed the tokens


def test_max_initial_timestamp_index_equals_generate() -> None:
    model = build()
    settings: dict[str, Any] = {"input_features": features(2, FRAMES), "max_new_tokens": NEW, "return_timestamps": True}
    free = reference(model, **settings)
    setattr(model.generation_config, "max_initial_timestamp_index", 1)  # noqa: B010 - a Whisper field
    expected = reference(model, **settings)
    assert torch.equal(ours(model, **settings), expected)
    assert bool((expected[:, 0] <= TIMESTAMP_BEGIN + 1).all())
    assert not torch.equal(expected[:, 0], free[:, 0])


# -- long-form ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beams", [1, 3])
@pytest.mark.parametrize("batch", [1, 2])
def test_long_form_segments_equal_generate(batch: int, beams: int) -> None:
    model = cachelife.enable(build())
    settings: dict[str, Any] = {
        **long_form(batch), "max_new_tokens": NEW, "return_timestamps": True, "return_segments": True,
        "num_beams": beams, "language": "en",
    }  # fmt: skip
    counted = GenerateCalls(model)
    expected = reference(model, **settings)
    calls, leases = counted.calls, counted.leases
    assert_segments_equal(ours(model, **settings), expected)
    assert counted.leases - leases == calls  # every generate call of Whisper's went through cachelife's method
    assert calls >= 3
    assert all(len(segments) >= 2 for segments in expected["segments"])
    assert min(timestamps_per_row(sequences(expected))) >= 4
    if batch > 1:
        assert not torch.equal(sequences(expected)[0], sequences(expected)[1])


def test_long_form_tokens_and_return_dict_equal_generate() -> None:
    model = build()
    settings: dict[str, Any] = {**long_form(2), "max_new_tokens": NEW, "return_timestamps": True}
    assert torch.equal(ours(model, **settings), reference(model, **settings))
    # return_dict_in_generate with timestamps: Whisper's dict, each segment holding its call's output.
    expected = reference(model, **settings, return_dict_in_generate=True)
    got = ours(model, **settings, return_dict_in_generate=True)
    assert_segments_equal(got, expected)
    first, other = got["segments"][0][0]["result"], expected["segments"][0][0]["result"]
    assert torch.equal(first["sequences"], other["sequences"])


# -- prompts and conditioning on earlier segments ---------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "frames", "extra"),
    [
        (2, FRAMES, {}),
        (2, 200, {}),
        (1, 200, {"condition_on_prev_tokens": True, "prompt_condition_type": "all-segments"}),
    ],
)
def test_prompt_ids_equal_generate(batch: int, frames: int, extra: dict[str, Any]) -> None:
    model = build()
    inputs = long_form(batch) if frames > FRAMES else {"input_features": features(batch, frames)}
    settings: dict[str, Any] = {**inputs, "max_new_tokens": NEW, "return_timestamps": True, "return_segments": True}
    prompt = torch.tensor([5, 6, 7])
    expected = reference(model, **settings, **extra, prompt_ids=prompt)
    assert_segments_equal(ours(model, **settings, **extra, prompt_ids=prompt), expected)
    assert not torch.equal(sequences(reference(model, **settings, **extra)), sequences(expected))


def test_condition_on_previous_tokens_equals_generate() -> None:
    model = build()
    settings: dict[str, Any] = {**long_form(1), "max_new_tokens": NEW, "return_timestamps": True}
    expected = reference(model, **settings, condition_on_prev_tokens=True)
    assert torch.equal(ours(model, **settings, condition_on_prev_tokens=True), expected)
    assert not torch.equal(reference(model, **settings), expected)


@pytest.mark.parametrize("beams", [1, 2])
def test_conditioning_a_batch_on_segments_of_other_lengths_equals_generate(beams: int) -> None:
    """Whisper left-pads the rows' earlier segments of other lengths (a padded decoder mask and positions from
    it): the step reads both from static buffers, as for decoder-only prompts."""
    model = cachelife.enable(build())
    settings: dict[str, Any] = {
        **long_form(2), "max_new_tokens": NEW, "return_timestamps": True, "condition_on_prev_tokens": True,
        "num_beams": beams,
    }  # fmt: skip
    padded: list[bool] = []
    method = cachelife_generation_method.unsupported_prompt

    def watch(model: Any, model_kwargs: dict[str, Any]) -> str | None:
        padded.append(bool((model_kwargs.get("decoder_attention_mask", torch.ones(1)) == 0).any()))
        return method(model, model_kwargs)

    expected = reference(model, **settings)
    with unittest.mock.patch.object(cachelife_generation_method, "unsupported_prompt", watch):
        got = ours(model, **settings)
    assert any(padded)  # some segment's decoder prompt was padded, and decoded on the fast path
    assert torch.equal(sequences(got), sequences(expected))


# -- temperature fallback ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "threshold",
    [
        {"compression_ratio_threshold": 1.2},
        {"compression_ratio_threshold": 1.2, "num_beams": 2},
        {"logprob_threshold": -1.0},
        {"logprob_threshold": -1.0, "num_beams": 2},
    ],
)
def test_temperature_fallback_equals_generate(threshold: dict[str, Any]) -> None:
    """Greedy search (or beams) first, then sampling at higher temperatures with top_k=1 (one candidate: no
    draw to differ); logprob_threshold makes each call return its scores, which transformers averages between
    calls."""
    model = cachelife.enable(build())
    settings: dict[str, Any] = {
        **long_form(2), "max_new_tokens": NEW, "return_timestamps": True, "return_segments": True,
        "temperature": (0.0, 0.2, 0.4), "top_k": 1, "language": "en", **threshold,
    }  # fmt: skip
    counted = GenerateCalls(model)
    expected = reference(model, **settings)
    calls, leases = counted.calls, counted.leases
    assert_segments_equal(ours(model, **settings), expected)
    assert counted.leases - leases == calls
    counted.calls = 0
    reference(model, **{**settings, "temperature": 0.0})
    assert calls > counted.calls  # segments were decoded again at higher temperatures


def test_temperature_fallback_with_sampling_decodes_on_the_fast_path() -> None:
    """Sampled segments cannot equal generate's multinomial draws; they are reproducible and well formed."""
    model = cachelife.enable(build())
    settings: dict[str, Any] = {
        **long_form(2), "max_new_tokens": NEW, "return_timestamps": True, "return_segments": True,
        "temperature": (0.0, 0.5, 1.0), "compression_ratio_threshold": 1.2, "language": "en",
    }  # fmt: skip

    def sample(seed: int) -> Any:
        return ours(model, **settings, generator=torch.Generator().manual_seed(seed))

    counted = GenerateCalls(model)
    first = sample(3)
    sampled = counted.calls
    assert counted.leases == sampled  # every call, greedy or sampled, went through cachelife's method
    reference(model, **{**settings, "temperature": 0.0})
    assert counted.calls - sampled < sampled  # greedy alone makes fewer calls: segments were decoded again
    assert_segments_equal(sample(3), first)
    tokens = sequences(first)
    assert bool(((tokens >= 0) & (tokens < model.config.vocab_size)).all())
    for segments in first["segments"]:
        assert segments
        for segment in segments:
            assert float(segment["start"]) <= float(segment["end"])
            stamps = segment["tokens"][segment["tokens"] >= TIMESTAMP_BEGIN]
            assert bool((stamps[1:] >= stamps[:-1]).all())  # timestamps never decrease


# -- still left to transformers ----------------------------------------------------------------------------


def test_no_speech_detection_falls_back_by_name() -> None:
    """WhisperNoSpeechDetection runs a forward of its own and keeps a probability for the host between calls."""
    model = build()
    settings: dict[str, Any] = {
        **long_form(1), "max_new_tokens": NEW, "return_timestamps": True, "no_speech_threshold": 0.5,
        "logprob_threshold": -1.0, "temperature": 0.0,
    }  # fmt: skip
    with pytest.raises(UnsupportedGenerationError, match=r"no_speech_threshold \(Whisper\)"):
        ours(model, **settings)
    got = cachelife.generate(model, compile_step=False, **settings)
    assert torch.equal(sequences(got), reference(model, **settings))


# -- compiled ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.exhaustive
def test_compiled_long_form_decodes_every_segment_with_one_graph() -> None:
    """Each segment has its own prompt length, begin index and max_length (0-dim tensors in the step)."""
    torch._dynamo.reset()
    model = cachelife.enable(build())
    settings: dict[str, Any] = {
        **long_form(1), "max_new_tokens": NEW, "return_timestamps": True, "condition_on_prev_tokens": True,
    }  # fmt: skip
    expected = reference(model, **settings)
    assert torch.equal(sequences(cachelife.generate(model, fallback=False, **settings)), expected)
    graphs = int(counters["stats"]["unique_graphs"])
    prompted = {**settings, "prompt_ids": torch.tensor([5, 6]), "input_features": features(1, 250, seed=3)}
    got = cachelife.generate(model, fallback=False, **prompted)
    assert torch.equal(sequences(got), reference(model, **prompted))
    assert int(counters["stats"]["unique_graphs"]) == graphs
