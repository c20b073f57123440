"""transformers' logits processors that read `input_ids`, expressed as tensor operations of (tokens, length,
scores) for a compiled step: the same arithmetic, the length a 0-dim tensor and the tokens a fixed-size buffer,
so that every position shares one compiled step (see `processors`, which picks them)."""

from __future__ import annotations

import math

import torch
from attrs import frozen


def vocab_mask(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    return torch.isin(torch.arange(scores.shape[-1], device=scores.device), ids)


@frozen
class SuppressAtBegin:
    """SuppressTokensAtBeginLogitsProcessor: -inf on `ids` at the step where the length is `begin_index`."""

    ids: torch.Tensor
    begin_index: torch.Tensor  # 0-dim: a prompt length, not a compile-time constant

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        suppressed = torch.where(vocab_mask(self.ids, scores), -float("inf"), scores)
        return torch.where(length == self.begin_index, suppressed, scores)


@frozen
class NoEosBefore:
    """MinLength / MinNewTokensLength: -inf on the end tokens while `length - skip < minimum`."""

    eos: torch.Tensor
    minimum: torch.Tensor  # 0-dim: so that calls with other minimums share one compiled step and graph
    skip: torch.Tensor  # 0-dim: the prompt length for min_new_tokens, 0 for min_length

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        blocked = torch.where(vocab_mask(self.eos, scores), -math.inf, scores)
        return torch.where(length - self.skip < self.minimum, blocked, scores)


@frozen
class ForceAt:
    """ForcedBOS / ForcedEOS: at the step where the length is `at`, every score is -inf but `ids`' (0)."""

    ids: torch.Tensor
    at: torch.Tensor  # 0-dim: 1, or max_length - 1 (not a compile-time constant)

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(scores, -math.inf).index_fill(1, self.ids, 0.0)
        return torch.where(length == self.at, forced, scores)


@frozen
class RepetitionPenalty:
    """RepetitionPenaltyLogitsProcessor on the tokens before `length` (and after `ignore`, per row)."""

    penalty: torch.Tensor  # 0-dim float32 (as the scores): other penalties share one compiled step and graph
    ignore: torch.Tensor | None

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return repetition_penalised(tokens, length, scores, self.penalty, self.ignore)


def repetition_penalised(
    tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor, penalty: torch.Tensor, ignore: torch.Tensor | None
) -> torch.Tensor:
    """`RepetitionPenalty`'s arithmetic; `penalty` 0-dim or one per row (rows, 1), `ignore` one per row."""
    vocab = scores.shape[-1]
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    outside = positions[None, :] >= length
    if ignore is not None:
        outside = outside | (positions[None, :] < ignore[:, None])
    ids = tokens.masked_fill(outside, vocab).clamp(max=vocab)
    padded = torch.nn.functional.pad(scores, (0, 1))
    score = torch.gather(padded, 1, ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return padded.scatter(1, ids, score)[..., :vocab]


@frozen
class NoRepeatNGram:
    """NoRepeatNGramLogitsProcessor over the first `length` tokens of each row: `length` is one for every row
    (0-dim) or each row's own ((rows, 1), the engine's rows)."""

    size: int

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n, width, vocab = self.size, tokens.shape[1], scores.shape[-1]
        offsets = torch.arange(n - 1, device=tokens.device)
        prefix_at = (length - (n - 1) + offsets).clamp(0, width - 1)
        prefix = tokens.gather(1, prefix_at.expand(tokens.shape[0], n - 1))  # the last n - 1 tokens
        windows = tokens.unfold(1, n, 1)  # (rows, width - n + 1, n)
        starts = torch.arange(windows.shape[1], device=tokens.device)
        complete = starts + n <= length  # windows wholly inside the sequence
        matches = (windows[..., :-1] == prefix.unsqueeze(1)).all(dim=-1) & complete
        banned = scores.new_zeros((scores.shape[0], vocab + 1), dtype=torch.bool)
        banned = banned.scatter(1, torch.where(matches, windows[..., -1].clamp(max=vocab), vocab), True)
        masked = scores.masked_fill(banned[:, :vocab], -float("inf"))
        return torch.where(length >= n, masked, scores)


@frozen
class SequenceBias:
    """SequenceBiasLogitsProcessor (and NoBadWords, its -inf case), prefixes matched before `length` (one length,
    0-dim, or one per row, (rows, 1))."""

    single: torch.Tensor  # (vocab,)
    groups: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]  # (prefixes, last tokens, biases)
    # A sequence with a prefix of k tokens applies once the sequence holds k + extra_context tokens: 0 in
    # transformers 5.24 (the prefix fits), 1 in 5.17 (the whole biased sequence would fit).
    extra_context: int

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        bias = torch.zeros_like(scores)
        bias += self.single
        width = tokens.shape[1]
        for prefixes, last, biases in self.groups:
            k = prefixes.shape[1]
            at = (length - k + torch.arange(k, device=tokens.device)).clamp(0, width - 1)
            tail = tokens.gather(1, at.expand(tokens.shape[0], k))
            matching = (tail[:, None, :] == prefixes).all(dim=-1) & (length >= k + self.extra_context)
            bias = bias.index_add(1, last, torch.where(matching, biases, 0.0).to(bias.dtype))
        return scores + bias


@frozen
class Eta:
    """EtaLogitsWarper, its entropy computed as `torch.distributions.Categorical(logits=scores).entropy()`
    computes it, without the distribution's argument checks (a host sync under a compiled step)."""

    epsilon: torch.Tensor
    min_tokens_to_keep: int
    filter_value: float

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probabilities = scores.softmax(dim=-1)
        normalized = scores - scores.logsumexp(dim=-1, keepdim=True)
        smallest = torch.finfo(normalized.dtype).min
        entropy = -(normalized.clamp(min=smallest) * normalized.softmax(dim=-1)).sum(-1)
        epsilon = self.epsilon.to(scores.device)
        eta = torch.min(epsilon, torch.sqrt(epsilon) * torch.exp(-entropy))[..., None]
        top_k = min(self.min_tokens_to_keep, scores.size(-1))
        remove = (probabilities < eta) & (scores < torch.topk(scores, top_k)[0][..., -1, None])
        return scores.masked_fill(remove, self.filter_value)


@frozen
class EncoderNoRepeatNGram:
    """EncoderNoRepeatNGramLogitsProcessor: the tokens that would complete an n-gram of the encoder's input
    after the last n - 1 tokens, per input (beams of one input share its n-grams)."""

    size: int
    prefixes: torch.Tensor  # (batch, most n-grams of one input, n - 1), padded
    nexts: torch.Tensor  # (batch, most n-grams), padded with the vocabulary size (a spare column)

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows, width, vocab = tokens.shape[0], tokens.shape[1], scores.shape[-1]
        inputs = torch.arange(rows, device=tokens.device) // (rows // self.prefixes.shape[0])
        at = (length - (self.size - 1) + torch.arange(self.size - 1, device=tokens.device)).clamp(0, width - 1)
        last = tokens.index_select(1, at)  # (rows, n - 1)
        matches = (self.prefixes[inputs] == last[:, None, :]).all(dim=-1) & (length >= self.size - 1)
        banned = scores.new_zeros((rows, vocab + 1), dtype=torch.bool)
        banned = banned.scatter(1, torch.where(matches, self.nexts[inputs].clamp(max=vocab), vocab), True)
        return scores.masked_fill(banned[:, :vocab], -float("inf"))


@frozen(kw_only=True)
class ExponentialDecay:
    """ExponentialDecayLengthPenalty: once `length > start`, the end tokens' scores grow by
    |score| * (factor ** (length - start) - 1), the power in float64 as Python computes it."""

    eos: torch.Tensor
    start: torch.Tensor  # 0-dim: the prompt length plus the configured start
    factor: torch.Tensor  # 0-dim float64
    # transformers 5.24 leaves an end token's -inf as it is; 5.17 adds an infinite penalty to it (NaN).
    spares_infinite: bool

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        at_eos = scores.index_select(1, self.eos)
        growth = (torch.pow(self.factor, (length - self.start).to(torch.float64)) - 1).to(scores.dtype)
        penalty = at_eos.abs() * growth
        if self.spares_infinite:
            penalty = penalty.masked_fill(~torch.isfinite(at_eos), 0.0)
        penalised = scores.index_copy(1, self.eos, at_eos + penalty)
        return torch.where(length > self.start, penalised, scores)


@frozen(kw_only=True)
class WhisperTimestamps:
    """WhisperTimeStampLogitsProcessor, for every row at once: no `<|notimestamps|>`; timestamps in pairs (after
    two, text; after one, a timestamp or the end); none below the last one (nor the last one again, unless it
    opens a pair); at `begin_index`, a timestamp no later than `max_initial`; and only timestamps where their
    summed probability beats every text token's."""

    no_timestamps: int
    timestamp_begin: int
    eos: int  # the first id of the ones that stay allowed after a lone timestamp
    begin_index: torch.Tensor  # 0-dim (or per row): the decoder prompt's length, which changes by segment
    max_initial: int | None  # the last allowed first timestamp, as an offset from timestamp_begin
    from_logprob: bool

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """`length` and `begin_index` 0-dim (one for every row) or (rows, 1) (each row's own: an engine's)."""
        begin, width = self.timestamp_begin, tokens.shape[1]
        ids = torch.arange(scores.shape[-1], device=scores.device)
        is_timestamp = ids >= begin
        scores = scores.masked_fill(ids == self.no_timestamps, -math.inf)
        lengths = length.reshape(-1, 1).expand(tokens.shape[0], 1)
        count = (lengths - self.begin_index).squeeze(1)  # tokens generated so far
        last = tokens.gather(1, (lengths - 1).clamp(0, width - 1)).squeeze(1)
        before_last = tokens.gather(1, (lengths - 2).clamp(0, width - 1)).squeeze(1)
        last_was = (count >= 1) & (last >= begin)
        before_last_was = (count < 2) | (before_last >= begin)
        pair_done, pair_open = last_was & before_last_was, last_was & ~before_last_was
        scores = scores.masked_fill(pair_done[:, None] & is_timestamp, -math.inf)
        scores = scores.masked_fill(pair_open[:, None] & (ids < self.eos), -math.inf)
        # The generated timestamps, and the last of them by position.
        positions = torch.arange(width, device=tokens.device)[None, :]
        generated = (positions >= self.begin_index) & (positions < lengths)
        stamps = generated & (tokens >= begin)
        latest = torch.where(stamps, positions, -1).amax(dim=1)
        latest_token = tokens.gather(1, latest.clamp(min=0)[:, None]).squeeze(1)
        lowest = torch.where(pair_open, latest_token, latest_token + 1)
        lowest = torch.where(latest >= 0, lowest, begin)
        scores = scores.masked_fill(is_timestamp & (ids < lowest[:, None]), -math.inf)
        initial = ids < begin
        if self.max_initial is not None:
            initial = initial | (ids > begin + self.max_initial)
        scores = scores.masked_fill((lengths == self.begin_index) & initial, -math.inf)
        if not self.from_logprob:
            return scores
        logprobs = torch.nn.functional.log_softmax(scores.float(), dim=-1)
        timestamp = logprobs[:, begin:].logsumexp(dim=-1)
        best_text = logprobs[:, :begin].max(dim=-1).values
        return scores.masked_fill((timestamp > best_text)[:, None] & ~is_timestamp, -math.inf)
