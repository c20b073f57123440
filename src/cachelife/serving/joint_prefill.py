"""Newcomers' prompts through one forward: the engine's prefill for decoder-only models.

At a step boundary where several requests join, one forward over their prompts costs the host what one
prompt's forward costs. The prompts are left-padded to a prompt bucket (`bucket`: the longest prompt's length
rounded up to a power of two, at most the cache's width), with an attention mask that leaves the pads out and
position ids that count from each prompt's first token (as `generate` counts them for a left-padded batch),
into a pinned scratch cache of that many rows: one per group size, powers of two from 1 up to `MOST_ROWS`; a
group of another size is padded with copies of its last prompt. A newcomer that joins alone takes this prefill
too, as a group of one. With cachelife's CUDA graphs the forward of each group size and bucket is captured
once and replayed (`Prefill.joint`): a handful of shapes serve every prompt length. Each newcomer's row of the
scratch is then copied into its row of the batch as a one-row prefill would be (`row_writes`), its own first
token at its prompt's first slot: the extra pads land on slots its mask leaves out. A request's own left
padding stays its own (in its tokens and under its mask), as it does in a one-row prefill.

Requests that take part: one sequence (no beams), token ids (no embeddings), and no prepared inputs beyond the
mask, the position ids, `logits_to_keep`, `use_cache` and the cache, on a decoder-only model whose steps the
engine compiles or runs eagerly. The forward is the engine prefill's: captured or compiled where the one-row
prefill is (dynamo makes the batch and prompt sizes dynamic from their second values), transformers' modules
run eagerly otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Final

import torch
from attrs import frozen
from transformers import PreTrainedModel

from cachelife.core.cache_lifecycle import lifecycle
from cachelife.core.pinning import prepare_static_cache
from cachelife.generation.loop_settings import LoopSettings
from cachelife.serving.prefill import Prefill
from cachelife.serving.requests import Joining
from cachelife.serving.row_writes import RowWrites

logger = logging.getLogger(__name__)

MOST_ROWS: Final = 8
"""The largest group one forward prefills; more newcomers at one boundary take several forwards."""

SHORTEST_BUCKET: Final = 8
"""The shortest prompt bucket: shorter prompts are padded to it."""

# The prepared inputs a joint prefill builds for the group itself (any other sends the request alone).
_JOINT_INPUTS: Final = frozenset({"attention_mask", "position_ids", "logits_to_keep", "use_cache"})


def group_sizes(rows: int) -> tuple[int, ...]:
    """The scratch caches' batch sizes for an engine of `rows` rows: 1, 2, 4, ... up to `MOST_ROWS` and `rows`."""
    sizes, size = [], 1
    while size <= min(rows, MOST_ROWS):
        sizes.append(size)
        size *= 2
    return tuple(sizes)


def joint_groups(joinings: Sequence[Joining], joint: JointPrefill) -> list[list[Joining]]:
    """The newcomers in order, cut into the groups one forward prefills: neighbours that `joint` takes, at most
    its largest group each; every other newcomer a group of its own."""
    groups: list[list[Joining]] = []
    for joining in joinings:
        last = groups[-1] if groups else None
        if last is not None and joint.takes(joining) and joint.takes(last[0]) and len(last) < joint.most:
            last.append(joining)
        else:
            groups.append([joining])
    return groups


def bucket(longest: int, width: int) -> int:
    """The length prompts of at most `longest` tokens are padded to: the next power of two from
    `SHORTEST_BUCKET` on, at most `width` (the scratch cache's)."""
    return min(max(SHORTEST_BUCKET, 1 << (longest - 1).bit_length()), width)


@frozen(kw_only=True)
class Prefilled:
    """A newcomer's prefill, ready to be copied into its row: its last logits (1, vocab), the row writes of
    the scratch cache that holds it, its row in that cache, and the scratch slots before its first token."""

    logits: torch.Tensor
    writes: RowWrites
    source: int
    extra: int


