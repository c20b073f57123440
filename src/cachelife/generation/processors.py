"""transformers' logits processors as tensor operations for a compiled decoding step.

`generate` builds its processor list (`GenerationMixin._get_logits_processor`, Whisper's own additions
merged in) and hands it to the decoding method; `tensor_processors` turns that list, in its order, into
functions `(tokens, length, scores) -> scores` that read the current length from a 0-dim tensor and the
tokens so far from a fixed-size buffer `(rows, width)`, so that one compiled step serves every position
without a host sync or a recompilation. transformers' processors that look only at the scores are called as
they are; the ones that read `input_ids.shape[-1]` (the length as a Python int) or the whole `input_ids`
are expressed again (`tensor_processors`) with the same arithmetic, their own positions (begin index, prompt length,
max_length - 1) held as 0-dim tensors too, so that calls of other lengths share the compiled step:

| transformers processor                | here                                      |
|---------------------------------------|-------------------------------------------|
| SuppressTokensLogitsProcessor         | called                                    |
| TemperatureLogitsWarper               | called                                    |
| TopKLogitsWarper, TopPLogitsWarper    | called                                    |
| MinPLogitsWarper, TypicalLogitsWarper | called                                    |
| EpsilonLogitsWarper                   | called                                    |
| EtaLogitsWarper                       | tensor form (the entropy without torch.distributions' checks) |
| InfNanRemoveLogitsProcessor           | called                                    |
| LogitNormalization                    | called                                    |
| SuppressTokensAtBeginLogitsProcessor  | tensor form (`length == begin_index`)     |
| MinLengthLogitsProcessor              | tensor form (`length < min_length`)       |
| MinNewTokensLengthLogitsProcessor     | tensor form (`length - prompt < min_new`) |
| ForcedBOSTokenLogitsProcessor         | tensor form (`length == 1`)               |
| ForcedEOSTokenLogitsProcessor         | tensor form (`length == max_length - 1`)  |
| RepetitionPenaltyLogitsProcessor      | tensor form (tokens past `length` masked) |
| NoRepeatNGramLogitsProcessor          | tensor form (n-grams ending past `length` masked) |
| NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor | tensor form (prefixes read at `length`) |
| EncoderNoRepeatNGramLogitsProcessor   | tensor form (the encoder's n-grams as tensors) |
| ExponentialDecayLengthPenalty         | tensor form (`length > start`, the power in float64) |
| WhisperTimeStampLogitsProcessor       | tensor form (the generated tokens from `begin_index` to `length`) |
| cachelife's OccurrencePenalty (`penalties`) | tensor form (tokens from the prompt's end to `length` counted) |

Whisper's generate moves the begin index of its processors to each segment's decoder prompt
(`set_begin_index`) before it calls the decoding method; the tensor processors read it when the method converts them.
Any other processor (custom lists, `prefix_allowed_tokens_fn`, Whisper's no-speech detection, ...) is named by
`unsupported_processor` so that the caller can fall back to transformers' own loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from attrs import frozen
from transformers.generation import logits_process as lp

from cachelife.errors import UnsupportedGenerationError
from cachelife.generation.penalties import OccurrencePenalty, Occurrences
from cachelife.generation.tensor_processors import (
    EncoderNoRepeatNGram,
    Eta,
    ExponentialDecay,
    ForceAt,
    NoEosBefore,
    NoRepeatNGram,
    RepetitionPenalty,
    SequenceBias,
    SuppressAtBegin,
    WhisperTimestamps,
)

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
class Called:
    """A transformers processor that never reads `input_ids`."""

    processor: lp.LogitsProcessor

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.processor(tokens, scores)
        return result


# Attributes the tensor processors read, as transformers 5.24 names them; a version without them falls back.
_READS: dict[type[lp.LogitsProcessor], tuple[str, ...]] = {
    lp.RepetitionPenaltyLogitsProcessor: ("penalty", "prompt_ignore_length"),
    lp.SequenceBiasLogitsProcessor: ("sequence_bias", "prepared_bias_variables"),
    lp.NoBadWordsLogitsProcessor: ("sequence_bias", "prepared_bias_variables"),
    lp.SuppressTokensAtBeginLogitsProcessor: ("begin_suppress_tokens", "begin_index"),
    lp.MinNewTokensLengthLogitsProcessor: ("prompt_length_to_skip", "min_new_tokens", "eos_token_id"),
    lp.EtaLogitsWarper: ("epsilon", "min_tokens_to_keep", "filter_value"),
    lp.EncoderNoRepeatNGramLogitsProcessor: ("ngram_size", "generated_ngrams", "batch_size"),
    lp.ExponentialDecayLengthPenalty: ("regulation_start", "regulation_factor", "eos_token_id"),
    lp.WhisperTimeStampLogitsProcessor: (
        "no_timestamps_token_id",
        "timestamp_begin",
        "eos_token_id",
        "begin_index",
        "max_initial_timestamp_index",
        "_detect_timestamp_from_logprob",
    ),
}


# The argument of `generate` (or of Whisper's) behind each processor cachelife leaves to transformers.
_ARGUMENT_OF: dict[str, str] = {
    "EncoderRepetitionPenaltyLogitsProcessor": "encoder_repetition_penalty",
    "PrefixConstrainedLogitsProcessor": "prefix_allowed_tokens_fn",
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
    known = (*_CALLED, *_AS_TENSORS)
    for processor in processors:
        kind = type(processor)
        if kind not in known:
            name = kind.__name__
            return _ARGUMENT_OF.get(name, f"logits_processor (a {name}, which cachelife does not run)")
        missing = [name for name in _READS.get(kind, ()) if not hasattr(processor, name)]
        if missing:
            return f"{kind.__name__} of this transformers version (no {', '.join(missing)})"
        if isinstance(processor, lp.WhisperTimeStampLogitsProcessor) and not isinstance(processor.eos_token_id, int):
            return "Whisper's timestamp rules with several end tokens (transformers' own slices by one)"
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
            return SuppressAtBegin(_eos(processor.begin_suppress_tokens, device), begin)
        case lp.MinLengthLogitsProcessor():
            minimum = _scalar(processor.min_length, device)
            return NoEosBefore(_eos(processor.eos_token_id, device), minimum, _scalar(0, device))
        case lp.MinNewTokensLengthLogitsProcessor():
            eos, skip = _eos(processor.eos_token_id, device), _scalar(processor.prompt_length_to_skip, device)
            return NoEosBefore(eos, _scalar(processor.min_new_tokens, device), skip)
        case lp.ForcedBOSTokenLogitsProcessor():
            return ForceAt(torch.tensor([processor.bos_token_id], device=device), _scalar(1, device))
        case lp.ForcedEOSTokenLogitsProcessor():
            return ForceAt(_eos(processor.eos_token_id, device), _scalar(processor.max_length - 1, device))
        case lp.RepetitionPenaltyLogitsProcessor():
            ignore = processor.prompt_ignore_length
            if isinstance(ignore, int):
                ignore = torch.tensor([ignore], device=device)
            penalty = torch.tensor(processor.penalty, dtype=torch.float32, device=device)
            return RepetitionPenalty(penalty, None if ignore is None else ignore.to(device))
        case lp.NoRepeatNGramLogitsProcessor():
            return NoRepeatNGram(processor.ngram_size)
        case lp.SequenceBiasLogitsProcessor():  # NoBadWordsLogitsProcessor included
            return _sequence_bias(processor, vocab_size, device)
        case lp.EtaLogitsWarper():
            return Eta(processor.epsilon, int(processor.min_tokens_to_keep), float(processor.filter_value))
        case lp.EncoderNoRepeatNGramLogitsProcessor():
            return _encoder_ngrams(processor, vocab_size, device)
        case lp.ExponentialDecayLengthPenalty():
            start = _scalar(int(processor.regulation_start), device)
            factor = torch.tensor(float(processor.regulation_factor), dtype=torch.float64, device=device)
            eos = _eos(processor.eos_token_id, device)
            return ExponentialDecay(
                eos=eos, start=start, factor=factor, spares_infinite=_spares_infinite(processor, eos)
            )
        case lp.WhisperTimeStampLogitsProcessor():
            return _whisper_timestamps(processor, device)
        case OccurrencePenalty():
            return Occurrences.of(processor, device)
        case _:
            return Called(processor)


def _sequence_bias(processor: lp.SequenceBiasLogitsProcessor, vocab_size: int, device: torch.device) -> SequenceBias:
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
    return SequenceBias(single, groups, extra_context=0 if hasattr(processor, "multi_token_biases") else 1)


def _spares_infinite(processor: lp.ExponentialDecayLengthPenalty, eos: torch.Tensor) -> bool:
    """Whether this transformers version's penalty leaves an end token at -inf (asked of the processor itself,
    on one row past its start)."""
    probe = torch.zeros(1, int(eos.max()) + 1)
    probe[0, eos.cpu()] = -math.inf
    after = processor(torch.zeros(1, int(processor.regulation_start) + 1, dtype=torch.long), probe)
    return not bool(after.isnan().any())


def _encoder_ngrams(
    processor: lp.EncoderNoRepeatNGramLogitsProcessor, vocab_size: int, device: torch.device
) -> EncoderNoRepeatNGram:
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
    return EncoderNoRepeatNGram(size, prefixes.to(device), nexts.to(device))


def _whisper_timestamps(processor: lp.WhisperTimeStampLogitsProcessor, device: torch.device) -> WhisperTimestamps:
    """From the processor's attributes as they are at this call: Whisper's generate sets `begin_index` per
    segment."""
    initial, eos = processor.max_initial_timestamp_index, processor.eos_token_id
    if not isinstance(eos, int):  # refused by unsupported_processor
        msg = f"Whisper's timestamp rules need one end token, got eos_token_id={eos!r}"
        raise UnsupportedGenerationError(msg)
    return WhisperTimestamps(
        no_timestamps=int(processor.no_timestamps_token_id),
        timestamp_begin=int(processor.timestamp_begin),
        eos=eos,
        begin_index=_scalar(int(processor.begin_index), device),
        max_initial=None if initial is None else int(initial),
        from_logprob=bool(processor._detect_timestamp_from_logprob),
    )


_AS_TENSORS: tuple[type[lp.LogitsProcessor], ...] = (
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
    lp.WhisperTimeStampLogitsProcessor,
    OccurrencePenalty,
)
