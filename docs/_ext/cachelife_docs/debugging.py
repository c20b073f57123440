"""The debugging page's table of CUDA-graph skip reasons and their fixes, read from
`cachelife.integration.skips` (the advice the decoding guard's WARNING gives)."""

from __future__ import annotations

import inspect

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

from cachelife.integration import skips
from cachelife_docs.nodes import Cell, Code, table


class SkipAdvice(SphinxDirective):
    """A row per fragment of torch's reason that cachelife recognises: what it means, and the fix."""

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(inspect.getfile(skips))
        # The module's own table (a private name: the module owns it, this page only reads it).
        rows: list[list[Cell]] = [[Code(fragment), advice.cause, advice.fix] for fragment, advice in skips._ADVICE]
        unknown = skips.advice_for("")
        rows.append(["anything else", unknown.cause, unknown.fix])
        return [table(["torch's reason contains", "what it means", "fix"], rows, classes=["cachelife-wrapped"])]
