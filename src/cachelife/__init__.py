"""cachelife: an explicit, typed lifecycle for transformers static KV caches under torch.compile and CUDA graphs.

Every layer cache moves through `Unallocated -> Pinned -> Filled` (see `cachelife.layer_lifecycle`). `enable`
guards a model so that `generate` decodes only with pinned caches; `prepare_static_cache` builds pinned
caches for your own loops; `lifecycle(cache)` shows and drives the states of any static cache; `decode` is
cachelife's own compiled decode loop for bare configs, and `generate` takes `model.generate`'s arguments
and decodes them in one compiled, graph-captured step.

`cachelife.decode` is that function, not its module: the module stays importable by name
(`from cachelife.decode import decode`, `importlib.import_module("cachelife.decode")`).
"""

import importlib
from typing import TYPE_CHECKING

from cachelife.buffers import Buffers, PinSpec
from cachelife.cache_lifecycle import CacheLifecycle, is_managed_cache, lifecycle
from cachelife.compile_cache import pinned_compile_cache
from cachelife.compiled import FAST_KERNELS, compile_forward, restore_forward

# The function: binding it replaces the attribute `decode` that importing the submodule set (see above).
from cachelife.decode import decode
from cachelife.enabling import CacheLifecycleMixin, disable, enable, is_enabled, pool_of, release_pool
from cachelife.errors import (
    CacheLifecycleError,
    CacheShapeError,
    CompileArtifactsFormatError,
    CompileArtifactsMismatchError,
    CompiledRegionError,
    IllegalTransitionError,
    InvalidArgumentError,
    InvalidBucketsError,
    NoCompileArtifactsError,
    ReplacedBuffersError,
    UnmarkedBuffersError,
    UnpinnedCacheError,
    UnsupportedCacheError,
    UnsupportedGenerationError,
)
from cachelife.generation import generate
from cachelife.layer_lifecycle import (
    TRANSITIONS,
    Filled,
    FillRecord,
    LayerLifecycle,
    LayerState,
    NoStorage,
    Pinned,
    Unallocated,
)
from cachelife.log import configure_from_environment, disable_debug_logging, enable_debug_logging
from cachelife.pinning import pin_for_model, prepare_static_cache
from cachelife.pool import CachePool
from cachelife.shapes import CacheShapes, DeclaresCacheShapes, LayerShape, infer_cache_shapes, model_cache_shapes
from cachelife.version import __version__
from cachelife.warm_start import (
    CompileArtifactsHeader,
    load_compile_artifacts,
    read_compile_artifacts_header,
    save_compile_artifacts,
)

if TYPE_CHECKING:
    from cachelife import zoo as zoo
else:

    def __getattr__(name: str) -> object:
        """`cachelife.zoo` on first use: its models load transformers' model code, which `import cachelife` skips."""
        if name == "zoo":
            return importlib.import_module("cachelife.zoo")
        msg = f"module 'cachelife' has no attribute {name!r}"
        raise AttributeError(msg)


__all__ = [
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
    "FillRecord",
    "Filled",
    "IllegalTransitionError",
    "InvalidArgumentError",
    "InvalidBucketsError",
    "LayerLifecycle",
    "LayerShape",
    "LayerState",
    "NoCompileArtifactsError",
    "NoStorage",
    "PinSpec",
    "Pinned",
    "ReplacedBuffersError",
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
    "release_pool",
    "restore_forward",
    "save_compile_artifacts",
]

configure_from_environment()
