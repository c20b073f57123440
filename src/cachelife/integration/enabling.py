"""Turning cachelife on and off for a model: `enable`, `disable`, `is_enabled`, the buffer pool's settings,
`release` (everything cachelife keeps for a model), and `CacheLifecycleMixin`, which enables every instance of
a model class. What `enable` installs is the decoding guard (`cachelife.integration.guard`); what a model keeps
between calls is its runtime (`cachelife.integration.runtime`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedModel

from cachelife.core.pool import DEFAULT_BUDGET_BYTES, CachePool
from cachelife.core.shapes import model_cache_shapes
from cachelife.errors import InvalidArgumentError, UnsupportedCacheError
from cachelife.integration.buckets import check_bucketable, check_buckets
from cachelife.integration.guard import DecodingGuard, OnUnpinned, guard_of
from cachelife.integration.runtime import Released, existing_runtime
from cachelife.model_rewrites.decode_attention import check_decode_attention
from cachelife.validate import check_bool, check_int


def enable(
    model: PreTrainedModel,
    *,
    on_unpinned: OnUnpinned = "pin",
    pool_bytes: int = DEFAULT_BUDGET_BYTES,
    encoder_buckets: Sequence[int] | None = None,
    fuse_projections: bool = False,
    decode_attention: bool = False,
    small_linear: bool = False,
    compile_regions: bool = False,
) -> PreTrainedModel:
    """Guard `model` so that every static cache it decodes with is pinned first; returns the model.

    Idempotent (a second call updates the settings). `on_unpinned` decides what happens when a cache
    reaches a forward call unpinned (it was replaced after `generate` prepared it, or built by hand): "pin"
    pins it there and logs a WARNING (the default), "raise" raises `UnpinnedCacheError`. `pool_bytes` is the
    budget of idle pinned buffers kept between `generate` calls so that the next call of the same shape
    decodes at the same addresses (no CUDA-graph re-recording); 0 turns the pool off. `encoder_buckets`
    (encoder-decoder models whose cross-attention honours the encoder mask, see `cachelife.integration.buckets`), e.g.
    `(64, 128, 256, 512)`, pads every encoder output and its attention mask to the smallest bucket that fits,
    so that a few cross-attention cache shapes serve every input length; None (the default) pads nothing.
    `fuse_projections=True` computes each layer's self-attention query, key and value, and a gated MLP's gate
    and up projections, as one matrix product (`cachelife.model_rewrites.fused_projections`: the weights are
    concatenated once, here, and the parameters become views of them, so memory stays as it was but for zeros
    standing in for a missing bias); `disable`, or a later `enable` without it, restores the projections exactly.
    `decode_attention=True` sets cachelife's split-KV attention kernel for one query as the attention
    implementation of every config the model holds, for self- and cross-attention
    (`cachelife.model_rewrites.decode_attention`; transformers' SDPA for prompts); `disable`, or a later
    `enable` without it, gives each config its previous implementation back. `small_linear=True` runs every
    decoding step's linear products of at most 16 rows (a step's batch) through cachelife's Triton kernel for
    few rows (`cachelife.kernels.linear`; torch's product where Triton does not run); nothing in the model
    changes. `compile_regions=True` marks every layer of the model's stacks of identical layers as a compile
    region (`cachelife.model_rewrites.layer_regions`), so that a compiled step compiles one layer's code and calls it
    for every layer: a shorter first call; `disable`, or a later `enable` without it, restores the layers.
    Changing any of the four releases the model's runtime (`release`). Fails at once, before anything
    is patched, if an argument is invalid (`InvalidArgumentError`), the model is no transformers generation
    model, its shapes cannot be inferred, the buckets are invalid (`InvalidBucketsError`) or unsafe for it, or
    `decode_attention=True` and a part of the model computes attention outside transformers' attention
    interface (both `UnsupportedGenerationError`).
    """
    if on_unpinned not in ("pin", "raise"):
        msg = f"on_unpinned must be 'pin' or 'raise', got {on_unpinned!r}"
        raise InvalidArgumentError(msg)
    check_int("pool_bytes", pool_bytes, minimum=0, note="(0 turns the pool off)")
    check_bool("fuse_projections", fuse_projections)
    check_bool("decode_attention", decode_attention)
    check_bool("small_linear", small_linear)
    check_bool("compile_regions", compile_regions)
    buckets = None if encoder_buckets is None else check_buckets(encoder_buckets)
    existing = guard_of(model)
    if existing is None:
        if not isinstance(model, PreTrainedModel) or not callable(getattr(model, "generate", None)):
            msg = f"cachelife.enable needs a transformers generation model, got a {type(model).__name__}"
            raise UnsupportedCacheError(msg)
        model_cache_shapes(model)  # fail now, not in the middle of generate
    if buckets is not None:
        check_bucketable(model)
    if decode_attention:
        check_decode_attention(model)
    if existing is not None:
        existing.on_unpinned = on_unpinned
        existing.pool_bytes = pool_bytes
        existing.encoder_buckets = buckets
        existing.fuse_projections = fuse_projections
        existing.decode_attention = decode_attention
        existing.small_linear = small_linear
        existing.compile_regions = compile_regions
        existing.pool(model)
        existing.apply_kernels(model)
        return model
    guard = DecodingGuard(
        on_unpinned=on_unpinned, pool_bytes=pool_bytes, encoder_buckets=buckets, fuse_projections=fuse_projections,
        decode_attention=decode_attention, small_linear=small_linear, compile_regions=compile_regions,
    )  # fmt: skip
    guard.apply_kernels(model)
    guard.install(model)
    guard.pool(model)
    return model


def small_linear_of(model: object) -> bool:
    """Whether the model is enabled with `small_linear=True`."""
    guard = guard_of(model)
    return guard is not None and guard.small_linear


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
    return Released(0, 0, 0, 0) if runtime is None else runtime.release()


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
    instance (`enable(self)` at the end of `__init__`, so `from_pretrained` models are guarded too).

    Override `cachelife_cache_shapes()` (the `DeclaresCacheShapes` extension point) when the model's cache
    shapes do not follow its config family's rule.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self, PreTrainedModel):
            msg = f"CacheLifecycleMixin must be mixed into a transformers PreTrainedModel, not {type(self).__name__}"
            raise UnsupportedCacheError(msg)
        enable(self)
