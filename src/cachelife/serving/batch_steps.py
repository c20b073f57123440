"""The compiled steps of an engine's batch: what each program's step reads and writes, and its stepper.

`BatchSteps` holds the batch's device state a step works on (the model, the rows, the noise buffers, the step's
inputs with the cache) and builds, for a program, the entry `programs.Programs` keeps: the program and the
function that runs its next call (`cachelife.generation.steps.stepper`: compiled, and on CUDA replayed from a
captured graph). A beam program also gets its beam state, allocated here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from attrs import frozen
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from cachelife.core.cache_lifecycle import lifecycle
from cachelife.generation.arguments import beam_fill, early_stopping, eos_ids, float_field, special_tokens
from cachelife.generation.beams import BeamState
from cachelife.generation.loop_settings import LoopSettings
from cachelife.generation.steps import stepper
from cachelife.serving.beam_groups import build_beam_program, engine_beam_steps
from cachelife.serving.programs import Entry
from cachelife.serving.requests import Joining
from cachelife.serving.rows import Program, Rows, StepNames, build_program, engine_steps


@frozen(kw_only=True)
class BatchSteps:
    """The batch's step state, and the steps of its programs (see the module docstring)."""

    model: PreTrainedModel
    rows: Rows
    noise: tuple[torch.Tensor, ...]
    step_inputs: dict[str, Any]
    names: StepNames
    settings: LoopSettings
    cache: Cache
    row_count: int

    def own(self, joining: Joining, beam_states: dict[tuple[object, ...], BeamState]) -> Entry:
        """A program of the newcomer's own, and its step; a beam program's state goes into `beam_states`."""
        config = joining.config
        if joining.beams > 1:
            return self._beam_program(joining, beam_states)
        pad = special_tokens(config, "_pad_token_tensor")
        program = build_program(
            joining.converted, joining.key, rows=self.row_count, do_sample=bool(config.do_sample),
            eos=eos_ids(config), pad=0 if pad is None else int(pad),
        )  # fmt: skip
        return program, self.stepper(program)

    def stepper(self, program: Program) -> Callable[[], int]:
        """The function that runs `program`'s next call for every row."""

        def arguments(index: int, steps: int, settings: Any) -> dict[str, Any]:
            return {
                "model": self.model, "rows": self.rows, "noise": self.noise[index : index + steps],
                "program": settings, "step_inputs": self.step_inputs, "steps": steps, "names": self.names,
            }  # fmt: skip

        return stepper(
            self.model, "engine", engine_steps, arguments,
            in_place=(self.model, self.rows, self.noise, self.step_inputs), read_only=program,
            settings=self.settings, fixed_buffers=True, live_settings=True,  # joins write the program's rows
        )  # fmt: skip

    def _beam_program(self, joining: Joining, beam_states: dict[tuple[object, ...], BeamState]) -> Entry:
        config, device = joining.config, self.model.device
        program = build_beam_program(
            joining.converted, joining.key, rows=self.row_count, beams=joining.beams, eos=eos_ids(config),
            fill=beam_fill(config), width=self.rows.tokens.shape[1], early_stopping=early_stopping(config),
            length_penalty=float_field(config, "length_penalty"), do_sample=bool(config.do_sample), device=device,
        )  # fmt: skip
        state = BeamState.allocate(program.plan, device)
        beam_states[joining.key] = state
        self_attention = [layer.layer for layer in lifecycle(self.cache).self_attention]

        def arguments(index: int, steps: int, settings: Any) -> dict[str, Any]:
            return {
                "model": self.model, "rows": self.rows, "state": state, "noise": self.noise[index : index + steps],
                "program": settings, "step_inputs": self.step_inputs, "steps": steps, "names": self.names,
                "self_attention": self_attention,
            }  # fmt: skip

        advance = stepper(
            self.model, "engine beams", engine_beam_steps, arguments,
            in_place=(self.model, self.rows, state, self.noise, self.step_inputs, self_attention), read_only=program,
            settings=self.settings, fixed_buffers=True, live_settings=True,
        )  # fmt: skip
        return program, advance
