"""cachelife: an explicit, typed lifecycle for transformers static KV caches under torch.compile and CUDA graphs.

Every layer cache moves through `Unallocated -> Pinned -> Filled` (see `cachelife.core.layer_lifecycle`). `enable`
guards a model so that `generate` decodes only with pinned caches; `prepare_static_cache` builds pinned
caches for your own loops; `lifecycle(cache)` shows and drives the states of any static cache; `decode` is
cachelife's own compiled decode loop for bare configs, and `generate` takes `model.generate`'s arguments
and decodes them in one compiled, graph-captured step.

`cachelife.decode` is that function, not its module: the module stays importable by name
(`from cachelife.generation.decode import decode`, `importlib.import_module("cachelife.generation.decode")`).
"""

from cachelife.core.buffers import Buffers, PinSpec
from cachelife.core.cache_lifecycle import CacheLifecycle, is_managed_cache, lifecycle
from cachelife.core.layer_lifecycle import (
    TRANSITIONS,
    Filled,
    FillRecord,
    LayerLifecycle,
    LayerState,
    NoStorage,
    Pinned,
    Unallocated,
)
from cachelife.core.pinning import pin_for_model, prepare_static_cache
from cachelife.core.pool import CachePool
from cachelife.core.shapes import (
    CacheShapes,
    DeclaresCacheShapes,
    LayerShape,
    infer_cache_shapes,
    model_cache_shapes,
)
from cachelife.errors import (
    CacheLifecycleError,
    CacheShapeError,
    CompileArtifactsFormatError,
    CompileArtifactsMismatchError,
    CompiledRegionError,
    EnabledModelPickleError,
    EngineClosedError,
    IllegalSlotTransitionError,
    IllegalTransitionError,
    InvalidArgumentError,
    InvalidBucketsError,
    NoCompileArtifactsError,
    QueueFullError,
    ReplacedBuffersError,
    RequestTimeoutError,
    UnmarkedBuffersError,
    UnpinnedCacheError,
    UnsupportedCacheError,
    UnsupportedGenerationError,
)
from cachelife.generation.api import generate

# The function: binding it replaces the attribute `decode` that importing the submodule set (see above).
from cachelife.generation.decode import decode
from cachelife.integration.compile_cache import pinned_compile_cache
from cachelife.integration.compiled import FAST_KERNELS, compile_forward, restore_forward
from cachelife.integration.enabling import (
    CacheLifecycleMixin,
    disable,
    enable,
    is_enabled,
    pool_of,
    release,
    release_pool,
)
from cachelife.integration.options import EXACT, FAST, Options
from cachelife.integration.runtime import ModelRuntime, Released, runtime_of
from cachelife.integration.warm_start import (
    CompileArtifactsHeader,
    load_compile_artifacts,
    read_compile_artifacts_header,
    save_compile_artifacts,
)
from cachelife.log import configure_from_environment, disable_debug_logging, enable_debug_logging
from cachelife.serving.engine import Engine
from cachelife.serving.stats import EngineStats
from cachelife.version import __version__

__all__ = [
    "EXACT",
    "FAST",
    "FAST_KERNELS",
    "TRANSITIONS",
    "Buffers",
    "CacheLifecycle",
    "CacheLifecycleError",
    "CacheLifecycleMixin",
    "CachePool",
    "CacheShapeError",
    "CacheShapes",
    "CompileArtifactsFormatError",
    "CompileArtifactsHeader",
    "CompileArtifactsMismatchError",
    "CompiledRegionError",
    "DeclaresCacheShapes",
    "EnabledModelPickleError",
    "Engine",
    "EngineClosedError",
    "EngineStats",
    "FillRecord",
    "Filled",
    "IllegalSlotTransitionError",
    "IllegalTransitionError",
    "InvalidArgumentError",
    "InvalidBucketsError",
    "LayerLifecycle",
    "LayerShape",
    "LayerState",
    "ModelRuntime",
    "NoCompileArtifactsError",
    "NoStorage",
    "Options",
    "PinSpec",
    "Pinned",
    "QueueFullError",
    "Released",
    "ReplacedBuffersError",
    "RequestTimeoutError",
    "Unallocated",
    "UnmarkedBuffersError",
    "UnpinnedCacheError",
    "UnsupportedCacheError",
    "UnsupportedGenerationError",
    "__version__",
    "compile_forward",
    "configure_from_environment",
    "decode",
    "disable",
    "disable_debug_logging",
    "enable",
    "enable_debug_logging",
    "generate",
    "infer_cache_shapes",
    "is_enabled",
    "is_managed_cache",
    "lifecycle",
    "load_compile_artifacts",
    "model_cache_shapes",
    "pin_for_model",
    "pinned_compile_cache",
    "pool_of",
    "prepare_static_cache",
    "read_compile_artifacts_header",
    "release",
    "release_pool",
    "restore_forward",
    "runtime_of",
    "save_compile_artifacts",
]

configure_from_environment()
