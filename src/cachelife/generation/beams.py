"""Beam search as one in-place update of static buffers: transformers 5.x `_beam_search`, step for step.

Ported from the logic of `GenerationMixin._get_top_k_continuations`, `_get_running_beams_for_next_iteration`,
`_update_finished_beams`, `_check_early_stop_heuristic` and `_beam_search_has_unfinished_sequences`, with the
current length `cur_len` a tensor: writes at `cur_len` are `where` over the buffer's columns, and the
length penalties `(length) ** length_penalty` come from a table computed on the host in Python floats (as
transformers computes them) and applied as a multiplication by their float32 reciprocal, the arithmetic
PyTorch uses to divide a tensor by a Python float. After the search ends, the update changes nothing.

`cur_len`, `running` and the plan's `prompt` and `limit` are 0-dim for one search over a batch of inputs
(`cachelife.generate`: the search runs while any input may improve, as transformers'), or one entry per input
(`per_group`: the engine's groups of rows, each its own request, with its own lengths and its own end).

The self-attention cache is reordered in place (`keys.copy_(keys.index_select(0, beam_idx))`: same tensors,
same addresses), at the start of the next step (`reorder_cache`). The cross-attention cache is not touched:
every beam of one input holds the same encoder keys and values, and a reorder only moves rows within one
input's beams.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import attrs
import torch
from attrs import field, frozen
from transformers.generation.utils import GenerationMixin

from cachelife.generation.processors import TensorProcessor
from cachelife.generation.records import ScoreRecord

_NEG = -1.0e9


@frozen(kw_only=True)
class BeamPlan:
    """The settings of one beam search, the same for every step."""

    processors: tuple[TensorProcessor, ...]
    eos: torch.Tensor | None
    batch: int
    beams: int
    keep: int  # candidates kept per step: max(2, 1 + number of end tokens) * beams
    # Host only (the step reads `prompt` and `limit`), so not part of a captured graph's key (`graphs`).
    prompt_length: int = field(metadata={"host_only": True})
    max_length: int = field(metadata={"host_only": True})
    width: int  # columns of the state buffers: max_length rounded up (`buffer_width`)
    prompt: torch.Tensor  # long, 0-dim or (batch,): the prompt's length
    limit: torch.Tensor  # long, 0-dim or (batch,): max_length
    early_stopping: bool | str
    # Beam sampling: candidates drawn without replacement (an exponential race over the accumulated
    # probabilities) instead of the top ones; `sort_samples` as the installed transformers orders them.
    do_sample: bool
    sort_samples: bool
    top_beam_mask: torch.Tensor  # (keep,) bool: the first `beams` candidates
    length_scale: torch.Tensor  # (width + 2,) float32: 1 / n ** length_penalty for n tokens after the prompt
    # The early-stop heuristic's best hypothetical length is max_length's (early_stopping="never" with a
    # positive length penalty), else the next step's.
    heuristic_at_limit: bool

    @classmethod
    def make(
        cls,
        processors: tuple[TensorProcessor, ...],
        eos: torch.Tensor | None,
        *,
        batch: int,
        beams: int,
        prompt_length: int,
        max_length: int,
        early_stopping: bool | str,
        length_penalty: float,
        do_sample: bool = False,
        device: torch.device,
    ) -> BeamPlan:
        keep = max(2, 1 + (0 if eos is None else int(eos.numel()))) * beams
        mask = torch.cat([torch.ones(beams, dtype=torch.bool), torch.zeros(keep - beams, dtype=torch.bool)])
        width = buffer_width(max_length)
        scale = [_power(generated, length_penalty) for generated in range(width + 2)]
        return cls(
            processors=processors, eos=eos, batch=batch, beams=beams, keep=keep, prompt_length=prompt_length,
            max_length=max_length, width=width, prompt=torch.tensor(prompt_length, device=device),
            limit=torch.tensor(max_length, device=device), early_stopping=early_stopping, do_sample=do_sample,
            sort_samples=do_sample and transformers_sorts_samples(), top_beam_mask=mask.to(device),
            length_scale=_reciprocals(scale, device),
            heuristic_at_limit=early_stopping == "never" and length_penalty > 0.0,
        )  # fmt: skip

    def per_group(self) -> BeamPlan:
        """The plan with a prompt length and a limit per input, (batch,) static buffers the caller fills (the
        host-only `prompt_length` and `max_length` then mean nothing)."""
        prompt, limit = self.prompt.expand(self.batch).clone(), self.limit.expand(self.batch).clone()
        for buffer in (prompt, limit):
            torch._dynamo.mark_static_address(buffer)
        return attrs.evolve(self, prompt=prompt, limit=limit)


@functools.cache
def transformers_sorts_samples() -> bool:
    """Whether the installed transformers sorts the candidates beam sampling drew by their scores (5.24) or
    keeps them in the order drawn (5.17): the first `beams` of them are the ones that may finish."""
    source = inspect.getsource(GenerationMixin._get_top_k_continuations)
    return ".sort(" in source


def buffer_width(max_length: int) -> int:
    """Columns of token buffers for `max_length`: rounded up to a multiple of 64, so that nearby lengths share
    one compiled shape."""
    return 64 * -(-max_length // 64)


def _power(base: int, exponent: float) -> float:
    if base <= 0:
        return 1.0  # never read: lengths past the prompt are >= 1 whenever these tables are used
    return float(base**exponent)


def _reciprocals(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).reciprocal().to(device)


@frozen(kw_only=True)
class BeamState:
    """Static buffers of one beam search, mutated in place (names as in transformers' `_beam_search`)."""

    running_sequences: torch.Tensor  # (batch, beams, width) long
    running_beam_scores: torch.Tensor  # (batch, beams) float32
    running_beam_indices: torch.Tensor  # (batch, beams, width) int32
    sequences: torch.Tensor
    beam_scores: torch.Tensor
    beam_indices: torch.Tensor
    is_sent_finished: torch.Tensor  # (batch, beams) bool
    improvable: torch.Tensor  # (batch, 1) bool: is_early_stop_heuristic_unsatisfied
    cur_len: torch.Tensor  # long, () or (batch,) as the plan's prompt
    running: torch.Tensor  # bool, () or (batch,): not this_peer_finished
    beam_idx: torch.Tensor  # (batch * beams,) long: the cache rows the next step reads, before its forward

    @classmethod
    def allocate(cls, plan: BeamPlan, device: torch.device) -> BeamState:
        """Buffers for `plan`; `cur_len` and `running` are per input where the plan's prompt is."""
        shape, width = (plan.batch, plan.beams), plan.width
        each = tuple(plan.prompt.shape)
        generated = width  # indices of generated tokens; `width` columns whatever the prompt length
        state = cls(
            running_sequences=torch.zeros(*shape, width, dtype=torch.long, device=device),
            running_beam_scores=torch.zeros(shape, device=device),
            running_beam_indices=torch.zeros(*shape, generated, dtype=torch.int32, device=device),
            sequences=torch.zeros(*shape, width, dtype=torch.long, device=device),
            beam_scores=torch.zeros(shape, device=device),
            beam_indices=torch.zeros(*shape, generated, dtype=torch.int32, device=device),
            is_sent_finished=torch.zeros(shape, dtype=torch.bool, device=device),
            improvable=torch.zeros(plan.batch, 1, dtype=torch.bool, device=device),
            cur_len=torch.zeros(each, dtype=torch.long, device=device),
            running=torch.zeros(each, dtype=torch.bool, device=device),
            beam_idx=torch.arange(plan.batch * plan.beams, device=device),
        )
        for tensor in state.tensors():
            torch._dynamo.mark_static_address(tensor)
        return state

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.running_sequences, self.running_beam_scores, self.running_beam_indices, self.sequences,
            self.beam_scores, self.beam_indices, self.is_sent_finished, self.improvable, self.cur_len, self.running,
            self.beam_idx,
        )  # fmt: skip

    def start(self, prompt: torch.Tensor, plan: BeamPlan, fill: int) -> None:
        """Initial values, as `_beam_search` sets them, for a prompt of shape (batch * beams, length)."""
        self._start_at(slice(None), prompt.view(plan.batch, plan.beams, -1), fill)
        self.cur_len.fill_(prompt.shape[1])
        self.running.fill_(True)
        self.beam_idx.copy_(torch.arange(self.beam_idx.shape[0], device=self.beam_idx.device))

    def start_input(self, index: int, prompt: torch.Tensor, fill: int) -> None:
        """Initial values for input `index` alone, its prompt (beams, length), in a state with a length and a
        running flag per input; the others' values and `beam_idx` are left as they are."""
        self._start_at(index, prompt, fill)
        self.cur_len[index] = prompt.shape[1]
        self.running[index] = True

    def _start_at(self, at: int | slice, prompt: torch.Tensor, fill: int) -> None:
        sequences = self.running_sequences[at]
        sequences.fill_(fill)
        sequences[..., : prompt.shape[-1]].copy_(prompt)
        self.sequences[at].copy_(sequences)
        self.running_beam_scores[at].zero_()
        self.running_beam_scores[at][..., 1:] = _NEG
        self.beam_scores[at].fill_(_NEG)
        self.running_beam_indices[at].fill_(-1)
        self.beam_indices[at].fill_(-1)
        self.is_sent_finished[at].zero_()
        self.improvable[at].fill_(True)

    def last_tokens(self) -> torch.Tensor:
        """The token at `cur_len - 1` of every running beam, shape (batch * beams, 1) (the first of an input
        that holds none: an engine's free group)."""
        rows = self.running_sequences.shape[0] * self.running_sequences.shape[1]
        flat = self.running_sequences.view(rows, -1)
        return flat.gather(1, per_row(self.positions(), self.running_sequences.shape[1], rows))

    def positions(self) -> torch.Tensor:
        """The position of every input's last token, `cur_len - 1` (0 for an input that holds none)."""
        return (self.cur_len - 1).clamp(min=0)


