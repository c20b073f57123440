"""The results pages' generated parts: the newest results of one registry entry as a table of chosen columns
(the performance page), a section per benchmark results file under `bench/results/`, and a table of the GPU
suite's summaries (the page of every results file)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, ClassVar

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

from cachelife_docs import provenance, records
from cachelife_docs.nodes import Cell, Code, paragraph, section, table

_LOG = logging.getLogger(__name__)


class _ResultsDirective(SphinxDirective):
    @property
    def root(self) -> Path:
        return Path(self.config.cachelife_repository)

    def files(self, *, benchmarks: bool) -> list[tuple[Path, str, dict[str, Any]]]:
        """(path, path relative to bench/results, record) of the benchmark files, or of the other JSON files."""
        results = self.root / "bench" / "results"
        for source in ("registry.py", "results_readme.py"):
            if (self.root / "bench" / source).exists():
                self.env.note_dependency(str(self.root / "bench" / source))
        found = []
        for path in records.files(results):
            record = records.read(path)
            if record is None or records.is_benchmark(record) is not benchmarks:
                continue
            self.env.note_dependency(str(path))
            found.append((path, path.relative_to(results).as_posix(), record))
        return found


class NewestResults(_ResultsDirective):
    """The newest file of one entry of bench/registry.py: where it ran and what reruns it, then the columns
    `:columns:` names (`key` or `key as label`, comma-separated) of its table `:table:`, each row completed by
    the matching row of the table `:join:`. A missing table is a build warning, and so is a column that no row
    has in a file the entry's present command wrote."""

    required_arguments = 1
    option_spec: ClassVar[dict[str, Any]] = {
        "table": directives.unchanged_required,
        "columns": directives.unchanged_required,
        "join": directives.unchanged,
    }

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        registry = importlib.import_module("bench.registry")
        readme = importlib.import_module("bench.results_readme")
        if name not in registry.BENCHMARKS:
            msg = f"no entry {name!r} in bench/registry.py (`python -m bench list` names them)"
            raise self.error(msg)
        for path, _, _ in self.files(benchmarks=True):
            self.env.note_dependency(str(path))
        found = readme.newest(name, self.root / "bench" / "results")
        rerun = Code(f"python -m bench run {name}")
        if found is None:
            return [paragraph("Not measured yet: ", rerun, ".")]
        path, record = found
        relative = path.relative_to(self.root / "bench" / "results").as_posix()
        wanted = [part.strip().partition(" as ") for part in self.options["columns"].split(",")]
        keys, labels = [key for key, _, _ in wanted], [label or key for key, _, label in wanted]
        tables = records.tables(record)
        rows = records.select(tables, self.options["table"], keys, self.options.get("join", ""))
        if rows is None:
            _LOG.warning("%s has no table %r", relative, self.options["table"], location=self.get_location())
            rows = ()
        # A file the entry's present command wrote has every column; an older one may lack the newer ones.
        current = provenance.recorded_command(record) is None
        for number, key in enumerate(keys):
            if current and rows and not any(row[number] for row in rows):
                _LOG.warning("%s: no row has the column %r", relative, key, location=self.get_location())
        return [self._origin(name, relative, record, rerun), table(labels, [list(row) for row in rows])]

    def _origin(self, name: str, relative: str, record: dict[str, Any], rerun: Code) -> nodes.paragraph:
        """One line: the device, the versions, the date and commit, the command that reruns it, the file."""
        origin = provenance.provenance(self.root, self.root / "bench" / "results" / relative, relative, record)
        versions = [f"{key} {record[key]}" for key in ("torch", "transformers") if key in record]
        date = str(record.get("date", ""))[:10]
        facts = ", ".join([records.cell(record.get("device")), *versions, date, f"commit {origin.commit}"])
        recorded = provenance.recorded_command(record)
        if recorded is not None:
            how: tuple[str | Code, ...] = ("; recorded as ", Code(recorded), f" (before the entry {name} took its "
                                           "present arguments)")  # fmt: skip
        else:
            how = ("; ", rerun)
        return paragraph(facts, *how, "; file ", Code(f"bench/results/{relative}"), ".")


class BenchmarkResults(_ResultsDirective):
    """One section per benchmark file: where it came from, its settings, and its measurements."""

    def run(self) -> list[nodes.Node]:
        return [self._file(path, relative, record) for path, relative, record in self.files(benchmarks=True)]

    def _file(self, path: Path, relative: str, record: dict[str, Any]) -> nodes.section:
        origin = provenance.provenance(self.root, path, relative, record)
        versions = [f"{name} {record[name]}" for name in ("torch", "transformers", "cachelife") if name in record]
        head: list[list[Cell]] = [
            ["benchmark", records.cell(record.get("benchmark"))],
            ["date", records.cell(record.get("date"))],
            ["device", records.cell(record.get("device"))],
            ["versions", ", ".join(versions) or provenance.NOT_RECORDED],
            ["commit", origin.commit],
            ["rerun", Code(origin.rerun) if origin.rerun_is_command else origin.rerun],
            ["command line recorded", origin.recorded_command],
            ["settings", records.settings_text(record.get("settings")) or "-"],
        ]
        node = section(relative, f"results-{relative}")
        node += table(["file", Code(f"bench/results/{relative}")], head, classes=["cachelife-provenance"])
        for found in records.tables(record):
            node += paragraph(found.title)
            node += table(list(found.columns), [list(row) for row in found.rows])
        return node


class SuiteRuns(_ResultsDirective):
    """A row per GPU-suite summary (and per tensor-parallel check) under `bench/results/`."""

    def run(self) -> list[nodes.Node]:
        rows: list[list[Cell]] = []
        columns: list[str] = []
        for path, relative, record in self.files(benchmarks=False):
            summary = records.suite_summary(record)
            summary["commit"] = provenance.provenance(self.root, path, relative, record).commit
            columns = list(summary)
            rows.append([Code(relative), *summary.values()])
        if not rows:
            return [paragraph("No GPU-suite summaries under bench/results/.")]
        return [table(["file", *columns], rows)]
