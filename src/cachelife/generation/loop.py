"""The decoding loop behind `cachelife.generate`, in the gpt-fast style.

transformers' `generate` prepares everything (generation config, special tokens, encoder outputs, the
decoder prompt, beam expansion, lengths, the processor list) and calls this module's decoding method in
place of `_sample` / `_beam_search`. It builds pinned static caches and static state buffers before anything
compiled runs, prefills eagerly (transformers' `_prefill`), picks the first token eagerly, then runs the
decoding steps in one compiled function (forward, processors, token choice or beam bookkeeping, cache
reorder): on CUDA `steps_per_call` calls of it per replay of a CUDA graph cachelife captured (`graphs`), else
(or with `cuda_graphs="torch"`) `steps_per_call` steps per call of it. The host reads the device only every
`stop_check_every` steps, to see whether decoding has ended, and once at the end.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from attrs import field, frozen
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.modeling_outputs import BaseModelOutput

from cachelife.core.pinning import prepare_static_cache
from cachelife.errors import UnsupportedGenerationError
from cachelife.generation.arguments import early_stopping, eos_ids, float_field, int_field, special_tokens
from cachelife.generation.beams import BeamPlan, BeamState, beam_output, beam_step, buffer_width, reorder_cache
from cachelife.generation.graphs import GraphedSteps, captures_on
from cachelife.generation.greedy import Choice, GreedyState, choose_and_append
from cachelife.generation.processors import tensor_processors, unsupported_processor
from cachelife.generation.states import StateLeases
from cachelife.integration.call_arguments import cache_argument_name
from cachelife.integration.compile_cache import pinned_compile_cache
from cachelife.integration.compiled import InductorOptions, call_step, mode_with
from cachelife.integration.enabling import pool_of
from cachelife.integration.runtime import FIRST_CALLS, collecting_after_compilation, runtime_of

logger = logging.getLogger(__name__)

StepFunction = Callable[..., None]
CudaGraphs = Literal["cachelife", "torch"]


@frozen
class LoopSettings:
    """cachelife's own settings of one `generate` call."""

    steps_per_call: int
    stop_check_every: int
    compile_step: bool
    fallback: bool
    generator: torch.Generator | None
    cuda_graphs: CudaGraphs = "cachelife"
    compile_options: InductorOptions = field(
        factory=dict
    )  # as cachelife.integration.compiled.checked_options returns them


def fall_back(feature: str, fallback: bool) -> None:
    """Log the one WARNING of a fallback, or raise `UnsupportedGenerationError` with `fallback=False`."""
    if not fallback:
        msg = f"cachelife.generate does not implement {feature}; call model.generate, or pass fallback=True"
        raise UnsupportedGenerationError(msg)
    logger.warning("cachelife.generate falls back to model.generate: it does not implement %s", feature)


def unsupported_criterion(criteria: StoppingCriteriaList) -> str | None:
    for criterion in criteria:
        if type(criterion) not in (MaxLengthCriteria, EosTokenCriteria):
            return type(criterion).__name__
    return None


def unsupported_prompt(model: PreTrainedModel, model_kwargs: dict[str, Any]) -> str | None:
    """A prompt the loop does not decode, read from what reaches the decoding method: the attention mask
    `generate` was given or inferred from the pad token, so that both are treated alike."""
    mask = model_kwargs.get("attention_mask")
    if not model.config.is_encoder_decoder and isinstance(mask, torch.Tensor) and bool((mask == 0).any()):
        return "padded prompts for a decoder-only model (an attention_mask with zeros, passed or inferred)"
    return None


