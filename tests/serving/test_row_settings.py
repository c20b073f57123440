"""The engine's per-row pipeline against transformers' processors, one row at a time, bit for bit."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from transformers.generation import logits_process as lp

from cachelife.generation.penalties import OccurrencePenalty
from cachelife.serving.row_ngrams import LONGEST_NGRAM
from cachelife.serving.row_pipeline import pick, process
from cachelife.serving.row_settings import PerRow, RowSettings, per_row

VOCAB = 40
EOS = torch.tensor([3, 7])

# Each row's processors, as transformers' `_get_logits_processor` orders them; the prompt is 4 tokens long.
ROWS: list[tuple[bool, Callable[[], list[lp.LogitsProcessor]]]] = [
    (False, lambda: []),
    (True, lambda: [lp.TemperatureLogitsWarper(0.7)]),
    (True, lambda: [lp.TemperatureLogitsWarper(1.3), lp.TopKLogitsWarper(5)]),
    (True, lambda: [lp.TopPLogitsWarper(0.8)]),
    (True, lambda: [lp.TemperatureLogitsWarper(0.9), lp.MinPLogitsWarper(0.2)]),
    (True, lambda: [lp.TypicalLogitsWarper(0.7)]),
    (False, lambda: [lp.RepetitionPenaltyLogitsProcessor(1.5), lp.SuppressTokensLogitsProcessor([1, 2, 30])]),
    (
        True,
        lambda: [
            lp.RepetitionPenaltyLogitsProcessor(1.2, prompt_ignore_length=2),
            lp.MinLengthLogitsProcessor(6, EOS),
            lp.MinNewTokensLengthLogitsProcessor(4, 3, EOS),
            lp.SuppressTokensAtBeginLogitsProcessor([5, 6], 6),
            lp.TemperatureLogitsWarper(0.5),
            lp.TopKLogitsWarper(8),
            lp.TopPLogitsWarper(0.9),
            lp.LogitNormalization(),
        ],
    ),
    (False, lambda: [lp.ForcedBOSTokenLogitsProcessor(11), lp.ForcedEOSTokenLogitsProcessor(8, 7)]),
    (False, lambda: [lp.ForcedEOSTokenLogitsProcessor(7, [3, 9])]),
    (False, lambda: [lp.MinLengthLogitsProcessor(8, EOS)]),
    (False, lambda: [OccurrencePenalty(presence=0.5, frequency=0.3, prompt_length=2)]),
    (
        True,
        lambda: [
            lp.RepetitionPenaltyLogitsProcessor(1.1),
            OccurrencePenalty(presence=-0.4, frequency=1.5, prompt_length=4),
            lp.TemperatureLogitsWarper(0.8),
        ],
    ),
]


def _settings(lengths: list[int]) -> tuple[RowSettings, list[list[lp.LogitsProcessor]], list[PerRow]]:
    settings = RowSettings.allocate(len(ROWS), VOCAB, torch.device("cpu"))
    lists, values = [], []
    for row, (do_sample, make) in enumerate(ROWS):
        processors = make()
        found = per_row(processors, do_sample=do_sample, eos=EOS, pad=0)
        assert isinstance(found, PerRow), found
        settings.write(row, found)
        lists.append(processors)
        values.append(found)
    del lengths
    return settings, lists, values


@pytest.mark.parametrize("length", [1, 5, 6, 7, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_row_equals_its_own_processors(length: int, seed: int) -> None:
    # Lengths around the positions the rules act at: forced BOS at 1, begin suppression at 6, forced EOS at
    # 6 and 7, minimum lengths up to 8.
    generator = torch.Generator().manual_seed(seed)
    rows = len(ROWS)
    tokens = torch.randint(0, VOCAB, (rows, 12), generator=generator)
    scores = torch.randn(rows, VOCAB, generator=generator) * 3
    scores[:, 4] = scores[:, 9]  # a tie
    settings, lists, _ = _settings([length] * rows)
    got = process(settings, tokens, torch.full((rows, 1), length), scores.clone(), sampling=True)
    for row, processors in enumerate(lists):
        want = scores[row : row + 1].clone()
        for processor in processors:
            want = processor(tokens[row : row + 1, :length], want)
        assert torch.equal(got[row : row + 1], want), (row, processors)


def test_top_p_at_its_boundary_rounds_as_transformers() -> None:
    # Five equal scores: the first cumulative probability is 0.2 in float32, which transformers' comparison with
    # the double 1 - 0.8 removes (and a comparison with 1 - float32(0.8) would keep).
    settings = RowSettings.allocate(1, VOCAB, torch.device("cpu"))
    processors: list[lp.LogitsProcessor] = [lp.TopPLogitsWarper(0.8)]
    found = per_row(processors, do_sample=True, eos=EOS, pad=0)
    assert isinstance(found, PerRow)
    settings.write(0, found)
    scores = torch.full((1, VOCAB), -math.inf)
    scores[0, 10:15] = 1.0
    want = processors[0](torch.zeros(1, 3, dtype=torch.long), scores.clone())
    assert int(torch.isfinite(want).sum()) == 4
    got = process(settings, torch.zeros(1, 3, dtype=torch.long), torch.full((1, 1), 3), scores, sampling=True)
    assert torch.equal(got, want)


def test_greedy_rows_are_unchanged_by_the_sampling_variant() -> None:
    generator = torch.Generator().manual_seed(3)
    settings, _, values = _settings([])
    tokens = torch.randint(0, VOCAB, (len(ROWS), 12), generator=generator)
    scores = torch.randn(len(ROWS), VOCAB, generator=generator)
    length = torch.full((len(ROWS), 1), 5)
    with_sampling = process(settings, tokens, length, scores, sampling=True)
    without = process(settings, tokens, length, scores, sampling=False)
    for row, value in enumerate(values):
        if not value.do_sample:
            assert torch.equal(with_sampling[row], without[row]), row
        elif row in (1, 2, 3):
            assert not torch.equal(with_sampling[row], without[row]), row


def test_pick_uses_each_rows_rule() -> None:
    # Row 0 greedy, row 1 sampling; row 2 has ended (its pad), row 3 ends on its own end token.
    settings = RowSettings.allocate(4, VOCAB, torch.device("cpu"))
    for row, value in enumerate([
        PerRow(do_sample=False, eos=(3,), pad=0),
        PerRow(do_sample=True, eos=(3,), pad=0),
        PerRow(do_sample=False, eos=(3,), pad=17),
        PerRow(do_sample=False, eos=(5, 6), pad=0),
    ]):  # fmt: skip
        settings.write(row, value)
    scores = torch.full((4, VOCAB), -5.0)
    scores[:, 10] = 0.0
    scores[1, 20] = -0.5
    scores[3, 6] = 1.0
    noise = torch.ones(4, VOCAB)
    noise[1, 10] = 100.0  # the race picks 20 for the sampling row
    tokens = torch.zeros(4, 8, dtype=torch.long)
    length = torch.full((4,), 2)
    unfinished = torch.tensor([True, True, False, True])
    running = torch.ones(4, dtype=torch.bool)
    pick(settings, tokens, length, unfinished, scores, noise=noise, running=running, sampling=True)
    assert tokens[:, 2].tolist() == [10, 20, 17, 6]
    assert unfinished.tolist() == [True, True, False, False]
    assert length.tolist() == [3, 3, 3, 3]


@pytest.mark.parametrize(
    ("processors", "do_sample", "reason"),
    [
        ([lp.NoRepeatNGramLogitsProcessor(9)], False, "NoRepeatNGramLogitsProcessor of 9-grams"),
        ([lp.NoBadWordsLogitsProcessor([[4]], EOS)], False, "NoBadWordsLogitsProcessor"),
        ([lp.TopKLogitsWarper(5), lp.TemperatureLogitsWarper(0.5)], True, "an order of their own"),
        ([lp.TopKLogitsWarper(5, min_tokens_to_keep=2)], True, "min_tokens_to_keep"),
        ([lp.TemperatureLogitsWarper(0.5)], False, "without sampling"),
        ([lp.MinLengthLogitsProcessor(5, torch.tensor([9]))], False, "not the request's"),
    ],
)
def test_other_processors_are_named(processors: list[lp.LogitsProcessor], do_sample: bool, reason: str) -> None:
    found = per_row(processors, do_sample=do_sample, eos=EOS, pad=0)
    assert isinstance(found, str)
    assert reason in found


@pytest.mark.parametrize("seed", range(6))
def test_each_rows_ngram_bans_equal_transformers_processor_at_every_length(seed: int) -> None:
    # Sizes 0 (off) to LONGEST_NGRAM, one per row, over tokens of a few ids (repeats are frequent), every
    # length from 1 to the buffer's width; each row against NoRepeatNGramLogitsProcessor over its own tokens.
    sizes = [0, 1, 2, 3, 4, 5, LONGEST_NGRAM, 2]
    width = 14
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 3, (len(sizes), width), generator=generator)
    settings = RowSettings.allocate(len(sizes), VOCAB, torch.device("cpu"))
    processors: list[list[lp.LogitsProcessor]] = [
        [lp.NoRepeatNGramLogitsProcessor(size)] if size else [] for size in sizes
    ]
    for row, listed in enumerate(processors):
        found = per_row(listed, do_sample=False, eos=EOS, pad=0)
        assert isinstance(found, PerRow), found
        settings.write(row, found)
    banned = 0
    for length in range(1, width + 1):
        scores = torch.randn(len(sizes), VOCAB, generator=generator)
        got = process(settings, tokens, torch.full((len(sizes), 1), length), scores.clone(), sampling=False,
                      ngrams=True)  # fmt: skip
        for row, listed in enumerate(processors):
            want = scores[row : row + 1].clone()
            for processor in listed:
                want = processor(tokens[row : row + 1, :length], want)
            assert torch.equal(got[row : row + 1], want), (row, sizes[row], length)
        banned += int(torch.isinf(got).sum())
    assert banned > 0  # the rows' tokens repeat: some n-grams were banned


def test_rows_of_other_lengths_ban_their_own_ngrams() -> None:
    # One batch, each row at a length of its own (the engine's rows), left padding (0) in the second row.
    tokens = torch.tensor([[5, 6, 5, 6, 5, 0, 0, 0], [0, 0, 5, 6, 5, 6, 5, 9]])
    settings = RowSettings.allocate(2, VOCAB, torch.device("cpu"))
    for row in range(2):
        settings.write(row, PerRow(do_sample=False, eos=(3,), pad=0, no_repeat_ngram=2))
    length = torch.tensor([[5], [8]])
    got = process(settings, tokens, length, torch.zeros(2, VOCAB), sampling=False, ngrams=True)
    assert torch.isinf(got[0]).nonzero().view(-1).tolist() == [6]  # after 5: 5 6 seen
    assert torch.isinf(got[1]).nonzero().view(-1).tolist() == []  # after 9: nothing seen


def test_a_cleared_row_changes_no_score() -> None:
    settings = RowSettings.allocate(2, VOCAB, torch.device("cpu"))
    settings.write(0, PerRow(do_sample=True, eos=(3,), pad=0, temperature=0.5, top_k=3, suppress=(1,)))
    settings.clear(0)
    scores = torch.randn(2, VOCAB)
    scores[0, 0] = -math.inf
    tokens = torch.zeros(2, 4, dtype=torch.long)
    assert torch.equal(process(settings, tokens, torch.full((2, 1), 2), scores, sampling=True), scores)
