"""Each boolean lever of `Options` as one reversible rewrite of a model: `REWRITES`, in the order they apply.

A `Rewrite` names its lever; `check(model)` refuses a model that cannot take it before anything changes, and
`apply(model)` changes the model and returns what undoes it exactly. The restore is a bound method of the object
that holds what the rewrite changed, so that a deep copy of the model (which copies that object with it) restores
the copy's modules. Adding a lever is one field of `Options` and one entry here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

from attrs import frozen
from transformers import PreTrainedModel

from cachelife.integration.options import Options
from cachelife.model_rewrites.decode_attention import check_decode_attention, use_decode_attention
from cachelife.model_rewrites.fused_layers import fuse_layers
from cachelife.model_rewrites.fused_projections import fuse_projections
from cachelife.model_rewrites.layer_regions import mark_layer_regions

logger = logging.getLogger(__name__)

Restore = Callable[[], None]


def _takes_any(model: PreTrainedModel) -> None:
    """Every model takes the rewrite."""


def _restores_nothing() -> None:
    """Nothing to undo: the rewrite left the model as it was."""


def _fuse(model: PreTrainedModel) -> Restore:
    fused = fuse_projections(model)
    if not fused.groups:  # on by default: most models that have none are no mistake of the caller's
        logger.info(
            "fuse_projections: no projections of %s can be fused (%d group(s) left as they are; DEBUG "
            "logging of cachelife.model_rewrites.fused_projections says why)",
            type(model).__name__,
            len(fused.skipped),
        )
    return fused.restore


def _switch_attention(model: PreTrainedModel) -> Restore:
    switch = use_decode_attention(model)
    logger.debug("%s: attention implementation switched to cachelife's decode attention", type(model).__name__)
    return switch.restore


def _steps_read_it(model: PreTrainedModel) -> Restore:
    # `small_linear` changes no module: the decoding steps read it (`cachelife.generation.steps`).
    return _restores_nothing


def _fuse_layers(model: PreTrainedModel) -> Restore:
    fused = fuse_layers(model)
    if not fused.layers:
        logger.warning(
            "fused_layers=True: no layer of %s can be fused (%d left as they are; DEBUG logging of "
            "cachelife.model_rewrites.fused_layers says why)",
            type(model).__name__,
            len(fused.skipped),
        )
    return fused.restore


def _mark_regions(model: PreTrainedModel) -> Restore:
    regions = mark_layer_regions(model)
    if not regions.layers:
        logger.warning("compile_regions=True: %s has no stack of identical layers", type(model).__name__)
    return regions.restore


@frozen
class Rewrite:
    """One lever of `Options` (a boolean field, `option`) as a change to a model: `apply(model)` makes it and
    returns its restore; `check(model)` raises before anything changes where the model cannot take it."""

    option: str
    apply: Callable[[PreTrainedModel], Restore]
    check: Callable[[PreTrainedModel], None] = _takes_any

    def wanted(self, options: Options) -> bool:
        """Whether `options` turn this rewrite on."""
        return bool(getattr(options, self.option))


REWRITES: Final = (
    Rewrite("fuse_projections", _fuse),
    Rewrite("decode_attention", _switch_attention, check_decode_attention),
    Rewrite("small_linear", _steps_read_it),
    Rewrite("fused_layers", _fuse_layers),
    Rewrite("compile_regions", _mark_regions),
)


def check_rewrites(model: PreTrainedModel, options: Options) -> None:
    """Raise, before anything changes, if `model` cannot take a rewrite that `options` turn on."""
    for rewrite in REWRITES:
        if rewrite.wanted(options):
            rewrite.check(model)