class JointPrefill:
    """The joint prefills of one engine (see the module docstring)."""

    def __init__(
        self, model: PreTrainedModel, cache: object, *, sizes: Sequence[int], width: int, settings: LoopSettings,
        prefill: Prefill, cache_name: str,
    ) -> None:  # fmt: skip
        """A pinned scratch cache of `width` slots, with its row writes into `cache`, for each of `sizes` (none:
        every newcomer is prefilled alone)."""
        self.model, self.prefill, self.cache_name, self.width = model, prefill, cache_name, width
        self.scratches: dict[int, tuple[object, RowWrites]] = {}
        for size in sizes:
            scratch = prepare_static_cache(model, batch_size=size, max_cache_len=width)
            self.scratches[size] = (scratch, RowWrites(model, cache, scratch, settings))

    @property
    def most(self) -> int:
        """The largest group one forward takes (0: none)."""
        return max(self.scratches, default=0)

    def takes(self, joining: Joining) -> bool:
        """Whether the newcomer may be prefilled with others."""
        kwargs = joining.model_kwargs
        extra = set(kwargs) - _JOINT_INPUTS - {self.cache_name, "past_key_values", "cache"}
        return (
            bool(self.scratches)
            and joining.rows == 1
            and not extra
            and getattr(joining.config, "prefill_chunk_size", None) is None
            and kwargs.get("use_cache", True) is True
        )

    def or_none(self, joinings: Sequence[Joining]) -> list[Prefilled] | None:
        """The joint prefill, or None (logged) if it failed: each newcomer is then prefilled alone."""
        try:
            return self(joinings)
        except Exception:
            logger.warning("cachelife.Engine: a joint prefill of %d newcomers failed; each is prefilled alone",
                           len(joinings), exc_info=True)  # fmt: skip
            return None

    def __call__(self, joinings: Sequence[Joining]) -> list[Prefilled]:
        """One forward over the newcomers' prompts (1 to `most` of them, each `takes`); each one's prefill."""
        size = min(size for size in self.scratches if size >= len(joinings))
        scratch, writes = self.scratches[size]
        longest = bucket(max(joining.prompt for joining in joinings), self.width)
        members = [*joinings, *[joinings[-1]] * (size - len(joinings))]
        ids, mask, positions = zip(*(_padded(joining, longest) for joining in members), strict=True)
        kwargs: dict[str, Any] = {
            "attention_mask": torch.cat(mask), "position_ids": torch.cat(positions), "use_cache": True,
            self.cache_name: scratch,
        }  # fmt: skip
        keep = joinings[0].model_kwargs.get("logits_to_keep")
        if keep is not None:
            kwargs["logits_to_keep"] = keep
        lifecycle(scratch).reset()
        logits = self.prefill.joint(torch.cat(ids), kwargs, scratch)
        return [
            Prefilled(logits=logits[index : index + 1], writes=writes, source=index, extra=longest - joining.prompt)
            for index, joining in enumerate(joinings)
        ]


def _padded(joining: Joining, longest: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The newcomer's token ids, attention mask and position ids (1, longest) each, left-padded to `longest`
    with masked copies of its first token."""
    ids = joining.input_ids[:1]
    extra = longest - ids.shape[1]
    own_mask = joining.model_kwargs.get("attention_mask")
    if not isinstance(own_mask, torch.Tensor):
        own_mask = torch.ones_like(ids)
    own_positions = joining.model_kwargs.get("position_ids")
    if not isinstance(own_positions, torch.Tensor):
        own_positions = (own_mask.long().cumsum(-1) - 1).masked_fill(own_mask == 0, 1)
    pad = ids[:, :1].expand(1, extra)
    return (
        torch.cat([pad, ids], dim=1),
        torch.cat([torch.zeros_like(own_mask[:, :1]).expand(1, extra), own_mask[:1]], dim=1),
        torch.cat([torch.ones_like(own_positions[:, :1]).expand(1, extra), own_positions[:1]], dim=1),
    )
