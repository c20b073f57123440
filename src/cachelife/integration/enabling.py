"""Turning cachelife on and off for a model: `enable`, `disable`, `is_enabled`, the buffer pool's settings,
`release` (everything cachelife keeps for a model), and `CacheLifecycleMixin`, which enables every instance of
a model class. What `enable` installs is the decoding guard (`cachelife.integration.guard`); what a model keeps
between calls is its runtime (`cachelife.integration.runtime`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import Any

import attrs
from transformers import PreTrainedModel

from cachelife.core.pool import DEFAULT_BUDGET_BYTES, CachePool
from cachelife.core.shapes import model_cache_shapes
from cachelife.errors import InvalidArgumentError, UnsupportedCacheError
from cachelife.integration.buckets import check_bucketable, check_buckets
from cachelife.integration.guard import DecodingGuard, OnUnpinned, guard_of
from cachelife.integration.options import DEFAULT, EXACT, Options
from cachelife.integration.rewrites import check_rewrites
from cachelife.integration.runtime import Released, existing_runtime
from cachelife.validate import check_int


def enable(
    model: PreTrainedModel,
    *,
    options: Options = DEFAULT,
    on_unpinned: OnUnpinned = "pin",
    pool_bytes: int = DEFAULT_BUDGET_BYTES,
    encoder_buckets: Sequence[int] | None = None,
    fuse_projections: bool | None = None,
    decode_attention: bool | None = None,
    small_linear: bool | None = None,
    compile_regions: bool | None = None,
) -> PreTrainedModel:
    """Guard `model` so that every static cache it decodes with is pinned first; returns the model.

    Idempotent (a second call replaces the settings). `options` (`Options`) are the levers installed on the
    model: `Options()` (the default) fuses projections, `EXACT` turns none on, `FAST` the ones that cut the
    decoding step's kernel time; a change of options releases the model's runtime (`release`). `on_unpinned`
    decides what happens when a cache reaches a forward call unpinned (it was replaced after `generate`
    prepared it, or built by hand): "pin" pins it there and logs a WARNING (the default), "raise" raises
    `UnpinnedCacheError`. `pool_bytes` is the budget of idle pinned buffers kept between `generate` calls so
    that the next call of the same shape decodes at the same addresses (no CUDA-graph re-recording); 0 turns
    the pool off. `encoder_buckets` (encoder-decoder models whose cross-attention honours the encoder mask, see
    `cachelife.integration.buckets`), e.g. `(64, 128, 256, 512)`, pads every encoder output and its attention
    mask to the smallest bucket that fits, so that a few cross-attention cache shapes serve every input length;
    None (the default) pads nothing.
    `fuse_projections`, `decode_attention`, `small_linear` and `compile_regions` are deprecated: each sets the
    `Options` field of its name on `options`, with a `DeprecationWarning` naming the value to pass instead.
    Fails at once, before anything is patched, if an argument is invalid (`InvalidArgumentError`), the model is
    no transformers generation model, its shapes cannot be inferred, the buckets are invalid
    (`InvalidBucketsError`) or unsafe for it, or a lever the options turn on does not fit it (both
    `UnsupportedGenerationError`).
    """
    options = with_deprecated_levers(
        options,
        fuse_projections=fuse_projections,
        decode_attention=decode_attention,
        small_linear=small_linear,
        compile_regions=compile_regions,
    )
    if on_unpinned not in ("pin", "raise"):
        msg = f"on_unpinned must be 'pin' or 'raise', got {on_unpinned!r}"
        raise InvalidArgumentError(msg)
    check_int("pool_bytes", pool_bytes, minimum=0, note="(0 turns the pool off)")
    buckets = None if encoder_buckets is None else check_buckets(encoder_buckets)
    existing = guard_of(model)
    if existing is None:
        if not isinstance(model, PreTrainedModel) or not callable(getattr(model, "generate", None)):
            msg = f"cachelife.enable needs a transformers generation model, got a {type(model).__name__}"
            raise UnsupportedCacheError(msg)
        model_cache_shapes(model)  # fail now, not in the middle of generate
    if buckets is not None:
        check_bucketable(model)
    check_rewrites(model, options)
    if existing is not None:
        existing.on_unpinned = on_unpinned
        existing.pool_bytes = pool_bytes
        existing.encoder_buckets = buckets
        existing.pool(model)
        existing.apply_options(model, options)
        return model
    guard = DecodingGuard(on_unpinned=on_unpinned, pool_bytes=pool_bytes, encoder_buckets=buckets)
    guard.apply_options(model, options)
    guard.install(model)
    guard.pool(model)
    return model


def with_deprecated_levers(options: object, **levers: bool | None) -> Options:
    """`options` (checked to be an `Options`) with the levers `enable` was given as deprecated keywords (those
    not None), and a `DeprecationWarning` at the caller of `enable` naming the value to pass instead."""
    if not isinstance(options, Options):
        msg = f"options must be a cachelife.Options (Options(), cachelife.EXACT, cachelife.FAST), got {options!r:.80}"
        raise InvalidArgumentError(msg)
    given: dict[str, Any] = {name: value for name, value in levers.items() if value is not None}
    if not given:
        return options
    combined = attrs.evolve(options, **given)
    keywords = ", ".join(f"{name}={value!r}" for name, value in given.items())
    message = (
        f"cachelife.enable(model, {keywords}) is deprecated and will be removed in 0.3: "
        f"pass options=cachelife.{combined!r}"
    )
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    return combined


def options_of(model: object) -> Options:
    """The options an enabled model was enabled with; `EXACT` for a model that is not enabled."""
    guard = guard_of(model)
    return EXACT if guard is None else guard.options


def pool_of(model: object) -> CachePool | None:
    """The buffer pool of an enabled model (None if cachelife is off for it or its pool is off)."""
    guard = guard_of(model)
    if guard is None or not isinstance(model, PreTrainedModel):
        return None
    return guard.pool(model)


def release_pool(model: object) -> None:
    """Drop the idle pinned buffers an enabled model keeps between `generate` calls (`release` frees the rest)."""
    pool = pool_of(model)
    if pool is not None:
        pool.clear()


def release(model: object) -> Released:
    """Free everything cachelife keeps for `model` between calls: idle pooled cache buffers, the fast loop's
    state buffers, captured CUDA graphs and their memory pool, compiled steps and once-per-model warnings.
    Returns what was freed. Waits for a call decoding on the model in another thread; the model stays
    enabled (or not) and the next call builds what it needs again. Caches a caller holds are the caller's."""
    runtime = existing_runtime(model)
    return Released(pool_bytes=0, state_bytes=0, graphs=0, compiled_steps=0) if runtime is None else runtime.release()


