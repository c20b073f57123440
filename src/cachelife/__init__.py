"""cachelife: an explicit, typed lifecycle for transformers static KV caches under torch.compile and CUDA graphs.

Every layer cache moves through `Unallocated -> Pinned -> Filled` (see `cachelife.layer_lifecycle`). `enable`
guards a model so that `generate` decodes only with pinned caches; `prepare_static_cache` builds pinned
caches for your own loops; `lifecycle(cache)` shows and drives the states of any static cache.
"""

from cachelife.buffers import Buffers, PinSpec
from cachelife.cache_lifecycle import CacheLifecycle, is_managed_cache, lifecycle
from cachelife.compile_cache import pinned_compile_cache
from cachelife.errors import (
    CacheLifecycleError,
    CacheShapeError,
    CompiledRegionError,
    IllegalTransitionError,
    InvalidBucketsError,
    ReplacedBuffersError,
    UnmarkedBuffersError,
    UnpinnedCacheError,
    UnsupportedCacheError,
    UnsupportedGenerationError,
)
from cachelife.generation import generate
from cachelife.integration import (
    CacheLifecycleMixin,
    disable,
    enable,
    is_enabled,
    pin_for_model,
    pool_of,
    prepare_static_cache,
    release_pool,
)
from cachelife.layer_lifecycle import TRANSITIONS, Filled, FillRecord, LayerLifecycle, LayerState, Pinned, Unallocated
from cachelife.log import configure_from_environment, disable_debug_logging, enable_debug_logging
from cachelife.pool import CachePool
from cachelife.shapes import CacheShapes, DeclaresCacheShapes, LayerShape, infer_cache_shapes, model_cache_shapes

__version__ = "0.1.0"

__all__ = [
    "TRANSITIONS",
    "Buffers",
    "CacheLifecycle",
    "CacheLifecycleError",
    "CacheLifecycleMixin",
    "CachePool",
    "CacheShapeError",
    "CacheShapes",
    "CompiledRegionError",
    "DeclaresCacheShapes",
    "FillRecord",
    "Filled",
    "IllegalTransitionError",
    "InvalidBucketsError",
    "LayerLifecycle",
    "LayerShape",
    "LayerState",
    "PinSpec",
    "Pinned",
    "ReplacedBuffersError",
    "Unallocated",
    "UnmarkedBuffersError",
    "UnpinnedCacheError",
    "UnsupportedCacheError",
    "UnsupportedGenerationError",
    "__version__",
    "configure_from_environment",
    "disable",
    "disable_debug_logging",
    "enable",
    "enable_debug_logging",
    "generate",
    "infer_cache_shapes",
    "is_enabled",
    "is_managed_cache",
    "lifecycle",
    "model_cache_shapes",
    "pin_for_model",
    "pinned_compile_cache",
    "pool_of",
    "prepare_static_cache",
    "release_pool",
]

configure_from_environment()
