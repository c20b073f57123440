"""The two searches `cachelife.generate` runs: greedy search and sampling, and beam search.

Each prefills (`steps.prefill`), chooses the first token eagerly, then runs its step function (`greedy_steps`,
`beam_steps`: forward, processors, token choice or beam bookkeeping, cache reorder) through `steps.stepper`
until the budget is spent or every sequence ended. Their state lives in buffers leased for the call
(`states.StateLeases`); the tensor operations are in `greedy` and `beams`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import StaticLayer
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import (
    GenerateBeamDecoderOnlyOutput,
    GenerateBeamEncoderDecoderOutput,
    GenerateDecoderOnlyOutput,
    GenerateEncoderDecoderOutput,
)
from transformers.utils import ModelOutput

from cachelife.core.cache_lifecycle import lifecycle
from cachelife.generation.arguments import beam_fill, early_stopping, eos_ids, float_field, int_field, special_tokens
from cachelife.generation.beams import BeamPlan, BeamState, beam_output, beam_step, buffer_width, reorder_cache
from cachelife.generation.draws import DrawStates
from cachelife.generation.greedy import Choice, GreedyState, choose_and_append
from cachelife.generation.host import HostChecks
from cachelife.generation.loop_settings import LoopSettings
from cachelife.generation.padding import LeftPadding
from cachelife.generation.processors import tensor_processors
from cachelife.generation.records import ScoreRecord
from cachelife.generation.states import StateLeases
from cachelife.generation.steps import input_name, prefill, run_steps, stepper
from cachelife.integration.call_arguments import cache_argument_name


class _Noise:
    """Exponential noise for the steps of one call of the step from the caller's generator, one static
    buffer `(rows, columns)` per step, leased for the call (ones, unused, for greedy and beam search).

    The k-th token of a call is drawn with the generator's k-th draw, however many steps each call of the
    step runs: draws a call did not use (the first token's call, a graph's first call, which runs one step
    before its capture) move to the front and are used first by the next call. At the end the generator is
    left as `rewind` leaves it: one draw per token step, whatever the calls drew ahead."""

    def __init__(
        self, leases: StateLeases, key: str, shape: tuple[int, int], *, steps: int, config: GenerationConfig,
        settings: LoopSettings, device: torch.device,
    ) -> None:  # fmt: skip
        def make() -> tuple[torch.Tensor, ...]:
            noise = tuple(torch.ones(shape, device=device) for _ in range(steps))
            for buffer in noise:
                torch._dynamo.mark_static_address(buffer)
            return noise

        self.buffers = leases.lease((key, *shape, steps), tuple, make)
        self.generator = settings.generator if config.do_sample else None
        if config.do_sample and self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(int(torch.randint(2**62, ())))
        self.unused = 0  # leading buffers that hold draws no step has used yet
        self.states = DrawStates()
        if self.generator is None:
            for buffer in self.buffers:
                buffer.fill_(1.0)

    def refresh(self) -> tuple[torch.Tensor, ...]:
        """Fresh draws in the buffers after the unused ones, before a call of the step."""
        if self.generator is not None:
            for buffer in self.buffers[self.unused :]:
                self.states.draw(buffer, self.generator)
        return self.buffers

    def rewind(self, steps: int) -> None:
        """Leave the generator as `steps` token steps' draws left it (see `DrawStates`)."""
        if self.generator is not None:
            self.states.rewind(self.generator, steps)

    def used(self, steps: int) -> None:
        """A call of the step ran `steps` steps: the draws it left move to the front."""
        left = len(self.buffers) - steps
        if self.generator is not None and left > 0:
            for index in range(left):
                self.buffers[index].copy_(self.buffers[steps + index])
        self.unused = max(left, 0) if self.generator is not None else 0

    def advancing(self, steps: Callable[[], int]) -> Callable[[], int]:
        """`steps` (which runs steps and says how many) with the draws refreshed before and shifted after."""

        def advance() -> int:
            self.refresh()
            ran = steps()
            self.used(ran)
            return ran

        return advance


def greedy_steps(
    model: PreTrainedModel,
    state: GreedyState,
    *,
    noise: Sequence[torch.Tensor],
    choice: Choice,
    step_inputs: dict[str, Any],
    steps: int,
    input_name: str,
    padding: LeftPadding | None = None,
    record: ScoreRecord | None = None,
) -> None:
    """`steps` greedy or sampling steps (the function that gets compiled)."""
    for index in range(steps):
        positions = {} if padding is None else padding.step_inputs(state.length)
        output = model(**{input_name: state.last_tokens()}, use_cache=True, **step_inputs, **positions)
        choose_and_append(state, output.logits[:, -1].to(torch.float32), noise[index], choice, record)


