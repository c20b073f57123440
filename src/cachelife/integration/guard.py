"""The decoding guard: what `cachelife.enable` installs on a model, around `generate` and every forward call.

The invariant: every layer of every static cache a model decodes with, self-attention and
cross-attention, is pinned before the model's first forward call with that cache. The guard establishes it
at two places and checks it at a third:

1. after `_prepare_cache_for_generation` (the model's own override included), where `generate` has its
   cache: every layer is pinned there, outside any compiled region;
2. at the decoding boundary, eagerly before each forward call (a forward pre-hook for a compiled
   `model.forward`, and a wrapper around transformers' auto-compiled call): a cache that reached it
   unpinned (replaced after preparation, or built by hand) is pinned there and a WARNING is logged, or,
   with `on_unpinned="raise"`, refused with `UnpinnedCacheError`; a cache that does not fit the call is
   refused with `CacheShapeError` (`cachelife.core.fit`);
3. after each forward call, content is recorded (`Pinned -> Filled`) without reading any tensor.

With encoder buckets, the encoder output and its attention mask are padded to a bucket length
(`cachelife.integration.buckets`) on the way into `_prepare_cache_for_generation`, so that the cross-attention cache is
pinned, and decoding compiled, at the bucket length.

All of this runs in eager Python around compiled code, never inside it: the hooks return at once while
dynamo traces, so they add no graph break, recompilation or host-device synchronisation.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal, NoReturn, SupportsIndex, TypeAlias

import torch
from attrs import define, field
from transformers import GenerationConfig, PreTrainedModel

from cachelife.core import reorder
from cachelife.core.cache_lifecycle import CacheLifecycle, ManagedCache, is_managed_cache, lifecycle
from cachelife.core.fit import check_encoder_fits
from cachelife.core.layer_lifecycle import FillRecord, Pinned
from cachelife.core.pinning import pin_for_model
from cachelife.core.pool import CachePool
from cachelife.core.tracing import tracing_here
from cachelife.errors import EnabledModelPickleError
from cachelife.integration import call_arguments
from cachelife.integration.buckets import Buckets, pad_generation_kwargs
from cachelife.integration.call_fit import check_call_fits
from cachelife.integration.compile_cache import pinned_compile_cache
from cachelife.integration.compiled import is_compiled
from cachelife.integration.options import EXACT, Options
from cachelife.integration.replaced import ReplacedTensors
from cachelife.integration.rewrites import REWRITES, Restore
from cachelife.integration.runtime import collecting_after_compilation, runtime_of
from cachelife.integration.skips import SkipReporter

logger = logging.getLogger(__name__)

OnUnpinned: TypeAlias = Literal["pin", "raise"]

# Instance attributes the guard sets; `uninstall` restores each exactly.
_PATCHED = ("generate", "_prepare_cache_for_generation", "get_compiled_call")
_GUARD_ATTRIBUTE = "_cachelife_guard"


@define(eq=False, kw_only=True)
class DecodingGuard:
    """What `enable` installs on one model: two forward hooks and three wrapped methods, and the model rewrites
    its `options` turn on (`cachelife.integration.rewrites`), each held with its restore. It holds the model's
    settings; the model's buffers, graphs and pool belong to its runtime (`cachelife.integration.runtime`).

    A deep copy of the model gets a guard of its own (same settings, hooks and wrapped methods of the copy, its
    rewrites restoring the copy, a fresh runtime); pickling an enabled model raises `EnabledModelPickleError`."""

    on_unpinned: OnUnpinned
    pool_bytes: int
    encoder_buckets: Buckets | None = None
    # The options the model's rewrites and runtime follow; only `apply_options` changes them.
    _options: Options = field(default=EXACT, init=False)
    # Option name -> the restore of its rewrite, for every rewrite applied to the model, in the order applied.
    _restores: dict[str, Restore] = field(factory=dict, init=False)
    _skips: SkipReporter = field(factory=SkipReporter, alias="skips")
    _replaced: ReplacedTensors = field(factory=ReplacedTensors, alias="replaced")
    _hooks: list[torch.utils.hooks.RemovableHandle] = field(factory=list, alias="hooks")
    # Attribute name -> the instance attribute that was there before (absent if the class provided it).
    _saved: dict[str, Any] = field(factory=dict, alias="saved")

    @property
    def options(self) -> Options:
        return self._options

    def pool(self, model: PreTrainedModel) -> CachePool | None:
        """The model's pool of idle pinned buffers under this guard's budget (None with `pool_bytes=0`)."""
        return runtime_of(model).pool_for(self.pool_bytes)

    def install(self, model: PreTrainedModel) -> None:
        self._saved = {name: model.__dict__[name] for name in _PATCHED if name in model.__dict__}
        for name in _PATCHED:
            model.__dict__[name] = GuardedMethod(guard=self, model=model, name=name, original=getattr(model, name))
        self._hooks = [
            model.register_forward_pre_hook(self.before_forward, with_kwargs=True),
            model.register_forward_hook(self.after_forward, with_kwargs=True),
        ]
        model.__dict__[_GUARD_ATTRIBUTE] = self

    def apply_options(self, model: PreTrainedModel, options: Options) -> None:
        """Make `options` the model's, keeping the rewrites applied in the order of `REWRITES` (a later rewrite
        may build on an earlier one's modules): from the first rewrite whose lever changes on, undo those applied
        (newest first), then apply those `options` turn on. Any change of the options releases the model's
        runtime: its captured graphs and compiled steps read the weights where they were, call the attention they
        were traced with, run their products as they were traced, were compiled with the layers as they were and
        with the inductor options they were. Callers check the rewrites first (`check_rewrites`)."""
        if options == self._options:
            return
        runtime = runtime_of(model)
        with runtime.lock:
            try:
                changed = [rewrite.wanted(options) != (rewrite.option in self._restores) for rewrite in REWRITES]
                affected = REWRITES[changed.index(True) :] if True in changed else ()
                for rewrite in reversed(affected):
                    if rewrite.option in self._restores:
                        self._restores.pop(rewrite.option)()
                for rewrite in affected:
                    if rewrite.wanted(options):
                        self._restores[rewrite.option] = rewrite.apply(model)
                self._options = options
            finally:
                runtime.release()

    def reapply(self, model: PreTrainedModel) -> None:
        """Undo every rewrite and apply the options' rewrites again, so that they see the model's parameters as
        they are now (loaded after `enable`: `CacheLifecycleMixin`), and release the model's runtime."""
        options = self._options
        with runtime_of(model).lock:
            self.restore_all()
            self.apply_options(model, options)

    def restore_all(self) -> None:
        """Undo every rewrite applied, newest first."""
        while self._restores:
            self._restores.popitem()[1]()
        self._options = EXACT

    def uninstall(self, model: PreTrainedModel) -> None:
        self.restore_all()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for name in _PATCHED:
            if name in self._saved:
                model.__dict__[name] = self._saved[name]
            else:
                model.__dict__.pop(name, None)
        model.__dict__.pop(_GUARD_ATTRIBUTE, None)

    def __deepcopy__(self, memo: dict[int, Any]) -> DecodingGuard:
        # `copy.deepcopy(model)` reaches the guard through the model's __dict__, its hooks and its wrapped
        # methods; every one of them gets this twin, whose hooks and saved attributes are the copy's own.
        twin = DecodingGuard(
            on_unpinned=self.on_unpinned, pool_bytes=self.pool_bytes, encoder_buckets=self.encoder_buckets
        )
        memo[id(self)] = twin
        twin._options = self._options
        # Each restore is a bound method: its deep copy is bound to the copy of what it restores (the copy's
        # parameters, configs, layers).
        twin._restores = copy.deepcopy(self._restores, memo)
        twin._hooks = copy.deepcopy(self._hooks, memo)
        twin._saved = copy.deepcopy(self._saved, memo)
        return twin

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise_enabled_model_pickle()

    def around_generate(self, model: PreTrainedModel, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`generate`: one call at a time per model, inside cachelife's compile-cache namespace."""
        with runtime_of(model).lock, collecting_after_compilation(), pinned_compile_cache():
            return original(*args, **kwargs)

    def around_prepare_cache_for_generation(
        self, model: PreTrainedModel, original: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        arguments = inspect.signature(original).bind(*args, **kwargs).arguments
        self.before_cache_preparation(arguments)
        result = original(*args, **kwargs)
        self.after_cache_preparation(model, arguments)
        return result

    def around_get_compiled_call(
        self, model: PreTrainedModel, original: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        return self.guard_compiled_call(model, original(*args, **kwargs))

    # 0. where generate has run the encoder (and expanded its output for beams) but built no cache yet
    def before_cache_preparation(self, arguments: Mapping[str, Any]) -> None:
        """Pad the encoder output and mask to their bucket, so the cache is built and pinned at that length."""
        model_kwargs = arguments.get("model_kwargs")
        if self.encoder_buckets is not None and isinstance(model_kwargs, dict):
            pad_generation_kwargs(model_kwargs, self.encoder_buckets)

    # 1. where generate has built (or been handed) its cache
    def after_cache_preparation(self, model: PreTrainedModel, arguments: Mapping[str, Any]) -> None:
        model_kwargs = arguments.get("model_kwargs")
        generation_config = arguments.get("generation_config")
        batch_size = arguments.get("batch_size")
        if not isinstance(model_kwargs, dict) or not isinstance(batch_size, int):
            return
        cache = call_arguments.find_cache(model_kwargs)
        if not is_managed_cache(cache):
            return
        if isinstance(generation_config, GenerationConfig):
            batch_size *= max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        encoder_length = call_arguments.encoder_length(model_kwargs)
        state = pin_for_model(cache, model, batch_size=batch_size, encoder_length=encoder_length, pool=self.pool(model))
        if isinstance(generation_config, GenerationConfig) and (generation_config.num_beams or 1) > 1:
            # generate expanded the encoder output per beam: every beam of one input gets the same
            # cross-attention rows, which a beam reorder never needs to move (see cachelife.core.reorder).
            for layer in state.cross_attention:
                if isinstance(layer.state, Pinned):
                    reorder.share_rows_within_beams(layer.layer)

    # 2. the decoding boundary
    def before_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if tracing_here():
            return
        cache = call_arguments.find_cache(kwargs)
        if not is_managed_cache(cache):
            return
        state = lifecycle(cache)
        if state.is_filled:  # steady-state decoding: a memoised verdict and one identity check per layer
            self.check_replaced(module, state)
            return
        check_encoder_fits(state.cross_attention, call_arguments.encoder_length(kwargs))
        if not state.is_pinned:
            self.pin_late(module, cache, state, kwargs)
        self.check_replaced(module, state)
        if isinstance(module, PreTrainedModel):
            check_call_fits(state, module, kwargs)

    def check_replaced(self, module: torch.nn.Module, state: CacheLifecycle) -> None:
        """Pinned layers holding replaced tensors: restored and warned about, or refused (`replaced`)."""
        self._replaced.restore_or_refuse(type(module).__name__, state, refuse=self.on_unpinned == "raise")

    def pin_late(
        self, module: torch.nn.Module, cache: ManagedCache, state: CacheLifecycle, kwargs: Mapping[str, Any]
    ) -> None:
        """A cache reached the forward call unpinned: pin it there and warn, or refuse it."""
        batch_size = call_arguments.batch_size(kwargs)
        if self.on_unpinned == "raise" or not isinstance(module, PreTrainedModel) or batch_size is None:
            state.require_pinned()
            return
        late = ", ".join(layer.describe() for layer in state.unpinned())
        pin_for_model(
            cache,
            module,
            batch_size=batch_size,
            encoder_length=call_arguments.encoder_length(kwargs),
            pool=self.pool(module),
        )
        logger.warning(
            "cache layers reached %s's forward unpinned and were pinned there: %s. Pin caches ahead "
            "(cachelife.prepare_static_cache, or leave cache preparation to generate); pass "
            "on_unpinned='raise' to cachelife.enable to make this an error.",
            type(module).__name__,
            late,
        )

    # 3. after the forward call
    def after_forward(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if tracing_here():
            return
        compiled = is_compiled(getattr(module, "forward", None))
        self.record_content(kwargs, compiled=compiled)
        if compiled:
            self.report_cudagraph_skips(module)

    def record_content(self, kwargs: Mapping[str, Any], *, compiled: bool) -> None:
        cache = call_arguments.find_cache(kwargs)
        if not is_managed_cache(cache):
            return
        state = lifecycle(cache)
        if state.is_filled:
            return
        state.fill(FillRecord("forward", call_arguments.query_length(kwargs), compiled), cross=False)
        for layer in state.cross_attention:
            if layer.cross_content_written:
                layer.fill(FillRecord("forward", call_arguments.encoder_length(kwargs), compiled))

    def report_cudagraph_skips(self, module: torch.nn.Module) -> None:
        self._skips.report(type(module).__name__, caches_hold_pinned_tensors=not self._replaced.seen)

    def guard_compiled_call(self, model: PreTrainedModel, compiled: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap transformers' auto-compiled `__call__` so the boundary checks run eagerly around it."""
        if not is_compiled(compiled):  # e.g. models transformers never compiles
            return compiled

        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.before_forward(model, args, kwargs)
            output = compiled(*args, **kwargs)
            self.record_content(kwargs, compiled=True)
            self.report_cudagraph_skips(model)
            return output

        return guarded


def raise_enabled_model_pickle() -> NoReturn:
    msg = (
        "cannot pickle a model that cachelife.enable guards (torch.save(model), pickle.dumps(model)): its "
        "guard holds hooks and runtime state that are not data. Call cachelife.disable(model) first (and "
        "enable it again after loading), or save model.state_dict(); copy.deepcopy(model) works as it is."
    )
    raise EnabledModelPickleError(msg)


@define(eq=False, kw_only=True)
class GuardedMethod:
    """One method of an enabled model, wrapped by its guard: an object rather than a closure, so that a deep
    copy of the model wraps the copy's own method (a closure would keep calling the original model's)."""

    guard: DecodingGuard
    model: PreTrainedModel
    name: str
    original: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _AROUND[self.name](self.guard, self.model, self.original, *args, **kwargs)

    @property
    def __wrapped__(self) -> Callable[..., Any]:  # inspect.signature and help() show the original's
        return self.original

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]  # the original's docstring, read on demand
        return self.original.__doc__

    def __deepcopy__(self, memo: dict[int, Any]) -> GuardedMethod:
        return GuardedMethod(
            guard=copy.deepcopy(self.guard, memo),
            model=copy.deepcopy(self.model, memo),
            name=self.name,
            original=copy.deepcopy(self.original, memo),
        )

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise_enabled_model_pickle()


# What each wrapped method runs, by the method's name.
_AROUND: dict[str, Callable[..., Any]] = {
    "generate": DecodingGuard.around_generate,
    "_prepare_cache_for_generation": DecodingGuard.around_prepare_cache_for_generation,
    "get_compiled_call": DecodingGuard.around_get_compiled_call,
}


def guard_of(model: object) -> DecodingGuard | None:
    """The guard installed on `model`, or None when cachelife is not enabled for it."""
    guard = getattr(model, "__dict__", {}).get(_GUARD_ATTRIBUTE)
    return guard if isinstance(guard, DecodingGuard) else None
