"""transformers' logits processors as tensor operations for a compiled decoding step.

`generate` builds its processor list (`GenerationMixin._get_logits_processor`, Whisper's own additions
merged in) and hands it to the decoding method; `tensor_processors` turns that list, in its order, into
functions `(tokens, length, scores) -> scores` that read the current length from a 0-dim tensor and the
tokens so far from a fixed-size buffer `(rows, width)`, so that one compiled step serves every position
without a host sync or a recompilation. transformers' processors that look only at the scores are called as
they are; the ones that read `input_ids.shape[-1]` (the length as a Python int) or the whole `input_ids`
are rewritten here with the same arithmetic, their own positions (begin index, prompt length, max_length - 1)
held as 0-dim tensors too, so that calls of other lengths share the compiled step:

| transformers processor                | here                                      |
|---------------------------------------|-------------------------------------------|
| SuppressTokensLogitsProcessor         | called                                    |
| TemperatureLogitsWarper               | called                                    |
| TopKLogitsWarper, TopPLogitsWarper    | called                                    |
| MinPLogitsWarper, TypicalLogitsWarper | called                                    |
| EpsilonLogitsWarper                   | called                                    |
| EtaLogitsWarper                       | rewritten (the entropy without torch.distributions' checks) |
| InfNanRemoveLogitsProcessor           | called                                    |
| LogitNormalization                    | called                                    |
| SuppressTokensAtBeginLogitsProcessor  | rewritten (`length == begin_index`)       |
| MinLengthLogitsProcessor              | rewritten (`length < min_length`)         |
| MinNewTokensLengthLogitsProcessor     | rewritten (`length - prompt < min_new`)   |
| ForcedBOSTokenLogitsProcessor         | rewritten (`length == 1`)                 |
| ForcedEOSTokenLogitsProcessor         | rewritten (`length == max_length - 1`)    |
| RepetitionPenaltyLogitsProcessor      | rewritten (tokens past `length` masked)   |
| NoRepeatNGramLogitsProcessor          | rewritten (n-grams ending past `length` masked) |
| NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor | rewritten (prefixes read at `length`) |
| EncoderNoRepeatNGramLogitsProcessor   | rewritten (the encoder's n-grams as tensors) |
| ExponentialDecayLengthPenalty         | rewritten (`length > start`, the power in float64) |

Any other processor (custom lists, `prefix_allowed_tokens_fn`, Whisper timestamps, ...) is named by
`unsupported_processor` so that the caller can fall back to transformers' own loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from attrs import frozen
from transformers.generation import logits_process as lp

# (tokens (rows, width), length (0-dim long), scores (rows, vocab)) -> scores
TensorProcessor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Processors that read only the scores: called as transformers wrote them.
_CALLED: tuple[type[lp.LogitsProcessor], ...] = (
    lp.SuppressTokensLogitsProcessor,
    lp.TemperatureLogitsWarper,
    lp.TopKLogitsWarper,
    lp.TopPLogitsWarper,
    lp.MinPLogitsWarper,
    lp.TypicalLogitsWarper,
    lp.EpsilonLogitsWarper,
    lp.InfNanRemoveLogitsProcessor,
    lp.LogitNormalization,
)


@frozen
class _Called:
    """A transformers processor that never reads `input_ids`."""

    processor: lp.LogitsProcessor

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.processor(tokens, scores)
        return result


def _vocab_mask(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    return torch.isin(torch.arange(scores.shape[-1], device=scores.device), ids)


@frozen
class _SuppressAtBegin:
    """SuppressTokensAtBeginLogitsProcessor: -inf on `ids` at the step where the length is `begin_index`."""

    ids: torch.Tensor
    begin_index: torch.Tensor  # 0-dim: a prompt length, not a compile-time constant

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        suppressed = torch.where(_vocab_mask(self.ids, scores), -float("inf"), scores)
        return torch.where(length == self.begin_index, suppressed, scores)


@frozen
class _NoEosBefore:
    """MinLength / MinNewTokensLength: -inf on the end tokens while `length - skip < minimum`."""

    eos: torch.Tensor
    minimum: torch.Tensor  # 0-dim: so that calls with other minimums share one compiled step and graph
    skip: torch.Tensor  # 0-dim: the prompt length for min_new_tokens, 0 for min_length

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        blocked = torch.where(_vocab_mask(self.eos, scores), -math.inf, scores)
        return torch.where(length - self.skip < self.minimum, blocked, scores)


@frozen
class _ForceAt:
    """ForcedBOS / ForcedEOS: at the step where the length is `at`, every score is -inf but `ids`' (0)."""

    ids: torch.Tensor
    at: torch.Tensor  # 0-dim: 1, or max_length - 1 (not a compile-time constant)

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(scores, -math.inf).index_fill(1, self.ids, 0.0)
        return torch.where(length == self.at, forced, scores)


