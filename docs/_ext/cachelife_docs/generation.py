"""The `cachelife.generate` page's tables: generation modes, the arguments and config fields that fall back,
and the logits processors the compiled step runs (read from `cachelife.generation`)."""

from __future__ import annotations

import inspect

from docutils import nodes
from sphinx.util.docutils import SphinxDirective
from transformers.generation.configuration_utils import GenerationMode

import cachelife
from cachelife.generation import arguments, processors
from cachelife_docs.nodes import Cell, Code, inline, table

FALLS_BACK = "falls back to model.generate"


class _FromTheCode(SphinxDirective):
    def note_sources(self) -> None:
        for module in (arguments, processors):
            self.env.note_dependency(inspect.getfile(module))


class Keywords(_FromTheCode):
    """`cachelife.generate`'s own keyword arguments and their defaults, read from its signature, each with the
    description the directive's content gives as `name: text` lines. A keyword without a description, or a
    description of a keyword the signature lacks, fails the build: the table cannot fall behind the code."""

    has_content = True

    def run(self) -> list[nodes.Node]:
        self.note_sources()
        self.env.note_dependency(inspect.getfile(cachelife.generate))
        described: dict[str, str] = {}
        for line in self.content:
            if line.strip():
                name, _, text = line.partition(":")
                described[name.strip()] = text.strip()
        own = [
            parameter
            for parameter in inspect.signature(cachelife.generate).parameters.values()
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY
        ]
        names = [parameter.name for parameter in own]
        missing = [name for name in names if name not in described]
        unknown = [name for name in described if name not in names]
        if missing or unknown:
            msg = (
                f"cachelife.generate's keywords are {names}; describe every one of them, and no other, in this "
                f"directive's content (missing: {missing}, not in the signature: {unknown})"
            )
            raise self.error(msg)
        rows: list[list[Cell]] = [
            [Code(parameter.name), Code(repr(parameter.default)), inline(described[parameter.name])]
            for parameter in own
        ]
        return [table(["keyword", "default", "what it does"], rows, classes=["cachelife-wrapped"])]


class GenerationModes(_FromTheCode):
    """Every transformers generation mode: decoded by cachelife's loop, or left to transformers."""

    def run(self) -> list[nodes.Node]:
        self.note_sources()
        rows: list[list[Cell]] = [
            [Code(mode.value), "decoded by cachelife" if mode in arguments.SUPPORTED_MODES else FALLS_BACK]
            for mode in GenerationMode
        ]
        return [table(["generation mode", "cachelife.generate"], rows)]


class FallbackArguments(_FromTheCode):
    """The arguments (`FALLBACK_ARGUMENTS`) and generation-config fields (`FALLBACK_CONFIG_FIELDS`) that fall back."""

    def run(self) -> list[nodes.Node]:
        self.note_sources()
        rows: list[list[Cell]] = [
            [Code(name), "argument of generate", "given, and not None, False or empty"]
            for name in arguments.FALLBACK_ARGUMENTS
        ]
        rows += [
            [Code(name), "generation-config field", "set to a value that asks for the feature"]
            for name in arguments.FALLBACK_CONFIG_FIELDS
        ]
        return [table(["name", "kind", "falls back when"], rows)]


class Processors(_FromTheCode):
    """transformers' logits processors the compiled step runs: as they are, or in their tensor form."""

    def run(self) -> list[nodes.Node]:
        self.note_sources()
        # The module's own lists (private names: the module owns them, this page only reads them).
        called = processors._CALLED
        as_tensors = processors._AS_TENSORS
        reads = processors._READS
        rows: list[list[Cell]] = [
            [Code(kind.__name__), "called as transformers wrote it (reads only the scores)", "-"] for kind in called
        ]
        rows += [
            [
                Code(kind.__name__),
                "in tensor form: the same arithmetic on a 0-dim length and a fixed token buffer",
                ", ".join(reads.get(kind, ())) or "-",
            ]
            for kind in as_tensors
        ]
        rows.append(["any other processor", FALLS_BACK, "-"])
        return [table(["transformers processor", "in the compiled step", "attributes it must have"], rows)]
