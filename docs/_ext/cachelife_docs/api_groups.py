"""The API page's groups: every name of `cachelife.__all__` under the task it serves.

A plain table without Sphinx, so that tests/tools/test_api_reference.py can check it: every public name is
listed by name in exactly one group. A public name no group lists yet (a branch that adds one) still lands
somewhere sensible, by the module that defines it (`Group.modules`, the longest prefix wins), or under
`UNPLACED` at the end of the page, so the site builds while the test asks for its place.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

from attrs import frozen

import cachelife


@frozen
class Group:
    """One section of the API page."""

    title: str
    # reST, shown under the title.
    intro: str
    # Public names, in the order the page shows them.
    names: tuple[str, ...]
    # Defining modules whose public names land here while no group lists them by name.
    modules: tuple[str, ...] = ()
    # A module whose every other exception class the section documents under its own dotted name.
    members_of: str | None = None


GROUPS: tuple[Group, ...] = (
    Group(
        "Enable a model",
        "`enable` guards a model so that its `generate` (compiled with `compile_forward`, or by transformers' "
        "auto-compile) decodes only with pinned caches; `disable` restores it exactly. `Options` are the levers it "
        "installs (`Options()`, the default, fuses projections; `EXACT` turns every lever off; `FAST` the fast "
        "set). `pool_of` shows the "
        "buffers an enabled model keeps between calls, and `release` frees everything cachelife keeps for it. "
        "See :doc:`guide`.",
        (
            "enable", "Options", "EXACT", "FAST", "disable", "is_enabled", "compile_forward", "restore_forward",
            "pool_of", "CachePool", "release", "Released",
        ),
        ("cachelife.integration",),
    ),
    Group(
        "Generate",
        "`generate` takes what `model.generate` takes and returns what it returns, decoded by one compiled, "
        "graph-captured step. See :doc:`generate`.",
        ("generate", "FAST_KERNELS"),
        ("cachelife.generation", "cachelife.kernels"),
    ),
    Group(
        "Serve many requests",
        "`Engine` batches concurrent requests on one model into replays of one captured graph; `Engine.stats()` "
        "returns an `EngineStats` snapshot. A service meets :exc:`cachelife.errors.QueueFullError` (retry later), "
        ":exc:`cachelife.errors.RequestTimeoutError` and :exc:`cachelife.errors.EngineClosedError`. "
        "See :doc:`serving` and :doc:`ray_serve`.",
        ("Engine", "EngineStats"),
        ("cachelife.serving",),
    ),
    Group(
        "The lifecycle",
        "`prepare_static_cache` builds a cache whose every layer is pinned, for a loop of your own; "
        "`lifecycle(cache)` shows and drives the states of any static cache. See :doc:`lifecycle`.",
        (
            "prepare_static_cache", "lifecycle", "CacheLifecycle", "LayerLifecycle", "LayerState", "Unallocated",
            "Pinned", "Filled", "NoStorage", "FillRecord", "TRANSITIONS",
        ),
        ("cachelife.core",),
    ),
    Group(
        "For model authors",
        "Ship cachelife with a model class, and declare its cache shapes where inference from the config does "
        "not fit. See :doc:`model-authors`.",
        ("CacheLifecycleMixin", "DeclaresCacheShapes", "CacheShapes", "LayerShape", "model_cache_shapes"),
        ("cachelife.core.shapes",),
    ),
    Group(
        "Warm starts and the compile cache",
        "Carry compiled graphs to another process, and compile a loop of your own in cachelife's compile-cache "
        "namespace. See :doc:`guide`, sections *Warm starts* and *The compile-cache namespace*.",
        (
            "save_compile_artifacts", "load_compile_artifacts", "read_compile_artifacts_header",
            "CompileArtifactsHeader", "pinned_compile_cache",
        ),
        ("cachelife.integration.warm_start", "cachelife.integration.compile_cache"),
    ),
    Group(
        "Debugging",
        "cachelife logs under the `cachelife` logger and installs no handler unless asked (or `CACHELIFE_LOG` is "
        "set). See :doc:`debugging`.",
        ("enable_debug_logging", "disable_debug_logging", "__version__"),
        ("cachelife.log", "cachelife.version"),
    ),
    Group(
        "Errors",
        "Every error cachelife raises is a `CacheLifecycleError` and also the builtin a caller would expect "
        "(a `ValueError`, `TypeError`, `RuntimeError` or `TimeoutError`). The base stays at the top level; "
        "every other error is imported from `cachelife.errors`.",
        ("CacheLifecycleError",),
        ("cachelife.errors",),
        members_of="cachelife.errors",
    ),
)  # fmt: skip

UNPLACED = "Not yet placed"


def defining_module(value: object) -> str | None:
    """The module that defines a class or function, or the class of a value (a preset's class); None for a
    value of a builtin type (a dict, a str)."""
    if inspect.isclass(value) or inspect.isfunction(value):
        return value.__module__
    module = type(value).__module__
    return module if module.split(".")[0] == "cachelife" else None


def _group_by_module(module: str | None) -> str:
    matches = [
        (len(prefix), group.title)
        for group in GROUPS
        for prefix in group.modules
        if module is not None and (module == prefix or module.startswith(prefix + "."))
    ]
    return max(matches)[1] if matches else UNPLACED


def placement(
    names: Sequence[str] = tuple(cachelife.__all__), value_of: Callable[[str], object] = cachelife.__dict__.get
) -> dict[str, list[str]]:
    """Group title -> the public names it shows, in the order of `GROUPS` (then `UNPLACED`, if any): the names
    a group lists, in its order, then the others that land in it by their defining module."""
    listed = {name: group.title for group in GROUPS for name in group.names}
    found: dict[str, list[str]] = {group.title: [name for name in group.names if name in names] for group in GROUPS}
    for name in names:
        if name not in listed:
            found.setdefault(_group_by_module(defining_module(value_of(name))), []).append(name)
    return {title: shown for title, shown in found.items() if shown}