@frozen
class _RepetitionPenalty:
    """RepetitionPenaltyLogitsProcessor on the tokens before `length` (and after `ignore`, per row)."""

    penalty: torch.Tensor  # 0-dim float32 (as the scores): other penalties share one compiled step and graph
    ignore: torch.Tensor | None

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        outside = positions[None, :] >= length
        if self.ignore is not None:
            outside = outside | (positions[None, :] < self.ignore[:, None])
        ids = tokens.masked_fill(outside, vocab).clamp(max=vocab)
        padded = torch.nn.functional.pad(scores, (0, 1))
        score = torch.gather(padded, 1, ids)
        score = torch.where(score < 0, score * self.penalty, score / self.penalty)
        return padded.scatter(1, ids, score)[..., :vocab]


@frozen
class _NoRepeatNGram:
    """NoRepeatNGramLogitsProcessor over the first `length` tokens of each row."""

    size: int

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n, width, vocab = self.size, tokens.shape[1], scores.shape[-1]
        offsets = torch.arange(n - 1, device=tokens.device)
        prefix_at = (length - (n - 1) + offsets).clamp(0, width - 1)
        prefix = tokens.index_select(1, prefix_at)  # the last n - 1 tokens
        windows = tokens.unfold(1, n, 1)  # (rows, width - n + 1, n)
        starts = torch.arange(windows.shape[1], device=tokens.device)
        complete = starts + n <= length  # windows wholly inside the sequence
        matches = (windows[..., :-1] == prefix.unsqueeze(1)).all(dim=-1) & complete[None, :]
        banned = scores.new_zeros((scores.shape[0], vocab + 1), dtype=torch.bool)
        banned = banned.scatter(1, torch.where(matches, windows[..., -1].clamp(max=vocab), vocab), True)
        masked = scores.masked_fill(banned[:, :vocab], -float("inf"))
        return torch.where(length >= n, masked, scores)


@frozen
class _SequenceBias:
    """SequenceBiasLogitsProcessor (and NoBadWords, its -inf case), prefixes matched before `length`."""

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
            tail = tokens.index_select(1, at)
            matching = (tail[:, None, :] == prefixes).all(dim=-1) & (length >= k + self.extra_context)
            bias = bias.index_add(1, last, torch.where(matching, biases, 0.0).to(bias.dtype))
        return scores + bias


@frozen
class _Eta:
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
class _EncoderNoRepeatNGram:
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


@frozen
class _ExponentialDecay:
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


# Attributes the rewrites read, as transformers 5.24 names them; a version without them falls back.
_READS: dict[type[lp.LogitsProcessor], tuple[str, ...]] = {
    lp.RepetitionPenaltyLogitsProcessor: ("penalty", "prompt_ignore_length"),
    lp.SequenceBiasLogitsProcessor: ("sequence_bias", "prepared_bias_variables"),
    lp.NoBadWordsLogitsProcessor: ("sequence_bias", "prepared_bias_variables"),
    lp.SuppressTokensAtBeginLogitsProcessor: ("begin_suppress_tokens", "begin_index"),
    lp.MinNewTokensLengthLogitsProcessor: ("prompt_length_to_skip", "min_new_tokens", "eos_token_id"),
    lp.EtaLogitsWarper: ("epsilon", "min_tokens_to_keep", "filter_value"),
    lp.EncoderNoRepeatNGramLogitsProcessor: ("ngram_size", "generated_ngrams", "batch_size"),
    lp.ExponentialDecayLengthPenalty: ("regulation_start", "regulation_factor", "eos_token_id"),
}


