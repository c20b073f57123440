"""The API reference's groups (docs/_ext/cachelife_docs/api_groups.py): every public name is listed by exactly one
group, so a name a branch adds to the top level fails here until someone gives it its place on the page.

The table is loaded from its file: the docs extension's package imports Sphinx, which only the docs environment has.
"""

from __future__ import annotations

from collections import Counter

import attrs

import cachelife
from support import docs_module

api_groups = docs_module("api_groups")


def test_every_public_name_is_listed_by_exactly_one_group() -> None:
    listed = Counter(name for group in api_groups.GROUPS for name in group.names)
    unlisted = sorted(set(cachelife.__all__) - set(listed))
    assert unlisted == [], f"give these public names a group in docs/_ext/cachelife_docs/api_groups.py: {unlisted}"
    assert sorted(name for name, count in listed.items() if count > 1) == []
    assert sorted(set(listed) - set(cachelife.__all__)) == []


def test_the_page_shows_every_public_name_once_and_nothing_unplaced() -> None:
    shown = api_groups.placement()
    assert api_groups.UNPLACED not in shown
    assert sorted(name for names in shown.values() for name in names) == sorted(cachelife.__all__)
    assert list(shown) == [group.title for group in api_groups.GROUPS]
    assert shown["Errors"] == ["CacheLifecycleError"]


@attrs.frozen
class Options:
    """A stand-in for a public class a branch adds in the integration layer."""

    exact: bool = True


Options.__module__ = "cachelife.integration.options"


def header_of_a_new_module() -> None:
    """A stand-in for a public function a branch adds next to the warm starts."""


header_of_a_new_module.__module__ = "cachelife.integration.warm_start"


def test_a_new_public_name_lands_by_its_defining_module_until_a_group_lists_it() -> None:
    values: dict[str, object] = {
        "enable": cachelife.enable,
        "Options": Options,
        "EXACT": Options(exact=True),  # a preset: placed by its class's module
        "header_of_a_new_module": header_of_a_new_module,  # the longest module prefix wins
        "LIMITS": {"rows": 8},  # a builtin value says nothing of where it belongs
    }
    shown = api_groups.placement(list(values), values.get)
    assert shown == {
        "Enable a model": ["enable", "Options", "EXACT"],
        "Warm starts and the compile cache": ["header_of_a_new_module"],
        api_groups.UNPLACED: ["LIMITS"],
    }