def greedy_search(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    *,
    processors: LogitsProcessorList,
    config: GenerationConfig,
    settings: LoopSettings,
    model_kwargs: dict[str, Any],
    leases: StateLeases,
    criteria: Sequence[StoppingCriteria] = (),
    streamer: BaseStreamer | None = None,
) -> torch.Tensor | ModelOutput:
    rows, prompt_length = int(input_ids.shape[0]), int(input_ids.shape[1])
    max_length = int_field(config, "max_length")
    spc = settings.steps_per_call
    width = buffer_width(max_length)
    step_inputs, first_logits, padding = prefill(model, input_ids, config, model_kwargs, width + spc, leases=leases)
    vocab, device = int(first_logits.shape[-1]), first_logits.device
    eos = eos_ids(config)
    pad_tensor = special_tokens(config, "_pad_token_tensor")
    choice = Choice(
        processors=tensor_processors(processors, vocab_size=vocab, device=device),
        do_sample=bool(config.do_sample),
        eos=eos,
        pad=0 if pad_tensor is None else int(pad_tensor),
        max_length=torch.tensor(max_length, device=device),
    )
    state = leases.lease(("greedy", rows, width), GreedyState, lambda: GreedyState.allocate(rows, width, device))
    noise = _Noise(leases, "noise", (rows, vocab), steps=spc, config=config, settings=settings, device=device)
    record = score_record(config, leases, rows=rows, width=width, vocab=vocab, device=device)
    state.start(input_ids, choice.pad)
    choose_and_append(state, first_logits, noise.refresh()[0], choice, record)
    noise.used(1)
    name = input_name(model)

    def arguments(index: int, steps: int, settings: Choice) -> dict[str, Any]:
        return {
            "model": model, "state": state, "noise": noise.buffers[index : index + steps], "choice": settings,
            "step_inputs": step_inputs, "steps": steps, "input_name": name, "padding": padding, "record": record,
        }  # fmt: skip

    steps = stepper(
        model, "greedy", greedy_steps, arguments,
        in_place=(model, state, noise.buffers, step_inputs, padding, record), read_only=choice, settings=settings,
    )  # fmt: skip

    advance = noise.advancing(steps)
    host = HostChecks(state, choice, criteria, streamer, prompt_length)
    # The prefill's token reaches a streamer (and the host's stops) before the first step, as in `_sample`.
    if streamer is None or host.check():
        run_steps(advance, host.check, max_length - prompt_length - 1, settings)
    host.finish()
    length = int(state.length)
    noise.rewind(length - prompt_length)
    tokens: torch.Tensor = state.tokens[:, :length].clone()
    if record is None:
        return tokens
    return generate_output(
        model, sequences=tokens, scores=record.steps(record.scores, prompt_length, length),
        logits=record.steps(record.logits, prompt_length, length), cache=step_inputs[cache_argument_name(model)],
        length=length,
    )  # fmt: skip


def score_record(
    config: GenerationConfig, leases: StateLeases, *, rows: int, width: int, vocab: int, device: torch.device
) -> ScoreRecord | None:
    """Leased buffers for the scores and logits `return_dict_in_generate` asks for, or None."""
    if not getattr(config, "return_dict_in_generate", False):
        return None
    scores, logits = bool(getattr(config, "output_scores", False)), bool(getattr(config, "output_logits", False))
    key = ("scores", rows, width, vocab, scores, logits)
    return leases.lease(
        key, ScoreRecord, lambda: ScoreRecord.allocate(rows, width, vocab, device, scores=scores, logits=logits)
    )


def generate_output(
    model: PreTrainedModel, *, cache: object, length: int, beams: bool = False, **fields: object
) -> ModelOutput:
    """What `_sample` (or with `beams`, `_beam_search`) returns with `return_dict_in_generate=True`: `fields`
    (the sequences, and the scores, logits and beam outputs asked for) and the cache, holding exactly the
    positions transformers' would after `length` (every token but the last)."""
    for layer in lifecycle(cache).self_attention:
        if isinstance(layer.layer, StaticLayer):
            layer.layer.cumulative_length.fill_(length - 1)
    kinds = (
        (GenerateBeamEncoderDecoderOutput, GenerateBeamDecoderOnlyOutput)
        if beams
        else (GenerateEncoderDecoderOutput, GenerateDecoderOnlyOutput)
    )
    kind = kinds[0] if model.config.is_encoder_decoder else kinds[1]
    names = set(inspect.signature(kind).parameters)
    cache_field = "cache" if "cache" in names else "past_key_values"  # transformers 5.24, 5.17
    output: ModelOutput = kind(**fields, **{cache_field: cache})
    return output


