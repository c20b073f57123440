"""The performance page's generated part: a section per benchmark results file under `bench/results/`, and a
table of the GPU suite's summaries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

from cachelife_docs import provenance, records
from cachelife_docs.nodes import Cell, Code, paragraph, section, table


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