# The argument of `generate` (or of Whisper's) behind each processor cachelife leaves to transformers.
_ARGUMENT_OF: dict[str, str] = {
    "EncoderRepetitionPenaltyLogitsProcessor": "encoder_repetition_penalty",
    "PrefixConstrainedLogitsProcessor": "prefix_allowed_tokens_fn",
    "WhisperTimeStampLogitsProcessor": "return_timestamps (Whisper's timestamp rules)",
    "WhisperNoSpeechDetection": "no_speech_threshold (Whisper)",
    "ClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "HammingDiversityLogitsProcessor": "diversity_penalty",
    "SynthIDTextWatermarkLogitsProcessor": "watermarking_config",
    "WatermarkLogitsProcessor": "watermarking_config",
    "AlternatingCodebooksLogitsProcessor": "the model's codebook rules",
}


def unsupported_processor(processors: Sequence[lp.LogitsProcessor]) -> str | None:
    """The argument behind the first processor that `tensor_processors` cannot run (a custom processor by its
    class), or None."""
    known = (*_CALLED, *_REWRITTEN)
    for processor in processors:
        kind = type(processor)
        if kind not in known:
            name = kind.__name__
            return _ARGUMENT_OF.get(name, f"logits_processor (a {name}, which cachelife does not run)")
        missing = [name for name in _READS.get(kind, ()) if not hasattr(processor, name)]
        if missing:
            return f"{kind.__name__} of this transformers version (no {', '.join(missing)})"
    return None


def tensor_processors(
    processors: Sequence[lp.LogitsProcessor], *, vocab_size: int, device: torch.device
) -> tuple[TensorProcessor, ...]:
    """`processors`, in order, as tensor functions of (tokens, length, scores); see the module docstring."""
    return tuple(_convert(processor, vocab_size, device) for processor in processors)


def _scalar(value: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.long, device=device)


