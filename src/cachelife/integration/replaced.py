"""Pinned cache layers found holding tensors they were not pinned with, at the decoding boundary.

Beam reorders of a layer without cachelife's in-place reorder, `Cache.crop`, `batch_select_indices`, or code
assigning `layer.keys` replace a pinned layer's tensors behind the lifecycle's back; CUDA graphs would then skip
or re-record. `ReplacedTensors.restore_or_refuse` copies their content back into the pinned tensors and warns
once per cache, or, with `on_unpinned="raise"`, refuses with `ReplacedBuffersError`.
"""

from __future__ import annotations

import logging
import weakref

from attrs import define, field

from cachelife.core.cache_lifecycle import CacheLifecycle
from cachelife.errors import ReplacedBuffersError

logger = logging.getLogger(__name__)

_FIX = (
    "Replace no tensor of a pinned layer: write into it in place (copy_, index_copy_), or release and pin the "
    "cache again."
)


@define
class ReplacedTensors:
    """What one model's guard has seen of replaced tensors."""

    # Whether a pinned layer was found holding replaced tensors (then a stale compile cache is no likely cause
    # of CUDA-graph skips).
    seen: bool = False
    # Caches whose replaced tensors were already reported, to warn once per cache.
    _warned: weakref.WeakSet[CacheLifecycle] = field(factory=weakref.WeakSet, alias="warned")

    def restore_or_refuse(self, who: str, state: CacheLifecycle, *, refuse: bool) -> None:
        replaced = state.replaced()
        if not replaced:
            return
        self.seen = True
        names = "; ".join(f"{layer.describe()}: {', '.join(tensors)}" for layer, tensors in replaced)
        if refuse:
            msg = (
                f"{len(replaced)} pinned cache layer(s) of {who} hold tensors they were not pinned with ({names}), "
                f"so CUDA graphs would skip or re-record. {_FIX}"
            )
            raise ReplacedBuffersError(msg)
        for layer, _ in replaced:
            layer.restore_buffers()
        if state in self._warned:
            logger.debug("replaced cache tensors restored again before %s's forward: %s", who, names)
            return
        self._warned.add(state)
        logger.warning(
            "%d pinned cache layer(s) reached %s's forward holding tensors they were not pinned with (%s); "
            "cachelife copied their content back into the pinned tensors, at the pinned addresses. %s Pass "
            "on_unpinned='raise' to cachelife.enable to make this an error.",
            len(replaced),
            who,
            names,
            _FIX,
        )
