"""How the decoding steps of one `cachelife.generate` call run, whichever search they serve.

`prefill` builds pinned static caches (leased state buffers for the encoder output and mask) and runs
transformers' eager prefill; `stepper` returns what runs the next steps: replays of a CUDA graph cachelife
captured (`graphs`, CUDA with `cuda_graphs="cachelife"`), calls of the step compiled with `steps_per_call`
steps (torch's cudagraph trees with `cuda_graphs="torch"`, inductor elsewhere), or eager calls; `run_steps` is
the host's loop, which reads the device only every `stop_check_every` steps. Steps are compiled once per model
and kept in its runtime (`cachelife.integration.runtime`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

from cachelife.core.pinning import prepare_static_cache
from cachelife.generation.graphs import GraphedSteps, captures_on
from cachelife.generation.loop_settings import LoopSettings
from cachelife.generation.padding import DECODER, DECODER_ONLY, LeftPadding, is_padded, padding_counts
from cachelife.generation.repeatable import (
    cacheable_switch_calls,
    with_repeatable_attention,
    within_restricted_switches,
)
from cachelife.generation.states import StateLeases
from cachelife.generation.step_code import own_code, specialization
from cachelife.integration.call_arguments import cache_argument_name
from cachelife.integration.compiled import CompileOptions, mode_with
from cachelife.integration.enabling import options_of, pool_of
from cachelife.integration.runtime import FIRST_CALLS, runtime_of
from cachelife.kernels.linear import through_small_linear

logger = logging.getLogger(__name__)

StepFunction = Callable[..., None]


def uses_own_graphs(settings: LoopSettings, device: torch.device) -> bool:
    """Whether steps with these settings run as replays of graphs cachelife captures (a compiled step,
    `cuda_graphs="cachelife"`, on a device that captures)."""
    return settings.compile_step and settings.cuda_graphs == "cachelife" and captures_on(device)


def prefill(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    config: GenerationConfig,
    model_kwargs: dict[str, Any],
    cache_length: int,
    *,
    leases: StateLeases,
) -> tuple[dict[str, Any], torch.Tensor, LeftPadding | None]:
    """Pinned caches for `cache_length` positions, transformers' eager prefill on them, the inputs every
    step passes again (cache, encoder output and mask), the first logits (float32), and a decoder-only
    prompt's left padding (`padding`) if it has any."""
    name = cache_argument_name(model)
    rows = int(input_ids.shape[0])
    pool = pool_of(model)
    step_inputs: dict[str, Any] = {}
    padding: LeftPadding | None = None
    if model.config.is_encoder_decoder:
        # The encoder output and its mask, copied into leased static buffers: the same addresses every step
        # and every call of this shape (no copy into the graph, no new capture).
        hidden = leases.static_copy("encoder output", model_kwargs["encoder_outputs"][0])
        cache = prepare_static_cache(
            model, batch_size=rows, max_cache_len=cache_length, encoder_length=int(hidden.shape[1]), pool=pool
        )
        model_kwargs["encoder_outputs"] = step_inputs["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
        mask = model_kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            model_kwargs["attention_mask"] = step_inputs["attention_mask"] = leases.static_copy("encoder mask", mask)
        decoder_mask = model_kwargs.get("decoder_attention_mask")
        if isinstance(decoder_mask, torch.Tensor) and is_padded(decoder_mask):
            padding = left_padding(decoder_mask, cache_length, leases, DECODER)
    else:
        cache = prepare_static_cache(model, batch_size=rows, max_cache_len=cache_length, pool=pool)
        mask = model_kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and is_padded(mask):
            padding = left_padding(mask, cache_length, leases)
    for stale in ("cache", "past_key_values"):
        model_kwargs.pop(stale, None)
    model_kwargs[name] = cache
    step_inputs[name] = cache
    outputs = model._prefill(input_ids, config, model_kwargs)
    logits: torch.Tensor = outputs["logits"]
    return step_inputs, logits[:, -1].to(copy=True, dtype=torch.float32), padding


def left_padding(
    mask: torch.Tensor, width: int, leases: StateLeases, names: tuple[str, str] = DECODER_ONLY
) -> LeftPadding:
    """The prompt's mask at the cache's width (ones after the prompt) and its padding, in leased buffers."""
    full = torch.ones(mask.shape[0], width, dtype=mask.dtype, device=mask.device)
    full[:, : mask.shape[1]] = mask
    padding = leases.static_copy("padding", padding_counts(mask))
    return LeftPadding(leases.static_copy("prompt mask", full), padding, names)


def input_name(model: PreTrainedModel) -> str:
    return "decoder_input_ids" if model.config.is_encoder_decoder else "input_ids"


def compiled_step(
    model: PreTrainedModel, name: str, function: StepFunction, mode: str, extra: CompileOptions, *, kind: object
) -> StepFunction:
    """`function` compiled for `model`, with a code object of its own per mode, options and `kind` of arguments
    (`cachelife.generation.step_code`), its attention restricted to backends that repeat exactly
    (`cachelife.generation.repeatable`)."""
    functions = runtime_of(model).compiled
    key = (name, mode, repr(sorted(extra.items())), kind)
    if key not in functions:
        # Rounded at every cast as eager rounds: otherwise what inductor fuses across the model's last layers
        # and the processors keeps float32 where a forward's bf16/fp16 logits are rounded, and tokens depend on
        # the fusion (bart-small, bf16, 4 beams, CPU: 13 of 84 tokens differed from a compiled forward's).
        # The restriction's calls marked cacheable, so that a warm compile cache serves the step
        # (`cachelife.generation.repeatable`); torch.compile's annotation leaves out the table this option takes.
        options: dict[str, Any] = {
            **mode_with(mode, {**extra, "emulate_precision_casts": True}),
            "unsafe_marked_cacheable_functions": cacheable_switch_calls(),
        }
        step = own_code(with_repeatable_attention(function))
        functions[key] = within_restricted_switches(torch.compile(step, fullgraph=True, options=options))
    return functions[key]


# (index of the call within a graph, steps, settings) -> the step function's keyword arguments
Arguments = Callable[[int, int, Any], dict[str, Any]]


def stepper(
    model: PreTrainedModel,
    name: str,
    function: StepFunction,
    arguments: Arguments,
    *,
    in_place: object,
    read_only: object,
    settings: LoopSettings,
    rewind: Callable[[], None] | None = None,
    fixed_buffers: bool = False,
    live_settings: bool = False,
) -> Callable[[], int]:
    """A function that runs the next decoding steps and returns how many it ran: replays of a graph that
    cachelife captured (CUDA, `cuda_graphs="cachelife"`), or calls of the step compiled with `steps_per_call`
    steps (CUDA graphs of torch's cudagraph trees with `cuda_graphs="torch"`), or run eagerly. `rewind` and
    `live_settings` are `GraphedSteps`'; `fixed_buffers` says that the caller keeps its caches for the steps'
    whole life (an engine's), so no pool is needed to keep their addresses. A model enabled with
    `Options(small_linear=True)` runs its steps within `cachelife.kernels.linear.SmallLinearProducts`."""
    spc, device = settings.steps_per_call, model.device
    if options_of(model).small_linear:
        function, name = through_small_linear(function), f"{name} with small_linear"
    if uses_own_graphs(settings, device):
        if not fixed_buffers and pool_of(model) is None and runtime_of(model).warn_once(("no pool",)):
            logger.warning(
                "cachelife.generate: %s is not enabled (no cache pool), so its caches get new addresses on every "
                "call and every call captures a new CUDA graph; call cachelife.enable(model) once",
                type(model).__name__,
            )
        options = settings.compile_options
        kind = specialization(arguments(0, 1, read_only))
        one_step = compiled_step(model, name, function, "default", options, kind=kind)
        # The graph's name is part of its key: a graph of the step compiled with other options is another graph.
        graph_name = f"{name} with {dict(sorted(options.items()))}" if options else name
        graphed = GraphedSteps(
            model=model,
            name=graph_name,
            call=lambda index, settings: one_step(**arguments(index, 1, settings)),
            calls=spc,
            in_place=in_place,
            settings=read_only,
            device=device,
            rewind=rewind,
            live_settings=live_settings,
        )
        return graphed.advance
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    step = within_restricted_switches(function)
    if settings.compile_step:
        kind = specialization(arguments(0, spc, read_only))
        step = compiled_step(model, name, function, mode, settings.compile_options, kind=kind)
    calls = itertools.count()

    def advance() -> int:
        if next(calls) == 0:  # the first call may compile
            with FIRST_CALLS:
                step(**arguments(0, spc, read_only))
        else:
            step(**arguments(0, spc, read_only))
        return spc

    return advance


def run_steps(
    advance: Callable[[], int], is_running: Callable[[], torch.Tensor | bool], steps: int, settings: LoopSettings
) -> None:
    """Run steps (`advance` says how many it ran) until `steps` steps ran or decoding ended (`is_running`, read
    every `stop_check_every` steps)."""
    produced, checked_at = 0, 0
    while produced < steps:
        if produced - checked_at >= settings.stop_check_every:
            checked_at = produced
            if not bool(is_running()):
                return
        produced += advance()