def _eos(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    return ids.to(device=device, dtype=torch.long).view(-1)


def _convert(processor: lp.LogitsProcessor, vocab_size: int, device: torch.device) -> TensorProcessor:  # noqa: PLR0911, PLR0912 (one case per processor class)
    match processor:
        case lp.SuppressTokensAtBeginLogitsProcessor():
            begin = _scalar(int(processor.begin_index), device)
            return _SuppressAtBegin(_eos(processor.begin_suppress_tokens, device), begin)
        case lp.MinLengthLogitsProcessor():
            minimum = _scalar(processor.min_length, device)
            return _NoEosBefore(_eos(processor.eos_token_id, device), minimum, _scalar(0, device))
        case lp.MinNewTokensLengthLogitsProcessor():
            eos, skip = _eos(processor.eos_token_id, device), _scalar(processor.prompt_length_to_skip, device)
            return _NoEosBefore(eos, _scalar(processor.min_new_tokens, device), skip)
        case lp.ForcedBOSTokenLogitsProcessor():
            return _ForceAt(torch.tensor([processor.bos_token_id], device=device), _scalar(1, device))
        case lp.ForcedEOSTokenLogitsProcessor():
            return _ForceAt(_eos(processor.eos_token_id, device), _scalar(processor.max_length - 1, device))
        case lp.RepetitionPenaltyLogitsProcessor():
            ignore = processor.prompt_ignore_length
            if isinstance(ignore, int):
                ignore = torch.tensor([ignore], device=device)
            penalty = torch.tensor(processor.penalty, dtype=torch.float32, device=device)
            return _RepetitionPenalty(penalty, None if ignore is None else ignore.to(device))
        case lp.NoRepeatNGramLogitsProcessor():
            return _NoRepeatNGram(processor.ngram_size)
        case lp.SequenceBiasLogitsProcessor():  # NoBadWordsLogitsProcessor included
            return _sequence_bias(processor, vocab_size, device)
        case lp.EtaLogitsWarper():
            return _Eta(processor.epsilon, int(processor.min_tokens_to_keep), float(processor.filter_value))
        case lp.EncoderNoRepeatNGramLogitsProcessor():
            return _encoder_ngrams(processor, vocab_size, device)
        case lp.ExponentialDecayLengthPenalty():
            start = _scalar(int(processor.regulation_start), device)
            factor = torch.tensor(float(processor.regulation_factor), dtype=torch.float64, device=device)
            eos = _eos(processor.eos_token_id, device)
            return _ExponentialDecay(eos, start, factor, _spares_infinite(processor, eos))
        case _:
            return _Called(processor)


def _sequence_bias(processor: lp.SequenceBiasLogitsProcessor, vocab_size: int, device: torch.device) -> _SequenceBias:
    """From the processor's `sequence_bias` ({token ids: bias}, in 5.17 and 5.24 alike): single tokens as one
    bias row, longer sequences grouped by prefix length, as 5.24 groups them."""
    if not processor.prepared_bias_variables:  # transformers' own check of the token ids against the vocabulary
        processor._prepare_bias_variables(torch.empty(1, vocab_size, device=device))
    entries: dict[tuple[int, ...], float] = processor.sequence_bias
    single = torch.zeros(vocab_size, dtype=torch.float, device=device)
    by_prefix: dict[int, list[tuple[tuple[int, ...], float]]] = {}
    for ids, bias in entries.items():
        if len(ids) == 1:
            single[ids[0]] = bias
        else:
            by_prefix.setdefault(len(ids) - 1, []).append((ids, bias))
    groups = tuple(
        (
            torch.tensor([ids[:-1] for ids, _ in group], device=device),
            torch.tensor([ids[-1] for ids, _ in group], device=device),
            torch.tensor([bias for _, bias in group], dtype=torch.float, device=device),
        )
        for group in by_prefix.values()
    )
    # 5.24 computes `multi_token_biases` and applies a sequence once its prefix fits; 5.17 has no such attribute
    # and waits until the whole sequence would fit.
    return _SequenceBias(single, groups, extra_context=0 if hasattr(processor, "multi_token_biases") else 1)


def _spares_infinite(processor: lp.ExponentialDecayLengthPenalty, eos: torch.Tensor) -> bool:
    """Whether this transformers version's penalty leaves an end token at -inf (asked of the processor itself,
    on one row past its start)."""
    probe = torch.zeros(1, int(eos.max()) + 1)
    probe[0, eos.cpu()] = -math.inf
    after = processor(torch.zeros(1, int(processor.regulation_start) + 1, dtype=torch.long), probe)
    return not bool(after.isnan().any())


def _encoder_ngrams(
    processor: lp.EncoderNoRepeatNGramLogitsProcessor, vocab_size: int, device: torch.device
) -> _EncoderNoRepeatNGram:
    """From the processor's own n-grams ({prefix: [next tokens]} per input), padded to one tensor."""
    size = int(processor.ngram_size)
    per_input = [
        [(prefix, token) for prefix, tokens in ngrams.items() for token in tokens]
        for ngrams in processor.generated_ngrams
    ]
    most = max(1, *(len(pairs) for pairs in per_input))
    prefixes = torch.full((len(per_input), most, size - 1), -1, dtype=torch.long)
    nexts = torch.full((len(per_input), most), vocab_size, dtype=torch.long)
    for row, pairs in enumerate(per_input):
        for column, (prefix, token) in enumerate(pairs):
            prefixes[row, column] = torch.tensor(prefix, dtype=torch.long)
            nexts[row, column] = token
    return _EncoderNoRepeatNGram(size, prefixes.to(device), nexts.to(device))


_REWRITTEN: tuple[type[lp.LogitsProcessor], ...] = (
    lp.SuppressTokensAtBeginLogitsProcessor,
    lp.MinLengthLogitsProcessor,
    lp.MinNewTokensLengthLogitsProcessor,
    lp.ForcedBOSTokenLogitsProcessor,
    lp.ForcedEOSTokenLogitsProcessor,
    lp.RepetitionPenaltyLogitsProcessor,
    lp.NoRepeatNGramLogitsProcessor,
    lp.SequenceBiasLogitsProcessor,
    lp.NoBadWordsLogitsProcessor,
    lp.EtaLogitsWarper,
    lp.EncoderNoRepeatNGramLogitsProcessor,
    lp.ExponentialDecayLengthPenalty,
)