def decoding_method(settings: LoopSettings, on_call: Callable[[], None]) -> Callable[..., torch.Tensor]:
    """A decoding method for `generate(custom_generate=...)`: the compiled loop, or transformers' own
    (after the fallback warning) for processors or stopping criteria it cannot run. `on_call` runs first, so
    that the caller can tell whether `generate` called it at all."""

    def decode(
        model: PreTrainedModel,
        input_ids: torch.Tensor,
        *,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        **model_kwargs: Any,
    ) -> torch.Tensor:
        on_call()
        feature = (
            unsupported_processor(logits_processor)
            or unsupported_criterion(stopping_criteria)
            or unsupported_prompt(model, model_kwargs)
        )
        if feature is not None:
            fall_back(feature, settings.fallback)
            mode = generation_config.get_generation_mode()
            method = model._beam_search if mode == GenerationMode.BEAM_SEARCH else model._sample
            result = method(
                input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                generation_config=generation_config, synced_gpus=synced_gpus, **model_kwargs,
            )  # fmt: skip
            if not isinstance(result, torch.Tensor):
                msg = f"transformers' decoding method returned a {type(result).__name__}, expected tokens"
                raise UnsupportedGenerationError(msg)
            return result
        runtime = runtime_of(model)
        # A decoding method that compiled collects its traces' cycles before the next one runs (Whisper's
        # generate calls it once per segment and per fallback), so that the next cache gets this one's buffers.
        with runtime.lock, collecting_after_compilation(), StateLeases(runtime) as leases, pinned_compile_cache():
            search = _beam_search if int_field(generation_config, "num_beams") > 1 else _greedy
            return search(
                model, input_ids, processors=logits_processor, config=generation_config, settings=settings,
                model_kwargs=model_kwargs, leases=leases,
            )  # fmt: skip

    return decode


# -- shared pieces -----------------------------------------------------------------------------------------


def _prefill(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    config: GenerationConfig,
    model_kwargs: dict[str, Any],
    cache_length: int,
    *,
    leases: StateLeases,
) -> tuple[dict[str, Any], torch.Tensor]:
    """Pinned caches for `cache_length` positions, transformers' eager prefill on them, the inputs every
    step passes again (cache, encoder output and mask), and the first logits (float32)."""
    name = cache_argument_name(model)
    rows = int(input_ids.shape[0])
    pool = pool_of(model)
    step_inputs: dict[str, Any] = {}
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
    else:
        cache = prepare_static_cache(model, batch_size=rows, max_cache_len=cache_length, pool=pool)
    for stale in ("cache", "past_key_values"):
        model_kwargs.pop(stale, None)
    model_kwargs[name] = cache
    step_inputs[name] = cache
    outputs = model._prefill(input_ids, config, model_kwargs)
    logits: torch.Tensor = outputs["logits"]
    return step_inputs, logits[:, -1].to(copy=True, dtype=torch.float32)


def _input_name(model: PreTrainedModel) -> str:
    return "decoder_input_ids" if model.config.is_encoder_decoder else "input_ids"


def _compiled(
    model: PreTrainedModel, name: str, function: StepFunction, mode: str, extra: InductorOptions
) -> StepFunction:
    functions = runtime_of(model).compiled
    key = (name, mode, repr(sorted(extra.items())))
    if key not in functions:
        # Rounded at every cast as eager rounds: otherwise what inductor fuses across the model's last layers
        # and the processors keeps float32 where a forward's bf16/fp16 logits are rounded, and tokens depend on
        # the fusion (bart-small, bf16, 4 beams, CPU: 13 of 84 tokens differed from a compiled forward's).
        options = mode_with(mode, {**extra, "emulate_precision_casts": True})
        functions[key] = torch.compile(function, fullgraph=True, options=options)
    return functions[key]


# (index of the call within a graph, steps, settings) -> the step function's keyword arguments
Arguments = Callable[[int, int, Any], dict[str, Any]]


