"""A code object of its own for each compiled step function, model and specialization.

dynamo keeps the entries it compiles per code object and, under `fullgraph=True`, raises
`FailOnRecompileLimitHit` once one code object holds `torch._dynamo.config.recompile_limit` entries (8 by
default), counted over every model and every set of generation settings of the process. cachelife's step
functions are the same code for every model, and dynamo specializes them on each call's Python structure
(greedy or sampling, which logits processors, whether scores are recorded, whether prompts are padded), so
a service that met a few models and settings failed on the next one.

Each compiled step gets a copy of its function with a code object of its own (`own_code`), per model and per
`specialization` of its arguments, so that dynamo's limit counts only what one copy varies in: shapes and
numbers (a size that changed is compiled dynamic at the copy's next compilation). A specialization that this
key misses is still guarded by dynamo (a recompilation of that copy), so the key decides how entries are
grouped, never which code runs.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import attrs
import torch

Function = TypeVar("Function", bound=Callable[..., Any])

# How deep `specialization` looks into nested arguments; deeper values count by their type.
_DEPTH = 6


def own_code(function: Function) -> Function:
    """`function` with a copy of its code object: dynamo's compiled entries (and its recompile limit) are
    the copy's own."""
    code = function.__code__.replace()
    copy = types.FunctionType(
        code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    copy.__doc__ = function.__doc__
    return cast("Function", copy)


def specialization(value: object, depth: int = 0) -> object:
    """What dynamo specializes a compiled step on in `value`, as far as it is cheap to read, as a hashable
    key: None, booleans and strings by value; tensors by dtype, device type and dimensions; numbers, modules
    and other objects by type; containers and attrs classes by their items."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, torch.Tensor):
        return (torch.Tensor, value.dtype, value.device.type, value.dim())
    if depth >= _DEPTH or isinstance(value, (int, float, torch.nn.Module)):
        return type(value)
    return (type(value), tuple((label, specialization(item, depth + 1)) for label, item in _items(value)))


def _items(value: object) -> list[tuple[object, object]]:
    """A mapping's, sequence's or attrs instance's items, each with its key, index or field name; else none."""
    if isinstance(value, Mapping):
        return list(value.items())
    if isinstance(value, (tuple, list)):
        return list(enumerate(value))
    if attrs.has(type(value)):
        fields = attrs.fields(cast("type[attrs.AttrsInstance]", type(value)))
        return [(field.name, getattr(value, field.name)) for field in fields]
    return []
