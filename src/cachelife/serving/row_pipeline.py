"""The per-row pipeline: every row's scores through the stages of its own settings, and its token picked.

`process` runs the stages that `cachelife.serving.row_settings` lists, in transformers' order, each as
transformers' processor computes it for one row, with the row's values from `RowSettings`; a row that has a
stage off keeps its scores as they were (`torch.where`), bit for bit. `pick` then takes each running row's
token, greedy or sampled, as `greedy.pick_and_append` does for one request.
"""

from __future__ import annotations

import math

import torch

from cachelife.generation.greedy import append
from cachelife.generation.penalties import occurrence_penalised
from cachelife.generation.tensor_processors import repetition_penalised
from cachelife.serving.cumulative_sum import cumulative_sum
from cachelife.serving.row_ngrams import banned_ngrams
from cachelife.serving.row_settings import RowSettings


def process(settings: RowSettings, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor, *,
            sampling: bool, ngrams: bool = False) -> torch.Tensor:  # fmt: skip
    """Every row's scores (rows, vocab; float32) through the pipeline with its own values; `length` (rows, 1)
    is each row's token count. Without `sampling` the sampling stages are left out (no row samples), without
    `ngrams` the n-gram bans (no row bans n-grams)."""
    s = settings
    inf = -math.inf
    penalised = repetition_penalised(tokens, length, scores, s.penalty, s.ignore)
    scores = torch.where(s.penalty != 1.0, penalised, scores)
    if ngrams:
        scores = torch.where(banned_ngrams(tokens, length, s.ngram, scores.shape[-1]), inf, scores)
    scores = torch.where(s.eos & (length < s.min_length), inf, scores)
    scores = torch.where(s.eos & (length - s.prompt_length < s.min_new_tokens), inf, scores)
    ids = torch.arange(scores.shape[-1], device=scores.device)[None, :]
    scores = torch.where(length == s.bos_at, torch.where(ids == s.bos, 0.0, inf), scores)
    scores = torch.where(length == s.forced_eos_at, torch.where(s.forced_eos, 0.0, inf), scores)
    scores = torch.where(s.suppress, inf, scores)
    scores = torch.where(s.begin_suppress & (length == s.begin_at), inf, scores)
    penalised = occurrence_penalised(
        tokens, length, scores, presence=s.presence, frequency=s.frequency, skip=s.occurrences_from
    )
    scores = torch.where((s.presence != 0.0) | (s.frequency != 0.0), penalised, scores)
    if sampling:
        scores = _warped(s, scores)
    return torch.where(s.renormalize, scores.log_softmax(dim=-1), scores)


def _warped(s: RowSettings, scores: torch.Tensor) -> torch.Tensor:
    """The sampling stages, each as transformers' warper computes it for one row (rows that do not sample have
    every one off)."""
    inf = -math.inf
    scores = scores / s.temperature
    # TopK: the k-th largest score per row (the vocabulary's smallest where off: nothing below it).
    kth = scores.sort(dim=-1, descending=True).values.gather(1, s.top_k - 1)
    scores = scores.masked_fill(scores < kth, inf)
    # TopP
    ascending, order = torch.sort(scores, descending=False)
    cut = cumulative_sum(ascending.softmax(dim=-1)) <= s.top_p_cut
    cut[..., -1:] = False
    scores = torch.where(s.top_p_on, scores.masked_fill(cut.scatter(1, order, cut), inf), scores)
    # MinP
    probabilities = scores.softmax(dim=-1)
    low = probabilities < s.min_p * probabilities.amax(dim=-1, keepdim=True)
    low = low.scatter(-1, torch.topk(probabilities, 1, dim=-1).indices, False)
    scores = torch.where(s.min_p_on, scores.masked_fill(low, inf), scores)
    # Typical
    normalized = scores.log_softmax(dim=-1)
    entropy = -(normalized * normalized.exp()).nansum(-1, keepdim=True)
    shifted, order = torch.sort((-normalized - entropy).abs(), descending=False)
    cumulative = cumulative_sum(scores.gather(-1, order).softmax(dim=-1))
    last = (cumulative < s.typical_p).sum(dim=1).clamp(max=shifted.shape[-1] - 1)
    atypical = shifted > shifted.gather(1, last.view(-1, 1))
    atypical[..., :1] = False
    return torch.where(s.typical_on, scores.masked_fill(atypical.scatter(1, order, atypical), inf), scores)


def pick(settings: RowSettings, tokens: torch.Tensor, length: torch.Tensor, unfinished: torch.Tensor,
         scores: torch.Tensor, *, noise: torch.Tensor, running: torch.Tensor, sampling: bool) -> None:  # fmt: skip
    """Each running row's token (argmax, or an exponential race against `noise` where the row samples), the
    row's pad once it has ended, appended at its `length`: `greedy.pick_and_append` with a row's own rule."""
    token = scores.argmax(dim=-1)
    if sampling:
        raced = (torch.softmax(scores, dim=-1) / noise).argmax(dim=-1)
        token = torch.where(settings.do_sample, raced, token)
    token = torch.where(unfinished, token, settings.pad)
    open_after = unfinished & ~settings.eos.gather(1, token[:, None]).squeeze(1)
    append(tokens, length, unfinished, token, open_after=open_after, running=running)