# -- beam search -------------------------------------------------------------------------------------------


def beam_steps(
    model: PreTrainedModel,
    state: BeamState,
    *,
    plan: BeamPlan,
    noise: Sequence[torch.Tensor],
    step_inputs: dict[str, Any],
    steps: int,
    input_name: str,
    self_attention: Sequence[object],
    padding: LeftPadding | None = None,
    record: ScoreRecord | None = None,
) -> None:
    """`steps` beam-search steps (the function that gets compiled)."""
    for index in range(steps):
        reorder_cache(state.beam_idx, self_attention)
        positions = {} if padding is None else padding.step_inputs(state.cur_len)
        output = model(**{input_name: state.last_tokens()}, use_cache=True, **step_inputs, **positions)
        beam_step(state, output.logits[:, -1].to(torch.float32), plan, noise[index], record)


def _self_attention_layers(cache: object) -> tuple[object, ...]:
    inner = getattr(cache, "self_attention_cache", cache)
    return tuple(getattr(inner, "layers"))  # noqa: B009 (a Cache's layers, any cache class)


def beam_search(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    *,
    processors: LogitsProcessorList,
    config: GenerationConfig,
    settings: LoopSettings,
    model_kwargs: dict[str, Any],
    leases: StateLeases,
) -> torch.Tensor | ModelOutput:
    beams = int_field(config, "num_beams")
    rows, prompt_length = int(input_ids.shape[0]), int(input_ids.shape[1])
    max_length = int_field(config, "max_length")
    spc = settings.steps_per_call
    step_inputs, first_logits, padding = prefill(
        model, input_ids, config, model_kwargs, buffer_width(max_length) + spc, leases=leases
    )
    vocab, device = int(first_logits.shape[-1]), first_logits.device
    eos = eos_ids(config)
    plan = BeamPlan.make(
        tensor_processors(processors, vocab_size=vocab, device=device), eos, batch=rows // beams, beams=beams,
        prompt_length=prompt_length, max_length=max_length, early_stopping=early_stopping(config),
        length_penalty=float_field(config, "length_penalty"), do_sample=bool(config.do_sample), device=device,
    )  # fmt: skip
    fill = beam_fill(config)
    state = leases.lease(("beams", plan.batch, beams, plan.width), BeamState, lambda: BeamState.allocate(plan, device))
    state.start(input_ids, plan, fill)
    cache = step_inputs[cache_argument_name(model)]
    layers = _self_attention_layers(cache)
    record = score_record(config, leases, rows=rows, width=plan.width, vocab=vocab, device=device)
    noise = _Noise(
        leases, "beam noise", (plan.batch, beams * vocab), steps=spc, config=config, settings=settings, device=device
    )
    beam_step(state, first_logits, plan, noise.refresh()[0], record)
    noise.used(1)
    name = input_name(model)

    def arguments(index: int, steps: int, settings: BeamPlan) -> dict[str, Any]:
        return {
            "model": model, "state": state, "plan": settings, "noise": noise.buffers[index : index + steps],
            "step_inputs": step_inputs, "steps": steps, "input_name": name, "self_attention": layers,
            "padding": padding, "record": record,
        }  # fmt: skip

    steps = stepper(
        model, "beams", beam_steps, arguments,
        in_place=(model, state, noise.buffers, step_inputs, layers, padding, record), read_only=plan,
        settings=settings,
    )  # fmt: skip

    run_steps(noise.advancing(steps), lambda: state.running, max_length - prompt_length - 1, settings)
    result = beam_output(state, plan, int_field(config, "num_return_sequences"))
    if record is None:
        return result.sequences
    # transformers reorders the cache at the end of each iteration, cachelife at the start of the next: the last
    # search step's reorder is still pending unless a step ran after the end (then `beam_idx` is the identity).
    reorder_cache(state.beam_idx, layers)
    length = int(state.cur_len)
    return generate_output(
        model, cache=cache, length=length, beams=True, sequences=result.sequences,
        sequences_scores=result.sequences_scores if record.scores is not None else None,
        scores=record.steps(record.scores, prompt_length, length),
        logits=record.steps(record.logits, prompt_length, length), beam_indices=result.beam_indices,
    )  # fmt: skip
