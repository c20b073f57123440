"""cachelife: an explicit, typed lifecycle for transformers static KV caches under torch.compile and CUDA graphs.

Every layer cache moves through `Unallocated -> Pinned -> Filled` (`cachelife.core.layer_lifecycle`). `enable`
guards a model so that its `generate` decodes only with pinned caches; `generate` takes `model.generate`'s
arguments and decodes them in one compiled, graph-captured step; `Engine` batches many requests on one model;
`prepare_static_cache` and `lifecycle(cache)` build and drive pinned caches for a loop of your own.

The top level holds what a user writes: these tasks, the types their functions return or take (`Released`,
`CachePool`, `CacheLifecycle`, `LayerLifecycle`, the states, `FillRecord`, `EngineStats`,
`CompileArtifactsHeader`), what a model author declares (`CacheLifecycleMixin`, `DeclaresCacheShapes`,
`CacheShapes`, `LayerShape`), warm starts, the logging switches and the base error `CacheLifecycleError`; every
error class is in `cachelife.errors`. Values read through an attribute (`Buffers`, `PinSpec`) and the machinery
behind `enable` (`runtime_of`, `pin_for_model`, `release_pool`, ...) stay in their modules. `decode` left as
well: it is `generate(model, **inputs, fallback=False)` narrowed to greedy search and plain sampling, refusing a
generation config with logits processors; a preset, not a task of its own. A name that left the top level in
0.2 still resolves until 0.3, with a `DeprecationWarning` naming its new home (docs/changes.md lists them).
"""

import importlib as _importlib
import warnings as _warnings

from cachelife.core.cache_lifecycle import CacheLifecycle, lifecycle
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
from cachelife.core.pinning import prepare_static_cache
from cachelife.core.pool import CachePool
from cachelife.core.shapes import CacheShapes, DeclaresCacheShapes, LayerShape, model_cache_shapes
from cachelife.errors import CacheLifecycleError
from cachelife.generation.api import generate
from cachelife.integration.compile_cache import pinned_compile_cache
from cachelife.integration.compiled import FAST_KERNELS, compile_forward, restore_forward
from cachelife.integration.enabling import CacheLifecycleMixin, disable, enable, is_enabled, pool_of, release
from cachelife.integration.options import EXACT, FAST, Options
from cachelife.integration.runtime import Released
from cachelife.integration.warm_start import (
    CompileArtifactsHeader,
    load_compile_artifacts,
    read_compile_artifacts_header,
    save_compile_artifacts,
)
from cachelife.log import configure_from_environment as _configure_from_environment
from cachelife.log import disable_debug_logging, enable_debug_logging
from cachelife.serving.engine import Engine
from cachelife.serving.stats import EngineStats
from cachelife.version import __version__

__all__ = [
    "EXACT",
    "FAST",
    "FAST_KERNELS",
    "TRANSITIONS",
    "CacheLifecycle",
    "CacheLifecycleError",
    "CacheLifecycleMixin",
    "CachePool",
    "CacheShapes",
    "CompileArtifactsHeader",
    "DeclaresCacheShapes",
    "Engine",
    "EngineStats",
    "FillRecord",
    "Filled",
    "LayerLifecycle",
    "LayerShape",
    "LayerState",
    "NoStorage",
    "Options",
    "Pinned",
    "Released",
    "Unallocated",
    "__version__",
    "compile_forward",
    "disable",
    "disable_debug_logging",
    "enable",
    "enable_debug_logging",
    "generate",
    "is_enabled",
    "lifecycle",
    "load_compile_artifacts",
    "model_cache_shapes",
    "pinned_compile_cache",
    "pool_of",
    "prepare_static_cache",
    "read_compile_artifacts_header",
    "release",
    "restore_forward",
    "save_compile_artifacts",
]

_REMOVED_IN = "0.3"
_ERRORS = "cachelife.errors"
# The names that left the top level in 0.2 -> the module that defines them (docs/changes.md lists them).
_DEPRECATED: dict[str, str] = {
    "CacheShapeError": _ERRORS,
    "CompileArtifactsFormatError": _ERRORS,
    "CompileArtifactsMismatchError": _ERRORS,
    "CompiledRegionError": _ERRORS,
    "EnabledModelPickleError": _ERRORS,
    "EngineClosedError": _ERRORS,
    "IllegalSlotTransitionError": _ERRORS,
    "IllegalTransitionError": _ERRORS,
    "InvalidArgumentError": _ERRORS,
    "InvalidBucketsError": _ERRORS,
    "NoCompileArtifactsError": _ERRORS,
    "QueueFullError": _ERRORS,
    "ReplacedBuffersError": _ERRORS,
    "RequestTimeoutError": _ERRORS,
    "UnmarkedBuffersError": _ERRORS,
    "UnpinnedCacheError": _ERRORS,
    "UnsupportedCacheError": _ERRORS,
    "UnsupportedGenerationError": _ERRORS,
    "Buffers": "cachelife.core.buffers",
    "PinSpec": "cachelife.core.buffers",
    "is_managed_cache": "cachelife.core.cache_lifecycle",
    "pin_for_model": "cachelife.core.pinning",
    "infer_cache_shapes": "cachelife.core.shapes",
    "decode": "cachelife.generation.decode",
    "release_pool": "cachelife.integration.enabling",
    "ModelRuntime": "cachelife.integration.runtime",
    "runtime_of": "cachelife.integration.runtime",
    "configure_from_environment": "cachelife.log",
}
# The public way to do what an old name did, where there is one.
_INSTEAD: dict[str, str] = {
    "decode": "cachelife.generate(model, **inputs, fallback=False)",
    "pin_for_model": "cachelife.prepare_static_cache(model, ...)",
    "infer_cache_shapes": "cachelife.model_cache_shapes(model)",
    "release_pool": "cachelife.pool_of(model).clear()",
}


def __getattr__(name: str) -> object:
    """A name that left the top level in 0.2, with a `DeprecationWarning` naming where it lives now."""
    home = _DEPRECATED.get(name)
    if home is None:
        msg = f"module 'cachelife' has no attribute {name!r}"
        raise AttributeError(msg, name=name)
    instead = f", or use {_INSTEAD[name]}" if name in _INSTEAD else ""
    message = f"cachelife.{name} is deprecated and will be removed in {_REMOVED_IN}; import it from {home}{instead}"
    _warnings.warn(message, DeprecationWarning, stacklevel=2)
    return getattr(_importlib.import_module(home), name)


def __dir__() -> list[str]:
    """The public names, and `errors`, where every error lives."""
    return sorted([*__all__, "errors"])


_configure_from_environment()