def per_row(value: torch.Tensor, beams: int, rows: int) -> torch.Tensor:
    """A 0-dim or per-input `value` as one entry per beam row, shape (rows, 1)."""
    return value.view(-1, 1).expand(rows // beams, beams).reshape(rows, 1)


def _per_input(value: torch.Tensor, dims: int) -> torch.Tensor:
    """A 0-dim or per-input `value` viewed to broadcast over a tensor of `dims` dimensions led by inputs."""
    return value.view(-1, *([1] * (dims - 1)))


def _penalty(plan: BeamPlan, generated: torch.Tensor) -> torch.Tensor:
    """1 / generated ** length_penalty, (1, 1) or (batch, 1)."""
    return plan.length_scale.index_select(0, generated.view(-1)).view(-1, 1)


def _gather_beams(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    while indices.dim() < tensor.dim():
        indices = indices.unsqueeze(-1)
    return torch.take_along_dim(tensor, indices, dim=1)


def _write_column(tensor: torch.Tensor, at: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    column = torch.arange(tensor.shape[-1], device=tensor.device) == at
    return torch.where(column, values.unsqueeze(-1).to(tensor.dtype), tensor)


def beam_step(
    state: BeamState, logits: torch.Tensor, plan: BeamPlan, noise: torch.Tensor, record: ScoreRecord | None = None
) -> None:
    """One beam-search iteration on `logits` (batch * beams, vocab; float32). The cache rows the next step
    reads are left in `state.beam_idx`, for `reorder_cache` to apply before that step's forward call. `noise`
    (batch, beams * vocab) is the exponential noise beam sampling draws with (unread otherwise). With a
    `record`, the step's processed log-probabilities and raw logits are kept too."""
    batch, beams, keep = plan.batch, plan.beams, plan.keep
    cur_len, running = state.cur_len, state.running
    rows = batch * beams
    generated = cur_len - plan.prompt  # tokens after the prompt: the length penalty's length
    log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
    flat_sequences = state.running_sequences.view(rows, -1).clone()  # not a view of a buffer this step writes
    length = cur_len if cur_len.dim() == 0 else per_row(cur_len, beams, rows)
    for processor in plan.processors:
        log_probs = processor(flat_sequences, length, log_probs)
    if record is not None:
        record.keep(cur_len, running, log_probs, logits)
    vocab = log_probs.shape[-1]
    log_probs = log_probs.view(batch, beams, vocab) + state.running_beam_scores[:, :, None]
    log_probs = log_probs.reshape(batch, beams * vocab)

    topk_log_probs, topk_indices = _top_k_continuations(log_probs, plan, noise)
    topk_current = topk_indices // vocab
    topk_beam_indices = _gather_beams(state.running_beam_indices, topk_current)
    topk_sequences = _gather_beams(state.running_sequences, topk_current)
    topk_ids = topk_indices % vocab
    topk_sequences = _write_column(topk_sequences, _per_input(cur_len, 3), topk_ids)
    offset = torch.arange(batch, device=topk_ids.device).view(-1, 1) * beams
    topk_beam_indices = _write_column(topk_beam_indices, _per_input(generated, 3), topk_current + offset)

    # d. which continuations hit a stopping criterion (end token, or max_length)
    hits = (_per_input(cur_len, 2) + 1 >= _per_input(plan.limit, 2)).expand(batch, keep)
    if plan.eos is not None:
        hits = hits | torch.isin(topk_ids, plan.eos)

    # e. running beams for the next iteration (_get_running_beams_for_next_iteration)
    topk_running_log_probs = topk_log_probs + hits.to(torch.float32) * _NEG
    next_indices = torch.topk(topk_running_log_probs, k=beams)[1]
    running_sequences = _gather_beams(topk_sequences, next_indices)
    running_beam_scores = _gather_beams(topk_running_log_probs, next_indices)
    running_beam_indices = _gather_beams(topk_beam_indices, next_indices)

    # f. finished beams (_update_finished_beams)
    sequences, beam_scores, beam_indices, is_sent_finished = _update_finished(
        state, plan, generated=generated, topk_log_probs=topk_log_probs, topk_sequences=topk_sequences,
        topk_beam_indices=topk_beam_indices, hits=hits,
    )  # fmt: skip

    # g. cache reorder, length, stopping (_check_early_stop_heuristic, _beam_search_has_unfinished_sequences)
    # Clamped: after the search ended, steps still run (the host checks every few steps) and must stay in bounds.
    last_column = state.running_beam_indices.shape[-1] - 1
    at = generated.clamp(max=last_column).view(-1, 1, 1).expand(batch, beams, 1)
    beam_idx = running_beam_indices.gather(2, at.to(torch.long)).view(rows).to(torch.long)
    beam_idx = torch.where(
        per_row(running, beams, rows).view(rows), beam_idx, torch.arange(rows, device=beam_idx.device)
    )
    state.beam_idx.copy_(beam_idx)
    best_length = plan.limit if plan.heuristic_at_limit else (cur_len + 1).clamp(max=plan.width)
    best_running = running_beam_scores[:, :1] * _penalty(plan, best_length - plan.prompt)
    worst_finished = torch.where(is_sent_finished, torch.min(beam_scores, dim=1, keepdim=True)[0], -1.0e9)
    improvable = state.improvable & torch.any(best_running > worst_finished, dim=-1, keepdim=True)
    still_running = _still_running(running, plan, improvable=improvable, finished=is_sent_finished, hits=hits)

    for target, value in (
        (state.running_sequences, running_sequences), (state.running_beam_scores, running_beam_scores),
        (state.running_beam_indices, running_beam_indices), (state.sequences, sequences),
        (state.beam_scores, beam_scores), (state.beam_indices, beam_indices),
        (state.is_sent_finished, is_sent_finished), (state.improvable, improvable),
    ):  # fmt: skip
        target.copy_(torch.where(_per_input(running, target.dim()), value, target))
    state.cur_len.add_(running.long())
    state.running.copy_(running & still_running)


def _top_k_continuations(
    log_probs: torch.Tensor, plan: BeamPlan, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_get_top_k_continuations`: the best `keep`, or drawn without replacement in proportion to
    softmax(log_probs) (the order of an exponential race is the order of successive draws)."""
    if not plan.do_sample:
        found = torch.topk(log_probs, k=plan.keep)
        return found[0], found[1]
    indices = torch.topk(torch.softmax(log_probs, dim=-1) / noise, k=plan.keep)[1]
    chosen = log_probs.gather(1, indices)
    if plan.sort_samples:
        chosen, order = chosen.sort(dim=-1, descending=True)
        indices = indices.gather(1, order)
    return chosen, indices


def _still_running(
    running: torch.Tensor, plan: BeamPlan, *, improvable: torch.Tensor, finished: torch.Tensor, hits: torch.Tensor
) -> torch.Tensor:
    """`_beam_search_has_unfinished_sequences`: over the whole batch for one search (it runs while any input may
    improve, as transformers'), per input for per-input searches."""
    if running.dim() == 0:
        open_beam = ~(torch.all(finished) & (plan.early_stopping is True))
        return torch.any(improvable) & open_beam & ~torch.all(hits)
    open_beam = ~(torch.all(finished, dim=1) & (plan.early_stopping is True))
    return improvable.view(-1) & open_beam & ~torch.all(hits, dim=1)


def _update_finished(
    state: BeamState,
    plan: BeamPlan,
    *,
    generated: torch.Tensor,
    topk_log_probs: torch.Tensor,
    topk_sequences: torch.Tensor,
    topk_beam_indices: torch.Tensor,
    hits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_update_finished_beams`: keep the best `beams` of the finished and the just-finished candidates."""
    just_finished = hits & plan.top_beam_mask[None, :]
    finished_log_probs = topk_log_probs * _penalty(plan, generated + 1)
    full = torch.all(state.is_sent_finished, dim=-1, keepdim=True) & (plan.early_stopping is True)
    finished_log_probs = finished_log_probs + full.to(torch.float32) * _NEG
    finished_log_probs = finished_log_probs + (~state.improvable).to(torch.float32) * _NEG
    finished_log_probs = finished_log_probs + (~just_finished) * _NEG
    merged_sequences = torch.cat((state.sequences, topk_sequences), dim=1)
    merged_scores = torch.cat((state.beam_scores, finished_log_probs), dim=1)
    merged_beam_indices = torch.cat((state.beam_indices, topk_beam_indices), dim=1)
    merged_finished = torch.cat((state.is_sent_finished, just_finished), dim=1)
    best = torch.topk(merged_scores, k=plan.beams)[1]
    return (
        _gather_beams(merged_sequences, best), _gather_beams(merged_scores, best),
        _gather_beams(merged_beam_indices, best), _gather_beams(merged_finished, best),
    )  # fmt: skip


def reorder_cache(beam_idx: torch.Tensor, self_attention: Sequence[object]) -> None:
    """Write the rows `beam_idx` (a state's) selects back into each self-attention layer's own keys and values.

    Called at the start of a step, before its forward call writes the cache: inductor (torch 2.13, CPU)
    miscompiles `keys.copy_(keys.index_select(0, idx))` right after an `index_copy_` into the same buffer in
    one graph (it reads rows it has already overwritten), and gets this order right.
    """
    for layer in self_attention:
        for name in ("keys", "values"):
            buffer: torch.Tensor = getattr(layer, name)
            buffer.copy_(buffer.index_select(0, beam_idx))


@frozen
class BeamResult:
    """The best `num_return_sequences` finished hypotheses per input, flattened and cut as `_beam_search`
    cuts them."""

    sequences: torch.Tensor  # (batch * num_return_sequences, prompt + generated) long
    sequences_scores: torch.Tensor  # (batch * num_return_sequences,) float32: length-penalised scores
    beam_indices: torch.Tensor  # (batch * num_return_sequences, generated) int32: -1 past a hypothesis' end


def beam_output(state: BeamState, plan: BeamPlan, num_return_sequences: int) -> BeamResult:
    sequences = state.sequences[:, :num_return_sequences].reshape(-1, state.sequences.shape[-1])
    indices = state.beam_indices[:, :num_return_sequences].reshape(-1, state.beam_indices.shape[-1])
    generated = int((indices + 1).bool().sum(dim=1).max())
    return BeamResult(
        sequences[:, : plan.prompt_length + generated].clone(),
        state.beam_scores[:, :num_return_sequences].reshape(-1).clone(),
        indices[:, :generated].clone(),
    )
