"""The errors cachelife raises.

Every error is a `CacheLifecycleError` and also the builtin a caller would expect (a shape error is a
`ValueError`, a state error a `RuntimeError`), so existing `except ValueError:` code keeps working. Messages
say what was expected, what was received, and how to fix the common misuse. An error never leaves a cache
half-changed: the operation that raised changed nothing.
"""

from __future__ import annotations


class CacheLifecycleError(Exception):
    """Base class of every error cachelife raises."""


class IllegalTransitionError(CacheLifecycleError, RuntimeError):
    """The layer's current state does not allow the requested transition."""


class CompiledRegionError(CacheLifecycleError, RuntimeError):
    """Buffers would be allocated, marked or dropped while dynamo traces or a CUDA graph is captured."""


class UnpinnedCacheError(CacheLifecycleError, RuntimeError):
    """A layer that must be pinned (before compiled decoding, or by `require_pinned`) is not."""


class UnmarkedBuffersError(CacheLifecycleError, RuntimeError):
    """A layer holds buffers that were never marked static, so CUDA graphs may overwrite them."""


class ReplacedBuffersError(CacheLifecycleError, RuntimeError):
    """A pinned layer's buffers were replaced behind the lifecycle's back (new data pointers)."""


class CacheShapeError(CacheLifecycleError, ValueError):
    """Shapes, sizes, dtypes or devices do not match the model or the cache."""


class UnsupportedCacheError(CacheLifecycleError, TypeError):
    """The cache, or one of its layers, is of a kind cachelife cannot manage."""


class UnsupportedGenerationError(CacheLifecycleError, ValueError):
    """cachelife was asked for generation settings it does not implement (in its decode loop, or encoder-length
    buckets for a model whose cross-attention would not ignore the padding)."""


class InvalidArgumentError(CacheLifecycleError, ValueError, TypeError):
    """An argument of the wrong type, or outside what the function accepts (a count below 1, an unknown
    option, ...); also a `TypeError`, so that either `except` catches it."""


class EnabledModelPickleError(CacheLifecycleError, TypeError):
    """An enabled model was pickled (`torch.save(model)`, `pickle.dumps`): disable it first, or save its
    `state_dict()`."""


class InvalidBucketsError(CacheLifecycleError, ValueError):
    """Encoder-length buckets that are not a non-empty, strictly increasing sequence of positive ints."""


class CompileArtifactsMismatchError(CacheLifecycleError, RuntimeError):
    """Saved compile artifacts come from another torch version or device type than this process has."""


class CompileArtifactsFormatError(CacheLifecycleError, ValueError):
    """A file that is not cachelife's compile artifacts, or whose content is damaged or cut short."""


class NoCompileArtifactsError(CacheLifecycleError, RuntimeError):
    """Compile artifacts were to be saved, but this process has compiled (or loaded from a cache) nothing yet."""


class IllegalSlotTransitionError(CacheLifecycleError, RuntimeError):
    """A row of an engine's batch was asked for a transition its slot state does not allow."""


class QueueFullError(CacheLifecycleError, RuntimeError):
    """An engine holds as many requests as its rows and queue allow: retry later, or make the queue longer."""


class EngineClosedError(CacheLifecycleError, RuntimeError):
    """The engine was closed before (or while) the request was served."""


class RequestTimeoutError(CacheLifecycleError, TimeoutError):
    """A request to an engine was not served within its `timeout`."""
