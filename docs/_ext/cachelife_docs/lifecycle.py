"""The lifecycle page's table and diagram, read from `cachelife.TRANSITIONS` and `cachelife.LayerState`."""

from __future__ import annotations

import inspect
import typing

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

import cachelife
from cachelife_docs import diagram
from cachelife_docs.nodes import Code, preformatted, table


def states() -> list[str]:
    """Every layer state, in the order of the `LayerState` union."""
    return [state.__name__ for state in typing.get_args(cachelife.LayerState)]


def events() -> list[str]:
    """Every event, in the order the table first names it."""
    return list(dict.fromkeys(event for _, event in cachelife.TRANSITIONS))


def transitions() -> dict[tuple[str, str], str]:
    """(state, event) -> next state, by class name."""
    return {(source.__name__, event): target.__name__ for (source, event), target in cachelife.TRANSITIONS.items()}


class _FromTheTable(SphinxDirective):
    def note_source(self) -> None:
        """Rebuild the page when the module that holds the table changes."""
        self.env.note_dependency(inspect.getfile(cachelife.LayerLifecycle))


class TransitionTable(_FromTheTable):
    """A row per state, a column per event: the next state, or a dash where the event raises."""

    def run(self) -> list[nodes.Node]:
        self.note_source()
        found = transitions()
        names = events()
        rows = [
            [Code(state), *(Code(found[state, event]) if (state, event) in found else "-" for event in names)]
            for state in states()
        ]
        return [table(["from \\ event", *(Code(event) for event in names)], rows)]


class StateDiagram(_FromTheTable):
    """The transitions drawn as text (`cachelife_docs.diagram`)."""

    def run(self) -> list[nodes.Node]:
        self.note_source()
        edges = [diagram.Edge(source, event, target) for (source, event), target in transitions().items()]
        return [preformatted(diagram.draw(states(), edges))]