def _stepper(
    model: PreTrainedModel,
    name: str,
    function: StepFunction,
    arguments: Arguments,
    *,
    in_place: object,
    read_only: object,
    settings: LoopSettings,
) -> Callable[[], int]:
    """A function that runs the next decoding steps and returns how many it ran: replays of a graph that
    cachelife captured (CUDA, `cuda_graphs="cachelife"`), or calls of the step compiled with `steps_per_call`
    steps (CUDA graphs of torch's cudagraph trees with `cuda_graphs="torch"`), or run eagerly."""
    spc, device = settings.steps_per_call, model.device
    if settings.compile_step and settings.cuda_graphs == "cachelife" and captures_on(device):
        if pool_of(model) is None and runtime_of(model).warn_once(("no pool",)):
            logger.warning(
                "cachelife.generate: %s is not enabled (no cache pool), so its caches get new addresses on every "
                "call and every call captures a new CUDA graph; call cachelife.enable(model) once",
                type(model).__name__,
            )
        options = settings.compile_options
        one_step = _compiled(model, name, function, "default", options)
        # The graph's name is part of its key: a graph of the step compiled with other options is another graph.
        graph_name = f"{name} with {dict(sorted(options.items()))}" if options else name
        graphed = GraphedSteps(
            model, graph_name, lambda index, settings: one_step(**arguments(index, 1, settings)), spc, in_place,
            read_only, device,
        )  # fmt: skip
        return graphed.advance
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    step = _compiled(model, name, function, mode, settings.compile_options) if settings.compile_step else function
    calls = itertools.count()

    def advance() -> int:
        if next(calls) == 0:  # every call passes the first call's objects; the first may compile
            with FIRST_CALLS:
                call_step(step, True, **arguments(0, spc, read_only))
        else:
            call_step(step, False, **arguments(0, spc, read_only))
        return spc

    return advance


def _run(
    advance: Callable[[], int], is_running: Callable[[], torch.Tensor], steps: int, settings: LoopSettings
) -> None:
    """Run steps (`advance` says how many it ran) until `steps` steps ran or decoding ended."""
    produced, checked_at = 0, 0
    while produced < steps:
        if produced - checked_at >= settings.stop_check_every:
            checked_at = produced
            if not bool(is_running()):
                return
        produced += advance()


# -- greedy search and sampling ----------------------------------------------------------------------------


class _Noise:
    """Exponential noise for the steps of one call of the step from the caller's generator, one static
    buffer per step (ones, unused, for greedy search)."""

    def __init__(self, buffers: tuple[torch.Tensor, ...], generator: torch.Generator | None) -> None:
        self.buffers = buffers
        self.generator = generator
        if generator is None:
            for buffer in buffers:
                buffer.fill_(1.0)

    def refresh(self) -> tuple[torch.Tensor, ...]:
        if self.generator is not None:
            for buffer in self.buffers:
                buffer.exponential_(generator=self.generator)
        return self.buffers


def greedy_steps(
    model: PreTrainedModel,
    state: GreedyState,
    *,
    noise: Sequence[torch.Tensor],
    choice: Choice,
    step_inputs: dict[str, Any],
    steps: int,
    input_name: str,
) -> None:
    """`steps` greedy or sampling steps (the function that gets compiled)."""
    for index in range(steps):
        output = model(**{input_name: state.last_tokens()}, use_cache=True, **step_inputs)
        choose_and_append(state, output.logits[:, -1].to(torch.float32), noise[index], choice)


def _greedy(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    *,
    processors: LogitsProcessorList,
    config: GenerationConfig,
    settings: LoopSettings,
    model_kwargs: dict[str, Any],
    leases: StateLeases,
) -> torch.Tensor:
    rows, prompt_length = int(input_ids.shape[0]), int(input_ids.shape[1])
    max_length = int_field(config, "max_length")
    spc = settings.steps_per_call
    width = buffer_width(max_length)
    step_inputs, first_logits = _prefill(model, input_ids, config, model_kwargs, width + spc, leases=leases)
    vocab, device = int(first_logits.shape[-1]), first_logits.device
    eos = eos_ids(config)
    pad_tensor = special_tokens(config, "_pad_token_tensor")
    choice = Choice(
        tensor_processors(processors, vocab_size=vocab, device=device), bool(config.do_sample), eos,
        0 if pad_tensor is None else int(pad_tensor), torch.tensor(max_length, device=device),
    )  # fmt: skip
    generator = settings.generator if config.do_sample else None
    if config.do_sample and generator is None:
        generator = torch.Generator(device=device).manual_seed(int(torch.randint(2**62, ())))

    def make_noise() -> tuple[torch.Tensor, ...]:
        noise = tuple(torch.ones(rows, vocab, device=device) for _ in range(spc))
        for buffer in noise:
            torch._dynamo.mark_static_address(buffer)
        return noise

    state = leases.lease(("greedy", rows, width), GreedyState, lambda: GreedyState.allocate(rows, width, device))
    noise = _Noise(leases.lease(("noise", rows, vocab, spc), tuple, make_noise), generator)
    state.start(input_ids, choice.pad)
    choose_and_append(state, first_logits, noise.refresh()[0], choice)
    name = _input_name(model)

    def arguments(index: int, steps: int, settings: Choice) -> dict[str, Any]:
        return {
            "model": model, "state": state, "noise": noise.buffers[index : index + steps], "choice": settings,
            "step_inputs": step_inputs, "steps": steps, "input_name": name,
        }  # fmt: skip

    steps = _stepper(
        model, "greedy", greedy_steps, arguments, in_place=(model, state, noise.buffers, step_inputs),
        read_only=choice, settings=settings,
    )  # fmt: skip

    def advance() -> int:
        noise.refresh()
        return steps()

    _run(advance, lambda: state.running(choice), max_length - prompt_length - 1, settings)
    tokens: torch.Tensor = state.tokens[:, : int(state.length)].clone()
    return tokens


