"""The changes page's table of the names that left the top level, read from the deprecation table in
`cachelife/__init__.py`, so that the page lists exactly what warns."""

from __future__ import annotations

import inspect

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

import cachelife
from cachelife_docs.nodes import Code, table


def deprecations() -> list[tuple[str, str, str]]:
    """(old name, the module it lives in now, the public way to do its job or ""), in the table's order."""
    # The private tables the warnings are written from.
    moved: dict[str, str] = cachelife._DEPRECATED
    instead: dict[str, str] = cachelife._INSTEAD
    return [(name, home, instead.get(name, "")) for name, home in moved.items()]


class Deprecations(SphinxDirective):
    """A row per name that left the top level: where to import it from now, and the public way, if any."""

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(inspect.getfile(cachelife))
        rows = [
            [Code(f"cachelife.{name}"), Code(f"from {home} import {name}"), Code(instead) if instead else ""]
            for name, home, instead in deprecations()
        ]
        return [table(["deprecated name", "import it from its module", "or use"], rows, classes=["cachelife-wrapped"])]
