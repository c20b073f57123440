"""The API page: autodoc directives for every name in `cachelife.__all__`, grouped by task (`api_groups`), and
every error of `cachelife.errors`."""

from __future__ import annotations

import importlib
import inspect

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

import cachelife
from cachelife_docs import api_groups
from cachelife_docs.api_groups import GROUPS, placement

UNPLACED_INTRO = "Public names that no group of ``docs/_ext/cachelife_docs/api_groups.py`` lists yet."
# Values too long to show in full are named only.
LONGEST_VALUE = 120
# Constants carry no docstring of their own; the page says what they are.
NOTES = {
    "TRANSITIONS": "The legal transitions of a layer, (state class, event) -> next state class: see :doc:`lifecycle`.",
    "FAST_KERNELS": "Inductor options for ``cachelife.generate(..., compile_options=cachelife.FAST_KERNELS)``: "
    "see :doc:`performance`.",
    "EXACT": "``cachelife.Options`` with every lever off (the default fuses projections): the model's own modules.",
    "FAST": "``cachelife.Options`` with fused projections, the decode attention kernel and ``FAST_KERNELS``: "
    "see :doc:`guide`.",
    "__version__": "The installed cachelife version.",
}


def _directive(value: object) -> str:
    if inspect.isclass(value) and issubclass(value, BaseException):
        return "autoexception"
    if inspect.isclass(value):
        return "autoclass"
    if callable(value):
        return "autofunction"
    return "autodata"


def drop_type_docstrings(  # noqa: PLR0917 - the signature autodoc calls its hooks with
    app: object, what: str, name: str, obj: object, options: object, lines: list[str]
) -> None:
    """autodoc's `autodoc-process-docstring` hook: a constant (a dict, a str) has no docstring of its own, and
    its type's (`dict()` -> new empty dictionary...) says nothing about it."""
    if what in ("data", "attribute") and lines and inspect.getdoc(obj) == inspect.getdoc(type(obj)):
        lines.clear()


class PublicApi(SphinxDirective):
    """Every public name, documented from its docstring, under the task it serves."""

    def run(self) -> list[nodes.Node]:
        groups = {group.title: group for group in GROUPS}
        lines: list[str] = []
        for title, names in placement().items():
            group = groups.get(title)
            lines += [title, "-" * len(title), "", group.intro if group is not None else UNPLACED_INTRO, ""]
            for name in names:
                value = getattr(cachelife, name)
                self._note_source(value)
                lines += _entry(f"cachelife.{name}", value, NOTES.get(name))
            if group is not None and group.members_of is not None:
                for value in _exceptions_of(group.members_of):
                    self._note_source(value)
                    lines += _entry(f"{group.members_of}.{value.__name__}", value, None)
        self.env.note_dependency(inspect.getfile(cachelife))
        self.env.note_dependency(api_groups.__file__)
        container = nodes.section()
        nested_parse_with_titles(self.state, StringList(lines, source="cachelife.__all__"), container)
        return list(container.children)

    def _note_source(self, value: object) -> None:
        """Rebuild the page when the module that defines a documented class or function changes."""
        if inspect.isclass(value) or inspect.isfunction(value):
            self.env.note_dependency(inspect.getfile(value))


def _entry(dotted: str, value: object, note: str | None) -> list[str]:
    """The autodoc directive for one documented name."""
    kind = _directive(value)
    lines = [f".. {kind}:: {dotted}"]
    if kind == "autoclass":
        lines.append("   :members:")
    if kind == "autodata" and len(repr(value)) > LONGEST_VALUE:
        lines.append("   :no-value:")
    if note:
        lines += ["", f"   {note}"]
    return [*lines, ""]


def _exceptions_of(module: str) -> list[type[BaseException]]:
    """Every exception class `module` defines that is not at the top level, in source order."""
    loaded = importlib.import_module(module)
    found = [
        value
        for name, value in vars(loaded).items()
        if inspect.isclass(value)
        and issubclass(value, BaseException)
        and value.__module__ == module
        and name not in cachelife.__all__
    ]
    return sorted(found, key=lambda value: inspect.getsourcelines(value)[1])