# -- beam search -------------------------------------------------------------------------------------------


def beam_steps(
    model: PreTrainedModel,
    state: BeamState,
    *,
    plan: BeamPlan,
    step_inputs: dict[str, Any],
    steps: int,
    input_name: str,
    self_attention: Sequence[object],
) -> None:
    """`steps` beam-search steps (the function that gets compiled)."""
    for _ in range(steps):
        reorder_cache(state, self_attention)
        output = model(**{input_name: state.last_tokens()}, use_cache=True, **step_inputs)
        beam_step(state, output.logits[:, -1].to(torch.float32), plan)


def _self_attention_layers(cache: object) -> tuple[object, ...]:
    inner = getattr(cache, "self_attention_cache", cache)
    return tuple(getattr(inner, "layers"))  # noqa: B009 (a Cache's layers, any cache class)


def _beam_search(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    *,
    processors: LogitsProcessorList,
    config: GenerationConfig,
    settings: LoopSettings,
    model_kwargs: dict[str, Any],
    leases: StateLeases,
) -> torch.Tensor:
    beams = int_field(config, "num_beams")
    rows, prompt_length = int(input_ids.shape[0]), int(input_ids.shape[1])
    max_length = int_field(config, "max_length")
    spc = settings.steps_per_call
    step_inputs, first_logits = _prefill(
        model, input_ids, config, model_kwargs, buffer_width(max_length) + spc, leases=leases
    )
    vocab, device = int(first_logits.shape[-1]), first_logits.device
    eos = eos_ids(config)
    plan = BeamPlan.make(
        tensor_processors(processors, vocab_size=vocab, device=device), eos, batch=rows // beams, beams=beams,
        prompt_length=prompt_length, max_length=max_length, early_stopping=early_stopping(config),
        length_penalty=float_field(config, "length_penalty"), device=device,
    )  # fmt: skip
    pad, ends = special_tokens(config, "_pad_token_tensor"), special_tokens(config, "_eos_token_tensor")
    fill = int(pad or ends[0] if ends is not None else -1)  # `_beam_search`'s output_fill_value, as written
    state = leases.lease(("beams", plan.batch, beams, plan.width), BeamState, lambda: BeamState.allocate(plan, device))
    state.start(input_ids, plan, fill)
    layers = _self_attention_layers(step_inputs[cache_argument_name(model)])
    beam_step(state, first_logits, plan)
    name = _input_name(model)

    def arguments(index: int, steps: int, settings: BeamPlan) -> dict[str, Any]:
        return {
            "model": model, "state": state, "plan": settings, "step_inputs": step_inputs, "steps": steps,
            "input_name": name, "self_attention": layers,
        }  # fmt: skip

    advance = _stepper(
        model, "beams", beam_steps, arguments, in_place=(model, state, step_inputs, layers), read_only=plan,
        settings=settings,
    )  # fmt: skip
    _run(advance, lambda: state.running, max_length - prompt_length - 1, settings)
    return beam_output(state, plan, int_field(config, "num_return_sequences"))
