"""cachelife's own decode loop, in the gpt-fast style, for encoder-decoder and decoder-only models.

`decode(model, inputs, max_new_tokens=...)` runs prefill eagerly, then one compiled step per token that
includes token selection (greedy, or sampling from a seeded `torch.Generator`) and end-of-sequence
bookkeeping, on pinned caches created before anything compiled runs. The host reads nothing from the
device while decoding, except every `stop_check_every` steps to see whether every sequence has ended. It
returns what `generate` returns by default: the decoder's tokens (encoder-decoder), or prompt and new
tokens (decoder-only), padded after each sequence's end-of-sequence token.

`steps_per_call=n` compiles n steps into one graph, so the host's fixed cost per graph call (guards,
CUDA-graph input checks, one launch) is paid once every n tokens; the cache then holds up to n - 1 more
positions, decoded and dropped.

It implements greedy search and plain sampling (temperature, top-k) only. A model whose generation config
asks for more (forced or suppressed tokens, repetition penalties, minimum lengths, ...) is refused with
`UnsupportedGenerationError` instead of decoding differently from `generate`. Prompts must not be padded.

`encoder_buckets=(64, 128, ...)` pads the encoder output and its attention mask to the smallest bucket that
fits before the cache is pinned (`cachelife.integration.buckets`), so that encoder lengths within one bucket share one
cross-attention cache shape and one compiled step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from attrs import frozen
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

from cachelife.core.pinning import prepare_static_cache
from cachelife.errors import InvalidArgumentError, UnsupportedGenerationError
from cachelife.integration.buckets import Buckets, check_bucketable, check_buckets, pad_encoder_states
from cachelife.integration.call_arguments import cache_argument_name
from cachelife.integration.compile_cache import pinned_compile_cache
from cachelife.integration.compiled import call_step
from cachelife.integration.enabling import pool_of
from cachelife.integration.runtime import collecting_after_compilation, runtime_of
from cachelife.validate import is_int_at_least

# Generation-config fields whose logits processors this loop does not apply, with their neutral values.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "bad_words_ids": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "forced_decoder_ids": (None,),
    "sequence_bias": (None,),
    "exponential_decay_length_penalty": (None,),
}

StepFunction = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def decode(
    model: PreTrainedModel,
    inputs: dict[str, torch.Tensor],
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    stop_check_every: int = 16,
    steps_per_call: int = 1,
    compile_step: bool = True,
    encoder_buckets: Sequence[int] | None = None,
) -> torch.Tensor:
    """Generate up to `max_new_tokens` tokens; see the module docstring."""
    _check_generation_config(model)
    buckets = None if encoder_buckets is None else check_buckets(encoder_buckets)
    if buckets is not None:
        check_bucketable(model)
    if not all(is_int_at_least(count, 1) for count in (max_new_tokens, stop_check_every, steps_per_call)):
        msg = (
            "max_new_tokens, stop_check_every and steps_per_call must be ints >= 1, got "
            f"{max_new_tokens}, {stop_check_every} and {steps_per_call}"
        )
        raise InvalidArgumentError(msg)
    if do_sample and generator is None:
        msg = "sampling needs a seeded torch.Generator on the model's device (generator=...)"
        raise InvalidArgumentError(msg)
    config = model.generation_config
    eos = _eos_ids(config.eos_token_id, model.device)
    pad = config.pad_token_id if config.pad_token_id is not None else (int(eos[0]) if eos.numel() else 0)
    # The first token comes from prefill, the rest in whole calls of `steps_per_call` steps; tokens past
    # max_new_tokens are decoded (the cache holds them) and dropped.
    calls = -(-(max_new_tokens - 1) // steps_per_call)
    with runtime_of(model).lock, collecting_after_compilation(), torch.no_grad(), pinned_compile_cache():
        prompt, step_inputs, first_logits = _prefill(model, inputs, 1 + calls * steps_per_call, buckets)
        batch = prompt.shape[0]
        noise = _Noise(generator if do_sample else None, steps_per_call, batch, first_logits.shape[-1], model.device)
        how = _Selection(do_sample, temperature, top_k, eos, pad)
        step = _compiled_steps(model) if compile_step else _decode_n_tokens
        finished = torch.zeros(batch, 1, dtype=torch.bool, device=model.device)
        token, finished = _select(first_logits, noise.next()[0], finished, how)
        tokens, produced, checked_at, calls = [token], 1, 0, 0
        while produced < max_new_tokens:
            if produced - checked_at >= stop_check_every and eos.numel():
                checked_at = produced
                if bool(finished.all()):
                    break
            # Guards are checked in full on the first two calls: the first token's strides differ from the
            # later ones', which are all alike.
            new, finished = call_step(
                step, calls < 2, model, token, finished, noise.next(), how=how, step_inputs=step_inputs,
                steps=steps_per_call,
            )  # fmt: skip
            calls += 1
            # CUDA-graph outputs are overwritten by the next replay: keep copies.
            new, finished = new.clone(), finished.clone()
            token = new[:, -1:]
            tokens.append(new)
            produced += steps_per_call
    new = torch.cat(tokens, dim=1)[:, :max_new_tokens]
    return torch.cat([prompt, _trim_after_all_ended(new, eos)], dim=1)


def _check_generation_config(model: PreTrainedModel) -> None:
    config = model.generation_config
    active = sorted(name for name, neutral in _NEUTRAL.items() if getattr(config, name, None) not in neutral)
    if active:
        msg = (
            f"{type(model).__name__}'s generation config sets {', '.join(active)}, whose logits processors "
            "cachelife.decode does not apply; set them to None on model.generation_config, or use generate"
        )
        raise UnsupportedGenerationError(msg)


def _eos_ids(value: object, device: torch.device) -> torch.Tensor:
    if value is None:
        ids: list[int] = []
    elif isinstance(value, int):
        ids = [value]
    elif isinstance(value, Iterable):
        ids = [int(item) for item in value]
    else:
        msg = f"eos_token_id must be an int, a list of ints or None, got {value!r}"
        raise UnsupportedGenerationError(msg)
    return torch.tensor(ids, dtype=torch.long, device=device)


def _prefill(
    model: PreTrainedModel, inputs: dict[str, torch.Tensor], new_tokens: int, buckets: Buckets | None
) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor]:
    """Eager prefill on a cache for `new_tokens` more tokens: the prompt (or decoder start), the fixed step
    inputs, and the first logits."""
    name = cache_argument_name(model)
    pool = pool_of(model)
    if model.config.is_encoder_decoder:
        encoder_out = model.get_encoder()(**inputs)
        hidden: torch.Tensor = encoder_out[0]
        mask = inputs.get("attention_mask")
        if buckets is not None:
            hidden, mask = pad_encoder_states(hidden, mask, buckets)
        batch, encoder_length = int(hidden.shape[0]), int(hidden.shape[1])
        start = model.generation_config.decoder_start_token_id
        if start is None:
            start = model.config.decoder_start_token_id
        if not isinstance(start, int):
            msg = f"cachelife.decode needs one decoder start token id, got {start!r}"
            raise UnsupportedGenerationError(msg)
        prompt = torch.full((batch, 1), start, dtype=torch.long, device=model.device)
        cache = prepare_static_cache(
            model, batch_size=batch, max_cache_len=new_tokens + 1, encoder_length=encoder_length, pool=pool
        )
        step_inputs: dict[str, Any] = {"encoder_outputs": BaseModelOutput(last_hidden_state=hidden), name: cache}
        if mask is not None:
            step_inputs["attention_mask"] = mask
        for tensor in (hidden, step_inputs.get("attention_mask")):
            if isinstance(tensor, torch.Tensor):
                torch._dynamo.mark_static_address(tensor)  # the same tensors every step: no copy into the graph
        output = model(decoder_input_ids=prompt, use_cache=True, **step_inputs)
    else:
        prompt = inputs["input_ids"]
        batch = int(prompt.shape[0])
        cache = prepare_static_cache(
            model, batch_size=batch, max_cache_len=int(prompt.shape[1]) + new_tokens, pool=pool
        )
        step_inputs = {name: cache}
        output = model(input_ids=prompt, use_cache=True, **step_inputs)
    return prompt, step_inputs, output.logits[:, -1].float()


class _Noise:
    """Exponential noise for the steps of one call, from the caller's generator, written in place into one
    static buffer (ones, unused, for greedy search)."""

    def __init__(
        self, generator: torch.Generator | None, steps: int, batch: int, vocab: int, device: torch.device
    ) -> None:
        self.generator = generator
        self.buffer = torch.ones(steps, batch, vocab, device=device)
        torch._dynamo.mark_static_address(self.buffer)

    def next(self) -> torch.Tensor:
        if self.generator is not None:
            self.buffer.exponential_(generator=self.generator)
        return self.buffer


@frozen
class _Selection:
    """How tokens are chosen and sequences end; the same for every step of one `decode` call."""

    do_sample: bool
    temperature: float
    top_k: int | None
    eos: torch.Tensor
    pad: int


def _select(
    logits: torch.Tensor, noise: torch.Tensor, finished: torch.Tensor, how: _Selection
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per sequence (argmax, or an exponential race: sampling from softmax(logits / T)), padded
    for sequences that had already ended, and the updated end flags."""
    if how.do_sample:
        scores = logits / how.temperature
        if how.top_k is not None:
            kth = torch.topk(scores, min(how.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        token = (torch.softmax(scores, dim=-1) / noise).argmax(dim=-1, keepdim=True)
    else:
        token = logits.argmax(dim=-1, keepdim=True)
    token = torch.where(finished, torch.full_like(token, how.pad), token)
    if not how.eos.numel():
        return token, finished
    return token, finished | (token == how.eos.view(1, -1)).any(dim=-1, keepdim=True)


def _decode_n_tokens(
    model: PreTrainedModel,
    token: torch.Tensor,
    finished: torch.Tensor,
    noise: torch.Tensor,
    *,
    how: _Selection,
    step_inputs: dict[str, Any],
    steps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` decoding steps in a row, each a forward call and token selection (the function that gets
    compiled): one graph launch, and one pass of the host over guards and graph inputs, for all of them."""
    key = "decoder_input_ids" if model.config.is_encoder_decoder else "input_ids"
    new = []
    for index in range(steps):
        output = model(**{key: token}, use_cache=True, **step_inputs)
        token, finished = _select(output.logits[:, -1].float(), noise[index], finished, how)
        new.append(token)
    return torch.cat(new, dim=1), finished


def _compiled_steps(model: PreTrainedModel) -> StepFunction:
    """The compiled steps of this model (CUDA graphs on a GPU, inductor elsewhere), compiled once per
    `steps`."""
    functions = runtime_of(model).compiled
    if ("decode",) not in functions:
        mode = "reduce-overhead" if model.device.type == "cuda" else "default"
        functions[("decode",)] = torch.compile(_decode_n_tokens, mode=mode, fullgraph=True)
    return functions[("decode",)]


def _trim_after_all_ended(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Cut the steps run after every sequence had ended (the loop checks only every few steps), as
    `generate` stops at the step where the last sequence ends."""
    if not eos.numel():
        return tokens
    is_end = (tokens.unsqueeze(-1) == eos.view(1, 1, -1)).any(dim=-1)
    if not bool(is_end.any(dim=1).all()):
        return tokens
    last_end = int(is_end.float().argmax(dim=1).max())
    return tokens[:, : last_end + 1]
