"""The engine's prefill: a newcomer's decoder prompt through the model, on the pinned one-row scratch cache.

transformers' `_prefill` prepares the forward's inputs (`prepare_inputs_for_generation`) and runs the forward
eagerly: for a deep decoder that costs the host far more than the GPU, and the engine's scheduler prefills
every request in turn. With cachelife's CUDA graphs, an encoder-decoder model's prefill here prepares the
inputs as transformers does, copies them into static twins, and replays a graph of the compiled forward,
captured once per shape of those inputs (every Whisper request of one decoder prompt length, every T5 request,
shares one). Decoder-only newcomers that the joint prefill takes go through `Prefill.joint`
(`cachelife.serving.joint_prefill`): their prompts padded to a bucket, the preparation of the inputs and the
forward compiled together, captured once per group size and bucket under cachelife's graphs. The other
settings (eager steps, encoder-decoder models without cachelife's graphs) run transformers' own prefill.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

import attrs
import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

from cachelife.core.cache_lifecycle import lifecycle
from cachelife.generation.loop_settings import LoopSettings
from cachelife.generation.step_code import specialization
from cachelife.generation.steps import compiled_step, stepper, uses_own_graphs
from cachelife.integration.runtime import FIRST_CALLS

logger = logging.getLogger(__name__)

MAX_SHAPES: Final = 32
"""Prefill input shapes with a graph of their own (an encoder-decoder model's decoder prompts; a decoder-only
model's group sizes and prompt buckets); a prefill of another shape runs compiled (decoder-only) or eagerly."""


def prefill_forward(model: PreTrainedModel, *, inputs: dict[str, Any], logits: torch.Tensor) -> None:
    """The forward on prepared inputs, its last position's logits written into `logits` (the function that
    gets compiled and captured)."""
    output = model(**inputs, return_dict=True)
    logits.copy_(output.logits[:, -1])


def prepared_prefill_forward(model: PreTrainedModel, *, inputs: dict[str, Any], logits: torch.Tensor) -> None:
    """transformers' preparation of a decoder-only prefill's inputs (`input_ids` and `generate`'s keyword
    arguments in `inputs`), then `prefill_forward` on them. Compiled or captured, the preparation builds the
    attention mask on the device: run eagerly, it reads the mask on the host to drop it where nothing is
    padded (a synchronisation, and inputs of another shape for a prompt that fills its bucket)."""
    arguments = dict(inputs)
    input_ids = arguments.pop("input_ids")
    prepared = model.prepare_inputs_for_generation(
        input_ids, next_sequence_length=None, is_first_iteration=True, **arguments
    )
    prefill_forward(model, inputs=prepared, logits=logits)


PrefillFunction = Callable[..., None]

# Each function's name for `compiled_step`, which keeps one compiled function per name and kind of arguments.
_NAMES: Final[dict[PrefillFunction, str]] = {
    prefill_forward: "engine prefill",
    prepared_prefill_forward: "engine prefill with its preparation",
}


class Prefill:
    """Prefills for one engine's scratch cache (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, scratch: object, settings: LoopSettings, vocab: int) -> None:
        # One forward per graph, whatever the engine's steps per call.
        self.model, self.scratch, self.settings = model, scratch, attrs.evolve(settings, steps_per_call=1)
        own_graphs = uses_own_graphs(settings, model.device)
        self.captures = bool(model.config.is_encoder_decoder) and own_graphs
        self.compiles = not model.config.is_encoder_decoder and settings.compile_step
        self.captures_joint = self.compiles and own_graphs  # decoder-only prefills of prompt buckets (`joint`)
        self.ran: set[Callable[..., None]] = set()  # compiled forwards that have run (compiled) once
        self.logits = torch.zeros(1, vocab, dtype=torch.float32, device=model.device)
        torch._dynamo.mark_static_address(self.logits)
        self.joint_logits: dict[int, torch.Tensor] = {}  # rows -> the joint prefills' logits (`joint`)
        # shape key -> (static inputs, the function that runs the forward on them)
        self.shapes: dict[tuple[object, ...], tuple[dict[str, Any], Callable[[], int]]] = {}

    def __call__(self, input_ids: torch.Tensor, config: GenerationConfig, kwargs: dict[str, Any]) -> torch.Tensor:
        """The prompt's last logits (1, vocab; float32) after emptying and filling the scratch cache; the tensor
        is reused by the next prefill."""
        # Emptied first: transformers prepares the forward's inputs (its mask) from the cache's length, and the
        # forward computes the encoder keys and values only for layers not announced written.
        lifecycle(self.scratch).reset()
        if self.captures and getattr(config, "prefill_chunk_size", None) is None:
            # The scratch cache is empty, so transformers' `_prefill` would slice nothing off the prompt.
            inputs = self.model.prepare_inputs_for_generation(
                input_ids, next_sequence_length=None, is_first_iteration=True, **kwargs
            )
            key = self._shape_key(inputs, self.scratch)
            if key is not None:
                found = self.shapes.get(key)
                if found is None and len(self.shapes) < MAX_SHAPES:
                    found = self.shapes[key] = self._graphed(inputs, self.scratch, self.logits, prefill_forward)
                if found is not None:
                    twins, advance = found
                    _copy_into(twins, inputs)
                    advance()
                    return self.logits
                logger.debug(
                    "cachelife.Engine: %d prompt shapes have graphs; this one is prefilled eagerly", MAX_SHAPES
                )
        if self.compiles and getattr(config, "prefill_chunk_size", None) is None:
            inputs = self.model.prepare_inputs_for_generation(
                input_ids, next_sequence_length=None, is_first_iteration=True, **kwargs
            )
            if self._compiled_forward(inputs):
                return self.logits
            lifecycle(self.scratch).reset()
        outputs = self.model._prefill(input_ids, config, kwargs)
        logits: torch.Tensor = outputs["logits"]
        self.logits.copy_(logits[:, -1])
        return self.logits

    def joint(self, input_ids: torch.Tensor, kwargs: dict[str, Any], scratch: object) -> torch.Tensor:
        """The last logits (one row per prompt; float32) of several left-padded prompts prefilled together on
        `scratch`, an empty scratch cache of as many rows that `kwargs` names (`joint_prefill`). The tensor is
        reused by the next joint prefill of as many rows."""
        rows = int(input_ids.shape[0])
        logits = self.joint_logits.get(rows)
        if logits is None:
            logits = self.joint_logits[rows] = torch.zeros(rows, self.logits.shape[1], dtype=torch.float32,
                                                           device=self.model.device)  # fmt: skip
        raw = {"input_ids": input_ids, **kwargs}
        if self.captures_joint and self._replayed(raw, scratch, logits):
            return logits
        if self.compiles and self._compiled_forward(raw, logits, prepared_prefill_forward):
            return logits
        lifecycle(scratch).reset()  # a failed compilation may have written part of it
        prepared_prefill_forward(self.model, inputs=raw, logits=logits)
        return logits

    def _replayed(self, inputs: dict[str, Any], scratch: object, logits: torch.Tensor) -> bool:
        """Run `prepared_prefill_forward` on `inputs` from the graph of their shape (captured now if new and
        `MAX_SHAPES` graphs are not yet taken); False if there is none. A capture that fails is logged once, and
        later prefills run compiled without graphs."""
        key = self._shape_key(inputs, scratch)
        if key is None:
            return False
        found = self.shapes.get(key)
        capturing = found is None
        if found is None:
            if len(self.shapes) >= MAX_SHAPES:
                return False
            found = self.shapes[key] = self._graphed(inputs, scratch, logits, prepared_prefill_forward)
        twins, advance = found
        _copy_into(twins, inputs)
        try:
            advance()  # a new graph's first call runs the warm-up and captures
        except Exception:
            if not capturing:
                raise
            logger.warning(
                "cachelife.Engine: a prefill graph of %s failed to capture; newcomers are prefilled without "
                "graphs from now on", type(self.model).__name__, exc_info=True,
            )  # fmt: skip
            del self.shapes[key]
            self.captures_joint = False
            lifecycle(scratch).reset()
            return False
        return True

    def _compiled_forward(
        self, inputs: dict[str, Any], logits: torch.Tensor | None = None, function: PrefillFunction = prefill_forward
    ) -> bool:
        """Run `function` compiled on `inputs` into `logits` (the one-row prefill's unless given); False (once,
        with a warning; later prefills are eager) if its first call, which compiles it, fails."""
        logits = self.logits if logits is None else logits
        kind = specialization(inputs)
        forward = compiled_step(
            self.model, _NAMES[function], function, "default", self.settings.compile_options, kind=kind
        )
        if forward in self.ran:
            forward(model=self.model, inputs=inputs, logits=logits)
            return True
        try:
            with FIRST_CALLS:  # the first call compiles
                forward(model=self.model, inputs=inputs, logits=logits)
        except Exception:
            logger.warning(
                "cachelife.Engine: the compiled prefill of %s failed to compile; its newcomers are prefilled "
                "eagerly from now on", type(self.model).__name__, exc_info=True,
            )  # fmt: skip
            self.compiles = False
            return False
        self.ran.add(forward)
        return True

    def _shape_key(self, inputs: dict[str, Any], scratch: object) -> tuple[object, ...] | None:
        """What a graph of the forward on `inputs` and `scratch` depends on, or None for inputs without static
        twins."""
        key: list[object] = []
        for name, value in sorted(inputs.items()):
            if isinstance(value, torch.Tensor):
                key.append((name, value.shape, value.dtype))
            elif isinstance(value, BaseModelOutput) and (hidden := _only_hidden(value)) is not None:
                key.append((name, "encoder output", hidden.shape, hidden.dtype))
            elif value is scratch:
                key.append((name, "scratch cache", id(scratch)))
            elif value is None or isinstance(value, bool | int | str):
                key.append((name, value))
            else:
                return None
        return tuple(key)

    def _graphed(
        self, inputs: dict[str, Any], scratch: object, logits: torch.Tensor, function: PrefillFunction
    ) -> tuple[dict[str, Any], Callable[[], int]]:
        """Static twins of `inputs`, and the function that runs `function` on them into `logits` (captured at
        its first call, replayed after)."""
        twins = {name: _twin(value) for name, value in inputs.items()}

        def arguments(index: int, steps: int, settings: object) -> dict[str, Any]:
            return {"model": self.model, "inputs": twins, "logits": logits}

        advance = stepper(
            self.model, _NAMES[function], function, arguments,
            in_place=(self.model, scratch, twins, logits), read_only=(), settings=self.settings,
            rewind=lambda: lifecycle(scratch).reset(), fixed_buffers=True,
        )  # fmt: skip
        return twins, advance


def _only_hidden(output: BaseModelOutput) -> torch.Tensor | None:
    """The encoder output's hidden state, if it holds nothing else."""
    hidden = output.last_hidden_state
    return hidden if list(output.keys()) == ["last_hidden_state"] and isinstance(hidden, torch.Tensor) else None


def _twin(value: Any) -> Any:
    """A static tensor of `value`'s shape and dtype (an encoder output's hidden state too); anything else kept."""
    if isinstance(value, torch.Tensor):
        twin = torch.zeros_like(value)
        torch._dynamo.mark_static_address(twin)
        return twin
    if isinstance(value, BaseModelOutput):
        return BaseModelOutput(last_hidden_state=_twin(_only_hidden(value)))
    return value


def _copy_into(twins: dict[str, Any], inputs: dict[str, Any]) -> None:
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            twins[name].copy_(value)
        elif isinstance(value, BaseModelOutput):
            twins[name].last_hidden_state.copy_(_only_hidden(value))
