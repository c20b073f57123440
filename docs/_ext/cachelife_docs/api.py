"""The API page: autodoc directives for every name in `cachelife.__all__`, grouped by the module that defines it."""

from __future__ import annotations

import importlib
import inspect

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

import cachelife

# Modules whose names a user meets first lead the page; every other module follows in name order.
LEADING = (
    "cachelife.integration.enabling",
    "cachelife.generation.api",
    "cachelife.generation.decode",
    "cachelife.core.pinning",
    "cachelife.core.cache_lifecycle",
    "cachelife.core.layer_lifecycle",
)
# Values too long to show in full are named only.
LONGEST_VALUE = 120
# Constants carry no docstring of their own; the page says what they are.
NOTES = {
    "TRANSITIONS": "The legal transitions of a layer, (state class, event) -> next state class: see :doc:`lifecycle`.",
    "FAST_KERNELS": "Inductor options for ``cachelife.generate(..., compile_options=cachelife.FAST_KERNELS)``: "
    "see :doc:`performance`.",
    "EXACT": "The default ``cachelife.Options``: every lever off, tokens equal ``model.generate``'s.",
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


def _module_of(value: object) -> str | None:
    if inspect.isclass(value) or inspect.isfunction(value):
        return value.__module__
    return None


def groups() -> dict[str, list[str]]:
    """Module -> the public names it defines (in `__all__` order): the `LEADING` modules first, then the others
    by name; names that are values rather than classes or functions come last, under "Constants"."""
    found: dict[str, list[str]] = {}
    constants: list[str] = []
    for name in cachelife.__all__:
        module = _module_of(getattr(cachelife, name))
        if module is None:
            constants.append(name)
        else:
            found.setdefault(module, []).append(name)
    first = [module for module in LEADING if module in found]
    ordered = {module: found[module] for module in [*first, *sorted(set(found) - set(first))]}
    if constants:
        ordered["Constants"] = constants
    return ordered


def _summary(module: str) -> str:
    """The first sentence of a module's docstring."""
    doc = inspect.getdoc(importlib.import_module(module)) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def drop_type_docstrings(  # noqa: PLR0917 - the signature autodoc calls its hooks with
    app: object, what: str, name: str, obj: object, options: object, lines: list[str]
) -> None:
    """autodoc's `autodoc-process-docstring` hook: a constant (a dict, a str) has no docstring of its own, and
    its type's (`dict()` -> new empty dictionary...) says nothing about it."""
    if what in ("data", "attribute") and lines and inspect.getdoc(obj) == inspect.getdoc(type(obj)):
        lines.clear()


class PublicApi(SphinxDirective):
    """Every public name, documented from its docstring."""

    def run(self) -> list[nodes.Node]:
        lines: list[str] = []
        for module, names in groups().items():
            title = module if module == "Constants" else f"``{module}``"
            lines += [title, "-" * len(title), ""]
            if module != "Constants":
                self.env.note_dependency(inspect.getfile(getattr(cachelife, names[0])))
                summary = _summary(module)
                if summary:
                    lines += [summary, ""]
            for name in names:
                value = getattr(cachelife, name)
                kind = _directive(value)
                lines.append(f".. {kind}:: cachelife.{name}")
                if kind == "autoclass":
                    lines.append("   :members:")
                if kind == "autodata" and len(repr(value)) > LONGEST_VALUE:
                    lines.append("   :no-value:")
                note = NOTES.get(name)
                if note:
                    lines += ["", f"   {note}"]
                lines.append("")
        container = nodes.section()
        nested_parse_with_titles(self.state, StringList(lines, source="cachelife.__all__"), container)
        return list(container.children)
