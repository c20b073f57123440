"""Checks of plain arguments, written once: is this an int of at least some size, is this a bool?

`bool` is an `int` in Python, but never a count: `True` is refused wherever an int is asked for.
"""

from __future__ import annotations

from typing import TypeGuard

from cachelife.errors import CacheLifecycleError, InvalidArgumentError


def is_int_at_least(value: object, minimum: int) -> TypeGuard[int]:
    """Whether `value` is an int (not a bool) and at least `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_int(
    name: str,
    value: object,
    *,
    minimum: int = 1,
    error: type[CacheLifecycleError] = InvalidArgumentError,
    note: str = "",
) -> int:
    """`value` if it is an int (not a bool) of at least `minimum`, else `error` naming `name` and the value.

    `note` (e.g. "(0 turns the pool off)") follows the requirement in the message.
    """
    if is_int_at_least(value, minimum):
        return value
    wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    msg = f"{name} must be {wanted}{' ' + note if note else ''}, got {value!r}"
    raise error(msg)


def check_bool(name: str, value: object) -> bool:
    """`value` if it is a bool, else `InvalidArgumentError` naming `name` and the value."""
    if isinstance(value, bool):
        return value
    msg = f"{name} must be True or False, got {value!r}"
    raise InvalidArgumentError(msg)


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """`value` if it is one of `choices`, else `InvalidArgumentError` naming them."""
    if isinstance(value, str) and value in choices:
        return value
    msg = f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
    raise InvalidArgumentError(msg)
