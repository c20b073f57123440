"""Beam search in the engine: each request's beams are a group of neighbouring rows, each group its own search.

A request with `num_beams=k` takes rows `g * k .. g * k + k - 1` (group `g`). The groups share one `BeamState`
and one `BeamPlan` whose current lengths, prompt lengths, limits and running flags hold one entry per group
(`BeamPlan.per_group`), so `beams.beam_step`, the step `cachelife.generate` runs, runs every group at once and
each group stops on its own. The cache rows are reordered within each group at the start of every step, as in
`cachelife.generate`. A newcomer's group starts with transformers' initial beam values and takes its first
beam step from its prefill's logits alone, leaving the other groups' state and pending reorder as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from attrs import frozen
from transformers import PreTrainedModel

from cachelife.generation.beams import BeamPlan, BeamState, beam_step, per_row, reorder_cache
from cachelife.generation.processors import TensorProcessor
from cachelife.serving.rows import Rows, StepNames, per_row_buffers


@frozen(kw_only=True)
class BeamProgram:
    """The processors and beam settings of a batch of beam requests; `rows` are the per-row tensors of its
    processors' `ROW_FIELDS`, one entry per row that a group may hold."""

    key: tuple[object, ...]
    plan: BeamPlan
    rows: tuple[torch.Tensor, ...]
    fill: int  # the sequences' filler past their end (`_beam_search`'s output_fill_value)


def build_beam_program(
    converted: Sequence[TensorProcessor], key: tuple[object, ...], *, rows: int, beams: int, eos: torch.Tensor | None,
    fill: int, width: int, early_stopping: bool | str, length_penalty: float, do_sample: bool, device: torch.device,
) -> BeamProgram:  # fmt: skip
    """A beam program for `rows // beams` groups, the per-row fields as buffers of one entry per grouped row."""
    made, per_row_fields = per_row_buffers(converted, rows // beams * beams)
    plan = BeamPlan.make(
        made, eos, batch=rows // beams, beams=beams, prompt_length=0, max_length=width,
        early_stopping=early_stopping, length_penalty=length_penalty, do_sample=do_sample, device=device,
    ).per_group()  # fmt: skip
    return BeamProgram(key=key, plan=plan, rows=per_row_fields, fill=fill)


def engine_beam_steps(
    model: PreTrainedModel,
    rows: Rows,
    state: BeamState,
    *,
    noise: Sequence[torch.Tensor],
    program: BeamProgram,
    step_inputs: dict[str, Any],
    steps: int,
    names: StepNames,
    self_attention: Sequence[object],
) -> None:
    """`steps` beam steps of every group (the function that gets compiled); `noise` are the engine's (rows,
    vocab) buffers, read as (groups, beams * vocab)."""
    plan = program.plan
    used, every = plan.batch * plan.beams, rows.mask.shape[0]
    for index in range(steps):
        reorder_cache(_padded(state.beam_idx[:, None], every, identity=True).view(every), self_attention)
        inputs: dict[str, Any] = {names.tokens: _padded(state.last_tokens(), every), names.mask: rows.mask}
        if names.takes_positions:
            positions = _padded(per_row(state.positions(), plan.beams, used), every)
            names.feed(inputs, (positions - rows.padding[:, None]).clamp(min=0))
        output = model(**inputs, use_cache=True, **step_inputs)
        logits = output.logits[:used, -1].to(torch.float32)
        beam_step(state, logits, plan, noise[index][:used].view(plan.batch, -1))


def start_group(
    state: BeamState, program: BeamProgram, group: int, *, prompt: torch.Tensor, max_length: int,
    logits: torch.Tensor, noise: torch.Tensor,
) -> None:  # fmt: skip
    """Group `group` starts its search: `prompt` (beams, length) its beams' tokens, `logits` (1, vocab) its
    prefill's, `noise` (beams, vocab) its first draw. The other groups are left as they were, their pending
    cache reorder too."""
    plan = program.plan
    beams, device = plan.beams, logits.device
    plan.prompt[group] = prompt.shape[1]
    plan.limit[group] = max_length
    state.start_input(group, prompt, program.fill)
    others = state.running.clone()
    others[group] = False
    pending = state.beam_idx.clone()
    alone = torch.zeros_like(state.running)
    alone[group] = True
    state.running.copy_(alone)
    used = plan.batch * beams
    first = torch.zeros(used, logits.shape[-1], device=device)
    first[group * beams : (group + 1) * beams] = logits
    draws = torch.ones(plan.batch, beams * logits.shape[-1], device=device)
    draws[group] = noise.reshape(-1)
    beam_step(state, first, plan, draws)
    state.running.logical_or_(others)
    mine = torch.zeros(used, dtype=torch.bool, device=device)
    mine[group * beams : (group + 1) * beams] = True
    state.beam_idx.copy_(torch.where(mine, state.beam_idx, pending))


def group_output(state: BeamState, group: int, *, prompt_length: int, sequences: int) -> torch.Tensor:
    """The best `sequences` hypotheses of group `group`, cut as `_beam_search` cuts them (`beams.beam_output`
    for one input)."""
    indices = state.beam_indices[group, :sequences]
    generated = int((indices + 1).bool().sum(dim=1).max())
    return state.sequences[group, :sequences, : prompt_length + generated].clone()


def _padded(per_used_row: torch.Tensor, rows: int, *, identity: bool = False) -> torch.Tensor:
    """(used rows, 1) to (rows, 1): rows past the last group (which no group holds) feed the last row's entry,
    or with `identity` their own row number."""
    used = per_used_row.shape[0]
    if used == rows:
        return per_used_row
    if identity:
        tail = torch.arange(used, rows, device=per_used_row.device)[:, None]
    else:
        tail = per_used_row[-1:].expand(rows - used, 1)
    return torch.cat([per_used_row, tail])