def disable(model: PreTrainedModel) -> PreTrainedModel:
    """Undo `enable`: remove the hooks, restore every patched attribute exactly, and `release` the model's
    runtime state. Idempotent."""
    guard = guard_of(model)
    if guard is not None:
        runtime = existing_runtime(model)
        with runtime.lock if runtime is not None else contextlib.nullcontext():
            guard.uninstall(model)
            release(model)
    return model


def is_enabled(model: object) -> bool:
    """Whether `enable` (or `CacheLifecycleMixin`) guards this model."""
    return guard_of(model) is not None


class CacheLifecycleMixin:
    """Mix into a transformers model class, before its `PreTrainedModel` base, to enable cachelife on every
    instance (`enable(self)` at the end of `__init__`, so `from_pretrained` models are guarded too; there
    `__init__` runs before the weights are loaded, on the meta device, so `from_pretrained` applies the options'
    rewrites again once they are: fused projections fuse the loaded weights).

    Override `cachelife_cache_shapes()` (the `DeclaresCacheShapes` extension point) when the model's cache
    shapes do not follow its config family's rule.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self, PreTrainedModel):
            msg = f"CacheLifecycleMixin must be mixed into a transformers PreTrainedModel, not {type(self).__name__}"
            raise UnsupportedCacheError(msg)
        enable(self)

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """transformers' `from_pretrained`, then the enabled model's rewrites applied again to the loaded weights."""
        model = super().from_pretrained(*args, **kwargs)  # type: ignore[misc]  # the PreTrainedModel mixed into
        guard = guard_of(model)
        if guard is not None:
            guard.reapply(model)
        return model
