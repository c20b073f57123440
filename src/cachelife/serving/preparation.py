"""A request as the scheduler takes it: what its `generate` prepared (in the request's thread), checked against
the engine's batch and converted: its processors as the rows run them, its program's key, its left padding and
the stops only the host reads."""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from cachelife.errors import InvalidArgumentError
from cachelife.generation.arguments import early_stopping, eos_ids, float_field, int_field, special_tokens
from cachelife.generation.host import host_criteria
from cachelife.generation.padding import left_padding
from cachelife.serving.admission import Candidate
from cachelife.serving.batch import Batch
from cachelife.serving.requests import Joining, Request, check_request, prepared_processors
from cachelife.serving.row_settings import PerRow, per_row
from cachelife.serving.rows import PER_ROW, program_key
from cachelife.serving.window import fits_at_all


def prepared_joining(
    request: Request, model: PreTrainedModel, input_ids: torch.Tensor, *, batch: Batch,
    processors: LogitsProcessorList, criteria: StoppingCriteriaList, config: GenerationConfig,
    model_kwargs: dict[str, Any],
) -> Joining:  # fmt: skip
    """The request as the scheduler takes it, or the error that refuses it (`InvalidArgumentError` for what the
    batch cannot hold, `UnsupportedGenerationError` for what the rows do not decode)."""
    converted = prepared_processors(
        model, input_ids, processors=processors, criteria=criteria, config=config,
        model_kwargs=model_kwargs, settings=batch.settings, vocab=batch.vocab,
    )  # fmt: skip
    max_length = int_field(config, "max_length")
    check_length(batch, prompt=int(input_ids.shape[1]), max_length=max_length)
    beams = int_field(config, "num_beams")
    check_rows(batch, beams, int_field(config, "num_return_sequences"))
    generator = request.generator
    if config.do_sample and generator is None:
        generator = torch.Generator(device=model.device).manual_seed(int(torch.randint(2**62, ())))
    eos = eos_ids(config)
    pad_tensor = special_tokens(config, "_pad_token_tensor")
    pad = 0 if pad_tensor is None else int(pad_tensor)
    values = per_row(processors, do_sample=bool(config.do_sample), eos=eos, pad=pad) if beams == 1 else None
    per_row_values = values if isinstance(values, PerRow) else None
    key: tuple[object, ...] = (PER_ROW, per_row_values.do_sample) if per_row_values is not None else (
        program_key(converted, do_sample=bool(config.do_sample), eos=eos, pad=pad))  # fmt: skip
    if beams > 1:  # requests of other beam settings run another program
        key = (*key, beams, float_field(config, "length_penalty"), early_stopping(config))
    # transformers' generate put the prompt into the streamer; the new tokens come from the rows.
    streamer = request.kwargs.get("streamer")
    return Joining(
        request=request,
        input_ids=input_ids,
        model_kwargs=model_kwargs,
        config=config,
        converted=converted,
        key=key,
        max_length=max_length,
        generator=generator,
        streamer=streamer,
        beams=beams,
        sequences=int_field(config, "num_return_sequences"),
        pad=pad,
        padding=left_padding(model, model_kwargs),
        per_row=per_row_values,
        criteria=host_criteria(criteria),
    )


def check_submitted(model: PreTrainedModel, kwargs: dict[str, Any], batch: Batch, *, streamed: bool = False) -> None:
    """What is wrong with a request at `submit`, before any work (`requests.check_request`), and whether the
    batch can ever hold it: its rows (beams or sampled sequences), and a decoder-only prompt's length and new
    tokens (an encoder-decoder model's decoder prompt is known once `generate` prepared it, where
    `prepared_joining` checks it)."""
    config = check_request(model, kwargs, streamed=streamed)
    check_rows(batch, int_field(config, "num_beams"), int_field(config, "num_return_sequences"))
    prompt = kwargs.get("input_ids")
    if not model.config.is_encoder_decoder and isinstance(prompt, torch.Tensor):
        new, length = config.max_new_tokens, int(prompt.shape[1])
        max_length = length + new if isinstance(new, int) else int_field(config, "max_length")
        check_length(batch, prompt=length, max_length=max_length)


def check_rows(batch: Batch, beams: int, sequences: int) -> None:
    """`InvalidArgumentError` for a request of more rows than the batch has: a row per beam, or without beams
    a row per sampled sequence."""
    name, rows = ("num_beams", beams) if beams > 1 else ("num_return_sequences", sequences)
    if rows > len(batch.slots):
        msg = (
            f"the request asks for {name}={rows}, which takes {rows} of the engine's rows; the engine "
            f"has {len(batch.slots)}: ask for fewer, or make the engine's rows more"
        )
        raise InvalidArgumentError(msg)


def check_length(batch: Batch, *, prompt: int, max_length: int) -> None:
    """`InvalidArgumentError` for a request whose prompt and new tokens pass the engine's `max_length`."""
    if not fits_at_all(width=batch.width, reserve=batch.reserve, prompt=prompt, remaining=max_length - prompt - 1):
        msg = (
            f"the request's max_length is {max_length} (prompt {prompt} + new tokens); the engine's "
            f"max_length is {batch.max_length}: ask for fewer new tokens, or make the engine's longer"
        )
        raise InvalidArgumentError(msg)


def candidate(joining: Joining) -> Candidate:
    """A waiting request as admission sees it."""
    return Candidate(
        number=joining.request.number, rows=joining.rows, key=joining.key, prompt=joining.prompt,
        remaining=joining.max_length - joining.prompt - 1,
    )  # fmt: skip
