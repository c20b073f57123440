"""cachelife's decode loop: greedy tokens equal `generate`'s, sampling is reproducible, stopping is exact."""

from __future__ import annotations

import pytest
import torch

import cachelife
from cachelife.errors import InvalidArgumentError, UnsupportedGenerationError
from cachelife.generation.decode import decode
from cachelife.tools import zoo

NAMES = ["t5", "bart", "whisper", "llama"]


def neutral(name: str) -> zoo.ZooModel:
    built = zoo.build(name)
    built.model.generation_config.forced_eos_token_id = None  # BART's default; decode refuses it
    return built


def expected(built: zoo.ZooModel, inputs: zoo.Inputs, tokens: int) -> torch.Tensor:
    out = zoo.generate_tokens(built.model, inputs, do_sample=False, max_new_tokens=tokens)
    # Whisper's generate drops the decoder start token from what it returns; decode keeps it, as T5 and BART's do.
    if built.model.config.model_type == "whisper":
        start_id = built.model.generation_config.decoder_start_token_id
        assert isinstance(start_id, int)
        start = torch.full_like(out[:, :1], start_id)
        out = torch.cat([start, out], dim=1)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_greedy_eager_step_equals_generate(name: str) -> None:
    built = neutral(name)
    inputs = built.inputs(2, 9, 1)
    for tokens in (1, 5, 12):
        assert torch.equal(
            decode(built.model, inputs, max_new_tokens=tokens, compile_step=False), expected(built, inputs, tokens)
        )


@pytest.mark.parametrize("name", ["t5", "llama"])
def test_several_steps_per_call_give_the_same_tokens_for_any_length(name: str) -> None:
    built = neutral(name)
    inputs = built.inputs(2, 9, 1)
    for tokens in (1, 2, 4, 5, 12):  # 11 steps after prefill: not a multiple of 3 or 4
        reference = expected(built, inputs, tokens)
        for steps in (3, 4):
            out = decode(built.model, inputs, max_new_tokens=tokens, steps_per_call=steps, compile_step=False)
            assert torch.equal(out, reference), (tokens, steps)


def test_stops_where_generate_stops_when_every_sequence_ends() -> None:
    built = neutral("bart")  # the tiny BART ends both sequences after one token
    inputs = built.inputs(2, 9, 1)
    reference = expected(built, inputs, 20)
    assert reference.shape[1] < 21
    for every in (1, 3, 16):
        for steps in (1, 4):
            out = decode(
                built.model, inputs, max_new_tokens=20, stop_check_every=every, steps_per_call=steps, compile_step=False
            )
            assert torch.equal(out, reference)


def test_sequences_that_ended_are_padded_like_generate() -> None:
    built = neutral("llama")
    model = built.model
    inputs = built.inputs(3, 5, 2)
    free = decode(model, inputs, max_new_tokens=8, compile_step=False)
    model.generation_config.eos_token_id = int(free[0, 6])  # the first sequence now ends mid-way
    out = decode(model, inputs, max_new_tokens=8, compile_step=False)
    assert torch.equal(out, expected(built, inputs, 8))
    assert int(out[0, -1]) == model.generation_config.pad_token_id


def test_sampling_is_reproducible_with_a_seeded_generator() -> None:
    built = neutral("llama")
    inputs = built.inputs(2, 5, 1)

    def sample(seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return decode(
            built.model, inputs, max_new_tokens=10, do_sample=True, temperature=0.9, top_k=40, generator=generator,
            compile_step=False,
        )  # fmt: skip

    assert torch.equal(sample(3), sample(3))
    assert not torch.equal(sample(3), sample(4))


def test_settings_it_does_not_implement_are_refused() -> None:
    built = zoo.build("bart")
    with pytest.raises(UnsupportedGenerationError, match="sets forced_eos_token_id"):
        decode(built.model, built.inputs(1, 5, 1), max_new_tokens=3)
    built.model.generation_config.forced_eos_token_id = None
    built.model.generation_config.no_repeat_ngram_size = 3
    with pytest.raises(UnsupportedGenerationError, match="no_repeat_ngram_size"):
        decode(built.model, built.inputs(1, 5, 1), max_new_tokens=3)
    llama = neutral("llama")
    with pytest.raises(InvalidArgumentError, match=r"sampling needs a seeded torch\.Generator") as raised:
        decode(llama.model, llama.inputs(1, 5, 1), max_new_tokens=3, do_sample=True)
    assert isinstance(raised.value, ValueError)
    with pytest.raises(InvalidArgumentError, match="max_new_tokens, stop_check_every and steps_per_call must be ints"):
        decode(llama.model, llama.inputs(1, 5, 1), max_new_tokens=0)
    with pytest.raises(InvalidArgumentError, match=r"must be ints >= 1, got 3, 16 and 0"):
        decode(llama.model, llama.inputs(1, 5, 1), max_new_tokens=3, steps_per_call=0)


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("name", ["t5", "llama"])
def test_compiled_step_equals_generate_and_eager_sampling(name: str) -> None:
    torch._dynamo.reset()
    built = neutral(name)
    model = built.model
    inputs = built.inputs(2, 9, 1)
    cachelife.enable(model)
    for _ in range(2):
        assert torch.equal(decode(model, inputs, max_new_tokens=12), expected(built, inputs, 12))
    assert torch.equal(decode(model, inputs, max_new_tokens=12, steps_per_call=2), expected(built, inputs, 12))
    pool = cachelife.pool_of(model)
    assert pool is not None
    assert pool.hits == 1  # the second call decoded on the first call's buffers (the third's are longer)

    def sample(compile_step: bool) -> torch.Tensor:
        generator = torch.Generator().manual_seed(7)
        return decode(
            model, inputs, max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20, generator=generator,
            steps_per_call=2, compile_step=compile_step,
        )  # fmt: skip

    assert torch.equal(sample(True), sample(False))


def after_draws(seed: int, draws: int, shape: tuple[int, int]) -> torch.Tensor:
    """The state of a generator seeded with `seed` after `draws` draws of exponential noise of `shape`."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(draws):
        torch.empty(shape).exponential_(generator=generator)
    return generator.get_state()


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_a_sampled_call_leaves_its_generator_one_draw_per_token_step(steps_per_call: int) -> None:
    """Whatever the calls drew ahead (a call's steps, calls before the host saw the end), the generator is left
    as one (rows, vocab) draw per new token (before, 9 draws for 1 token at one step per call): the next call on
    it, or the next pass of one request (Whisper's segments), draws what it would after exactly those tokens."""
    built = zoo.build("llama")
    ends = list(range(40, 200, 10))  # many end tokens: some calls end long before their budget
    vocab = int(built.model.config.vocab_size)
    lengths = set()
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        tokens = cachelife.generate(
            built.model, **built.inputs(2, 4, seed), max_new_tokens=12, do_sample=True, top_k=3, eos_token_id=ends,
            generator=generator, steps_per_call=steps_per_call, compile_step=False, fallback=False,
        )  # fmt: skip
        assert isinstance(tokens, torch.Tensor)
        new = int(tokens.shape[1]) - 4
        lengths.add(new)
        assert torch.equal(generator.get_state(), after_draws(seed, new, (2, vocab))), (seed, new)
    assert len(lengths) > 1  # calls that ended at other steps
    assert min(lengths) < 12  # and before their budget
