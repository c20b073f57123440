"""What the engine reads off a model before it builds its batch: the step's argument names, the models whose
caches the rows cannot share (refused by name), the encoder output length every row holds, the vocabulary,
the positions a decoder has and the memory its caches take."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import cast

import torch
from transformers import PreTrainedModel

from cachelife.errors import InvalidArgumentError, UnsupportedGenerationError
from cachelife.generation.method import has_sliding_layers
from cachelife.integration.buckets import check_bucketable
from cachelife.integration.call_arguments import cache_argument_name
from cachelife.serving.rows import StepNames
from cachelife.validate import check_int

# Decoder-side relative positions: the slot-aligned rows keep every distance, so no position ids are needed.
_RELATIVE_POSITIONS = frozenset({"t5", "mt5"})


def counts_positions_from_the_cache(model: PreTrainedModel) -> bool:
    """Whether the model's decoder embeds positions counted from its cache, one count for every row, and takes
    no position ids (BART's family): the engine's rows then need `cachelife.model_rewrites.row_positions`."""
    if not model.config.is_encoder_decoder or model.config.model_type in _RELATIVE_POSITIONS:
        return False
    return "decoder_position_ids" not in inspect.signature(model.forward).parameters


def step_names(model: PreTrainedModel, row_positions: torch.Tensor | None = None) -> StepNames:
    """The forward's arguments for the engine's step (`row_positions`: the buffer of the decoder's row
    position table, for a model that `counts_positions_from_the_cache`), or `UnsupportedGenerationError` for
    such a model without one (rows that joined at other steps would be misplaced)."""
    cache = cache_argument_name(model)
    parameters = set(inspect.signature(model.forward).parameters)
    if not model.config.is_encoder_decoder:
        if "position_ids" not in parameters:
            msg = f"{type(model).__name__}'s forward takes no position_ids, which the engine's rows need"
            raise UnsupportedGenerationError(msg)
        return StepNames(tokens="input_ids", mask="attention_mask", positions="position_ids", cache=cache)
    if "decoder_position_ids" in parameters:
        return StepNames(
            tokens="decoder_input_ids", mask="decoder_attention_mask", positions="decoder_position_ids", cache=cache
        )
    if model.config.model_type in _RELATIVE_POSITIONS or row_positions is not None:
        return StepNames(
            tokens="decoder_input_ids", mask="decoder_attention_mask", positions=None, cache=cache,
            row_positions=row_positions,
        )  # fmt: skip
    msg = (
        f"{type(model).__name__} computes its decoder positions from the cache's slot and takes no "
        "decoder_position_ids, and its decoder's embed_positions is not a position table the engine can read "
        "at each row's own position (or another engine already reads it), so the engine's rows (which join "
        "at different steps) would be misplaced; decode it with cachelife.generate"
    )
    raise UnsupportedGenerationError(msg)


def refuse_sliding_windows(model: PreTrainedModel, width: int) -> None:
    """`UnsupportedGenerationError` for a model with sliding-window attention layers at the cache's `width`:
    their buffers hold a window, not the batch's slots, which the rows share."""
    if has_sliding_layers(model, width):
        msg = (
            f"{type(model).__name__} has sliding-window attention layers, whose buffers hold a window rather "
            "than the slots the engine's rows share; decode it with cachelife.generate"
        )
        raise UnsupportedGenerationError(msg)


def encoder_length_of(model: PreTrainedModel, given: int | None) -> int | None:
    """The encoder output length every row's cross-attention holds: Whisper's fixed one, else `given`."""
    if not model.config.is_encoder_decoder:
        if given is not None:
            msg = f"{type(model).__name__} is decoder-only: pass no encoder_length"
            raise InvalidArgumentError(msg)
        return None
    fixed = getattr(model.config, "max_source_positions", None) if model.config.model_type == "whisper" else None
    if isinstance(fixed, int):
        if given is not None and given != fixed:
            msg = f"Whisper's encoder output has {fixed} positions; encoder_length={given} does not apply"
            raise InvalidArgumentError(msg)
        return fixed
    if given is None:
        msg = (
            f"{type(model).__name__} is an encoder-decoder model: pass encoder_length, the longest encoder "
            "output (source tokens) a request may have"
        )
        raise InvalidArgumentError(msg)
    check_int("encoder_length", given)
    check_bucketable(model)
    return given


def vocab_size(model: PreTrainedModel) -> int:
    """The logits' width: the output embedding's rows (the config's vocabulary for a model without one)."""
    embeddings = cast("Callable[[], object]", model.get_output_embeddings)()
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0])
    return int(model.config.get_text_config(decoder=True).vocab_size)


# The config fields that bound a decoder's positions (learned or rotary position tables).
_POSITION_LIMITS = ("max_position_embeddings", "max_target_positions", "n_positions")


def check_positions(model: PreTrainedModel, max_length: int) -> None:
    """`InvalidArgumentError` for an engine `max_length` past the decoder's positions, where its config bounds
    them (T5's relative positions have no bound)."""
    config = model.config.get_text_config(decoder=True)
    for name in _POSITION_LIMITS:
        limit = getattr(config, name, None)
        if isinstance(limit, int) and max_length > limit:
            msg = (
                f"max_length={max_length} is past {type(model).__name__}'s {limit} positions "
                f"({name} in its config): pass max_length <= {limit}"
            )
            raise InvalidArgumentError(msg)


def cache_bytes(
    model: PreTrainedModel, *, rows: int, width: int, encoder_length: int | None, scratch_rows: int = 1
) -> int | None:
    """The bytes of an engine's caches (its rows' and its scratch caches' rows), from the decoder's config;
    None where the config does not say its layers, key/value heads and head size."""
    config = model.config.get_text_config(decoder=True)
    layers = _first_int(config, "num_decoder_layers", "decoder_layers", "num_hidden_layers", "n_layer")
    heads = _first_int(config, "num_key_value_heads", "decoder_attention_heads", "num_heads",
                       "num_attention_heads", "n_head")  # fmt: skip
    query_heads = _first_int(config, "decoder_attention_heads", "num_heads", "num_attention_heads", "n_head")
    hidden = _first_int(config, "d_model", "hidden_size", "n_embd")
    head_size = _first_int(config, "head_dim", "d_kv")
    if head_size is None and hidden is not None and query_heads:
        head_size = hidden // query_heads
    if layers is None or heads is None or head_size is None:
        return None
    positions = width + (encoder_length or 0)  # self-attention slots, and cross-attention's encoder positions
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return (rows + scratch_rows) * positions * layers * 2 * heads * head_size * itemsize


def check_memory(
    model: PreTrainedModel, *, rows: int, width: int, encoder_length: int | None, scratch_rows: int = 1
) -> None:
    """`InvalidArgumentError` before any allocation for caches larger than the device's free memory."""
    needed = cache_bytes(model, rows=rows, width=width, encoder_length=encoder_length, scratch_rows=scratch_rows)
    free = _free_bytes(model.device)
    if needed is None or free is None or needed <= free:
        return
    msg = (
        f"the engine's caches for rows={rows} and {width} positions would take {needed / 2**30:.1f} GiB; "
        f"{model.device} has {free / 2**30:.1f} GiB free: pass fewer rows or a smaller max_length"
    )
    raise InvalidArgumentError(msg)


def _free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu" and hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return None


def _first_int(config: object, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
