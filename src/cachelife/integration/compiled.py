"""Compiled forwards: compiling a model's forward in place, and telling a compiled callable from an eager one.

`compile_forward(model, mode="reduce-overhead", fullgraph=True)` is the recipe `model.forward =
torch.compile(model.forward, ...)`, typed: it installs the compiled forward on the model instance, where an
enabled model's hooks and `generate` find it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from transformers import PreTrainedModel

from cachelife.errors import InvalidArgumentError

# The attribute torch.compile's wrapper carries: the callable it compiles.
_ORIGINAL = "_torchdynamo_orig_callable"

# What torch.compile's `options=` takes.
InductorOptions = dict[str, str | int | bool | Callable[..., Any]]
# The inductor options a user adds to cachelife's compiled steps, as `checked_options` checks them.
CompileOptions = Mapping[str, str | int | bool]


def is_compiled(function: object) -> bool:
    """Whether `function` is a callable returned by `torch.compile`."""
    return getattr(function, _ORIGINAL, None) is not None


def eager_forward(model: PreTrainedModel) -> Callable[..., Any]:
    """The model's forward without compilation: the one a `compile_forward` wraps, else `model.forward`."""
    forward = model.forward
    original = getattr(forward, _ORIGINAL, None)
    return original if callable(original) else forward


def compile_forward(
    model: PreTrainedModel,
    *,
    mode: str | None = None,
    fullgraph: bool = False,
    backend: str | Callable[..., Any] = "inductor",
    dynamic: bool | None = None,
    options: InductorOptions | None = None,
) -> Callable[..., Any]:
    """Compile the model's eager forward with `torch.compile(..., mode=, fullgraph=, backend=, dynamic=)`,
    install it as `model.forward` and return it. Compiling again replaces the earlier compiled forward (it
    does not wrap it); `restore_forward` undoes it. `options` (inductor options) are added to the mode's,
    which torch.compile does not take together: `options={"emulate_precision_casts": True}` rounds at every
    cast as eager does, as `cachelife.generate`'s step does."""
    settings: dict[str, Any] = {"mode": mode} if options is None else {"options": mode_with(mode, options)}
    compiled: Callable[..., Any] = torch.compile(
        eager_forward(model), fullgraph=fullgraph, backend=backend, dynamic=dynamic, **settings
    )
    # What `model.forward = compiled` does (nn.Module.__setattr__ stores a plain callable in the instance
    # dict), without assigning to a method, which type checkers rightly question.
    model.__dict__["forward"] = compiled
    return compiled


def mode_with(mode: str | None, options: Mapping[str, str | int | bool | Callable[..., Any]]) -> InductorOptions:
    """The inductor options of `mode` with `options` added: what `torch.compile(options=...)` takes for both,
    since it refuses a mode and options together."""
    return {**torch._inductor.list_mode_options(mode or "default"), **options}


# Inductor options a decoding loop's step sets itself: CUDA graphs come from `cuda_graphs=`, and casts are
# rounded as eager rounds them so that tokens equal a compiled forward's.
OWNED_OPTIONS = {
    "triton.cudagraphs": "CUDA graphs are chosen with cuda_graphs=",
    "emulate_precision_casts": "the step rounds every cast as eager does, so that its tokens equal a forward's",
}


# The inductor options that cut the decode step's GPU kernel time on an H200 without changing its tokens
# (docs/generate.md), the compile options of `cachelife.FAST`:
# `cachelife.generate(model, compile_options=cachelife.FAST_KERNELS, ...)`.
FAST_KERNELS: Mapping[str, bool] = MappingProxyType({"combo_kernels": True, "coordinate_descent_tuning": True})


def checked_options(options: Mapping[str, object] | None) -> dict[str, str | int | bool]:
    """`options` (a user's inductor options for a compiled step) as `torch.compile(options=)` takes them:
    names `torch._inductor.list_options()` knows, values of str, int or bool, none of `OWNED_OPTIONS`.
    Raises `InvalidArgumentError` naming the first that is not."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        msg = f"compile_options: expected a mapping of inductor option names to values, got {type(options).__name__}"
        raise InvalidArgumentError(msg)
    known = set(torch._inductor.list_options())
    checked: dict[str, str | int | bool] = {}
    for name, value in options.items():
        if name not in known:
            msg = f"compile_options: {name!r} is not an inductor option (torch._inductor.list_options())"
            raise InvalidArgumentError(msg)
        if name in OWNED_OPTIONS:
            msg = f"compile_options: {name!r} is set by cachelife ({OWNED_OPTIONS[name]}), got {value!r}"
            raise InvalidArgumentError(msg)
        if not isinstance(value, str | int | bool):
            msg = f"compile_options: {name!r} takes a str, int or bool here, got {type(value).__name__} {value!r}"
            raise InvalidArgumentError(msg)
        checked[name] = value
    return checked


def restore_forward(model: PreTrainedModel) -> None:
    """Undo `compile_forward`: the model's forward is its class's again."""
    model.__dict__.pop("forward", None)
