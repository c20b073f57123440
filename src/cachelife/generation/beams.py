"""Beam search as one in-place update of static buffers: transformers 5.x `_beam_search`, step for step.

Ported from the logic of `GenerationMixin._get_top_k_continuations`, `_get_running_beams_for_next_iteration`,
`_update_finished_beams`, `_check_early_stop_heuristic` and `_beam_search_has_unfinished_sequences`, with the
current length `cur_len` a 0-dim tensor: writes at `cur_len` are `where` over the buffer's columns, and the
length penalties `(length) ** length_penalty` come from tables computed on the host in Python floats (as
transformers computes them) and applied as a multiplication by their float32 reciprocal, the arithmetic
PyTorch uses to divide a tensor by a Python float. After the search ends, the update changes nothing.

The self-attention cache is reordered in place (`keys.copy_(keys.index_select(0, beam_idx))`: same tensors,
same addresses), at the start of the next step (`reorder_cache`). The cross-attention cache is not touched:
every beam of one input holds the same encoder keys and values, and a reorder only moves rows within one
input's beams.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch
from attrs import field, frozen
from transformers.generation.utils import GenerationMixin

from cachelife.generation.processors import TensorProcessor
from cachelife.generation.records import ScoreRecord

_NEG = -1.0e9


@frozen
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
    prompt: torch.Tensor  # 0-dim long
    limit: torch.Tensor  # 0-dim long: max_length
    early_stopping: bool | str
    # Beam sampling: candidates drawn without replacement (an exponential race over the accumulated
    # probabilities) instead of the top ones; `sort_samples` as the installed transformers orders them.
    do_sample: bool
    sort_samples: bool
    top_beam_mask: torch.Tensor  # (keep,) bool: the first `beams` candidates
    finished_scale: torch.Tensor  # (width + 1,) float32: 1 / (cur_len + 1 - prompt) ** length_penalty
    heuristic_scale: torch.Tensor  # (width + 1,) float32: 1 / best hypothetical length ** length_penalty

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
        lengths = range(width + 1)
        finished = [_power(cur_len + 1 - prompt_length, length_penalty) for cur_len in lengths]
        if early_stopping == "never" and length_penalty > 0.0:
            best = [_power(max_length - prompt_length, length_penalty) for _ in lengths]
        else:
            best = [_power(cur_len - prompt_length, length_penalty) for cur_len in lengths]
        return cls(
            processors, eos, batch, beams, keep, prompt_length, max_length, width,
            torch.tensor(prompt_length, device=device), torch.tensor(max_length, device=device), early_stopping,
            do_sample, do_sample and transformers_sorts_samples(), mask.to(device), _reciprocals(finished, device),
            _reciprocals(best, device),
        )  # fmt: skip


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


@frozen
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
    cur_len: torch.Tensor  # () long
    running: torch.Tensor  # () bool: not this_peer_finished
    beam_idx: torch.Tensor  # (batch * beams,) long: the cache rows the next step reads, before its forward

    @classmethod
    def allocate(cls, plan: BeamPlan, device: torch.device) -> BeamState:
        shape, width = (plan.batch, plan.beams), plan.width
        generated = width  # indices of generated tokens; `width` columns whatever the prompt length
        state = cls(
            torch.zeros(*shape, width, dtype=torch.long, device=device),
            torch.zeros(shape, device=device),
            torch.zeros(*shape, generated, dtype=torch.int32, device=device),
            torch.zeros(*shape, width, dtype=torch.long, device=device),
            torch.zeros(shape, device=device),
            torch.zeros(*shape, generated, dtype=torch.int32, device=device),
            torch.zeros(shape, dtype=torch.bool, device=device),
            torch.zeros(plan.batch, 1, dtype=torch.bool, device=device),
            torch.zeros((), dtype=torch.long, device=device),
            torch.zeros((), dtype=torch.bool, device=device),
            torch.arange(plan.batch * plan.beams, device=device),
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
        self.running_sequences.fill_(fill)
        self.running_sequences[:, :, : prompt.shape[1]].copy_(prompt.view(plan.batch, plan.beams, -1))
        self.sequences.copy_(self.running_sequences)
        self.running_beam_scores.zero_()
        self.running_beam_scores[:, 1:] = _NEG
        self.beam_scores.fill_(_NEG)
        self.running_beam_indices.fill_(-1)
        self.beam_indices.fill_(-1)
        self.is_sent_finished.zero_()
        self.improvable.fill_(True)
        self.cur_len.fill_(prompt.shape[1])
        self.running.fill_(True)
        self.beam_idx.copy_(torch.arange(self.beam_idx.shape[0], device=self.beam_idx.device))

    def last_tokens(self) -> torch.Tensor:
        """The token at `cur_len - 1` of every running beam, shape (batch * beams, 1)."""
        rows = self.running_sequences.shape[0] * self.running_sequences.shape[1]
        flat = self.running_sequences.view(rows, -1)
        return flat.gather(1, (self.cur_len - 1).view(1, 1).expand(rows, 1))


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
    log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
    flat_sequences = state.running_sequences.view(rows, -1).clone()  # not a view of a buffer this step writes
    for processor in plan.processors:
        log_probs = processor(flat_sequences, cur_len, log_probs)
    if record is not None:
        record.keep(cur_len, running, log_probs, logits)
    vocab = log_probs.shape[-1]
    log_probs = log_probs.view(batch, beams, vocab) + state.running_beam_scores[:, :, None]
    log_probs = log_probs.reshape(batch, beams * vocab)

    # c. top-K continuations (_get_top_k_continuations): the best, or drawn without replacement in proportion
    # to softmax(log_probs) (the order of an exponential race is the order of successive draws)
    if plan.do_sample:
        topk_indices = torch.topk(torch.softmax(log_probs, dim=-1) / noise, k=keep)[1]
        topk_log_probs = log_probs.gather(1, topk_indices)
        if plan.sort_samples:
            topk_log_probs, order = topk_log_probs.sort(dim=-1, descending=True)
            topk_indices = topk_indices.gather(1, order)
    else:
        topk_log_probs, topk_indices = torch.topk(log_probs, k=keep)
    topk_current = topk_indices // vocab
    topk_beam_indices = _gather_beams(state.running_beam_indices, topk_current)
    topk_sequences = _gather_beams(state.running_sequences, topk_current)
    topk_ids = topk_indices % vocab
    topk_sequences = _write_column(topk_sequences, cur_len, topk_ids)
    offset = torch.arange(batch, device=topk_ids.device).view(-1, 1) * beams
    topk_beam_indices = _write_column(topk_beam_indices, cur_len - plan.prompt, topk_current + offset)

    # d. which continuations hit a stopping criterion (end token, or max_length)
    hits = (cur_len + 1 >= plan.limit).expand(batch, keep)
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
        state, plan, topk_log_probs=topk_log_probs, topk_sequences=topk_sequences,
        topk_beam_indices=topk_beam_indices, hits=hits,
    )  # fmt: skip

    # g. cache reorder, length, stopping (_check_early_stop_heuristic, _beam_search_has_unfinished_sequences)
    # Clamped: after the search ended, steps still run (the host checks every few steps) and must stay in bounds.
    last_column = state.running_beam_indices.shape[-1] - 1
    at = (cur_len - plan.prompt).clamp(max=last_column).view(1, 1, 1).expand(batch, beams, 1)
    beam_idx = running_beam_indices.gather(2, at.to(torch.long)).view(rows).to(torch.long)
    beam_idx = torch.where(running, beam_idx, torch.arange(rows, device=beam_idx.device))
    state.beam_idx.copy_(beam_idx)
    next_len = (cur_len + 1).clamp(max=plan.width)
    best_running = running_beam_scores[:, :1] * plan.heuristic_scale.index_select(0, next_len.view(1))
    worst_finished = torch.where(is_sent_finished, torch.min(beam_scores, dim=1, keepdim=True)[0], -1.0e9)
    improvable = state.improvable & torch.any(best_running > worst_finished, dim=-1, keepdim=True)
    open_beam = ~(torch.all(is_sent_finished) & (plan.early_stopping is True))
    still_running = torch.any(improvable) & open_beam & ~torch.all(hits)

    for target, value in (
        (state.running_sequences, running_sequences), (state.running_beam_scores, running_beam_scores),
        (state.running_beam_indices, running_beam_indices), (state.sequences, sequences),
        (state.beam_scores, beam_scores), (state.beam_indices, beam_indices),
        (state.is_sent_finished, is_sent_finished), (state.improvable, improvable),
    ):  # fmt: skip
        target.copy_(torch.where(running, value, target))
    state.cur_len.add_(running.long())
    state.running.copy_(running & still_running)


def _update_finished(
    state: BeamState,
    plan: BeamPlan,
    *,
    topk_log_probs: torch.Tensor,
    topk_sequences: torch.Tensor,
    topk_beam_indices: torch.Tensor,
    hits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_update_finished_beams`: keep the best `beams` of the finished and the just-finished candidates."""
    just_finished = hits & plan.top_beam_mask[None, :]
    finished_log_probs = topk_log_probs * plan.finished_scale.index_select(0, state.cur_len.view(1))
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


def reorder_cache(state: BeamState, self_attention: Sequence[object]) -> None:
    """Write the rows `state.beam_idx` selects back into each self-attention layer's own keys and values.

    Called at the start of a step, before its forward call writes the cache: inductor (torch 2.13, CPU)
    miscompiles `keys.copy_(keys.index_select(0, idx))` right after an `index_copy_` into the same buffer in
    one graph (it reads rows it has already overwritten), and gets this order right.
    """
    for layer in self_attention:
        for name in ("keys", "values"):
            buffer: torch.Tensor = getattr(layer, name)
            buffer.copy_(buffer.index_select(0, state.beam_idx))


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
