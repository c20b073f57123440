"""Benchmark results files as tables: which facts head a file, and its measurements as rows and columns.

Every file in `bench/results/` is a JSON object: a header (benchmark, date, device, versions, and in newer
files the commit, a dirty flag and the command line), the settings, and one or more sections of results whose
layout differs from benchmark to benchmark. Rather than one renderer per benchmark, which would drift as the
benchmarks change, a section is walked generically:

- a record is an object whose values are plain values, short lists of them, or small objects of them
  (`{"kernel_ms_per_step": 2.49, "kernels_per_step": 710}` becomes the columns `kernels.kernel_ms_per_step`,
  `kernels.kernels_per_step`): it is one row;
- an object whose values are all objects is a mapping from names (models, paths, roles) to records: each name
  becomes a value in a column named after the mapping;
- a list holds records one after another;
- a record that also holds nested sections passes its few identifying values (at most three) on to the rows
  of those sections, or is a row of its own when it has more.

Raw samples (per-call timings, per-call records, kernel names, compiler counters) stay in the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

from attrs import define, field, frozen

# Keys whose nested values are raw samples or machine detail rather than results.
RAW: Final = frozenset({
    "call_s", "calls", "top", "counters", "saved", "tokens", "environment", "tail", "groups", "idle_ms_per_step_before",
})  # fmt: skip
# Keys of the header, shown above a file's tables rather than in them.
HEADER: Final = ("benchmark", "date", "device", "torch", "transformers", "cachelife", "python", "commit", "dirty")
# A small object of plain values becomes columns; a larger one is a child section of rows.
FLAT_FIELDS: Final = 4
# A record passes at most this many values to its children's rows.
CONTEXT_FIELDS: Final = 3
# A record that is a row of its own names the rows of its nested sections by this many of its texts.
NAMING_FIELDS: Final = 2
LONGEST_TEXT: Final = 90
# Between the parts of a table's title, and of a name inside a name.
SEPARATOR: Final = " / "
LONGEST_LIST: Final = 6


@frozen
class Table:
    """Rows of one section of a results file, with the union of their columns in first-seen order."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@define
class _Collector:
    rows: dict[str, list[dict[str, str]]] = field(factory=dict)

    def emit(self, table: str, row: Mapping[str, str]) -> None:
        self.rows.setdefault(table, []).append(dict(row))

    def tables(self) -> list[Table]:
        found = []
        for title, rows in self.rows.items():
            columns: dict[str, None] = {}
            for row in rows:
                columns.update(dict.fromkeys(row))
            found.append(Table(title, tuple(columns), tuple(tuple(row.get(c, "") for c in columns) for row in rows)))
        return found


def read(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None for a file that holds something else."""
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else None


def is_benchmark(record: Mapping[str, Any]) -> bool:
    """Whether a results file is one benchmark's record (the GPU suite's summaries are not)."""
    return isinstance(record.get("benchmark"), str)


def cell(value: Any, *, keep_end: bool = False) -> str:  # noqa: PLR0911 - one return per kind of value
    """A plain value, or a short list of them, as table text; a long text keeps its start (or its end)."""
    match value:
        case None:
            return "-"
        case bool():
            return "yes" if value else "no"
        case int():
            return str(value)
        case float():
            return f"{value:.1f}" if abs(value) >= 1000 else f"{value:.4g}"
        case str():
            text = " ".join(value.split())
            if len(text) <= LONGEST_TEXT:
                return text
            return "…" + text[1 - LONGEST_TEXT :] if keep_end else text[: LONGEST_TEXT - 1] + "…"
        case list() | tuple():
            if not value:
                return "none"
            if len(value) > LONGEST_LIST:
                return f"{len(value)} values"
            return ", ".join(cell(item) for item in value)
        case _:
            return cell(str(value))


def settings_text(settings: Any) -> str:
    """A file's settings as one line of `name=value` pairs."""
    if not isinstance(settings, Mapping):
        return cell(settings)
    parts = []
    for name, value in settings.items():
        if isinstance(value, Mapping):
            inner = ", ".join(f"{key}={cell(item)}" for key, item in value.items())
            parts.append(f"{name}=({inner})")
        else:
            parts.append(f"{name}={cell(value)}")
    return "; ".join(parts)


def tables(record: Mapping[str, Any]) -> list[Table]:
    """The measurement sections of one benchmark's record (everything but its header, settings and command);
    plain values at the record's top level make one row of their own, "summary", first."""
    collector = _Collector()
    summary: dict[str, str] = {}
    for name, value in record.items():
        if name in (*HEADER, "settings", "command") or name in RAW:
            continue
        if _is_plain(value):
            summary[name] = cell(value)
        else:
            _walk(value, name, {}, collector, mapping_column=None)
    found = collector.tables()
    if summary:
        found.insert(0, Table("summary", tuple(summary), (tuple(summary.values()),)))
    return found


def select(found: list[Table], title: str, columns: list[str], join: str = "") -> tuple[tuple[str, ...], ...] | None:
    """The `columns` of table `title`'s rows (empty where a row has none), each row completed by the first row of
    table `join` that agrees with it on every column the two tables share; None if there is no table `title`."""
    by_title = {table.title: table for table in found}
    main = by_title.get(title)
    if main is None:
        return None
    joined = by_title.get(join)
    rows = []
    for row in main.rows:
        cells = dict(zip(main.columns, row, strict=True))
        if joined is not None:
            shared = [column for column in joined.columns if column in main.columns]
            for other in joined.rows:
                extra = dict(zip(joined.columns, other, strict=True))
                if all(extra[column] == cells[column] for column in shared):
                    cells = {**extra, **cells}
                    break
        rows.append(tuple(cells.get(column, "") for column in columns))
    return tuple(rows)


def _is_plain(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return all(_is_plain(item) and not isinstance(item, list | tuple) for item in value)
    return value is None or isinstance(value, str | int | float | bool)


def _is_flat(value: Any) -> bool:
    """A small object of plain values (its raw keys aside): columns of its parent's row."""
    if not isinstance(value, Mapping):
        return False
    shown = [item for key, item in value.items() if key not in RAW]
    return len(shown) <= FLAT_FIELDS and all(_is_plain(item) for item in shown)


def _split(node: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """A record's own cells, and its nested sections."""
    cells: dict[str, str] = {}
    nested: dict[str, Any] = {}
    for key, value in node.items():
        if key in RAW:
            continue
        if _is_plain(value):
            cells[key] = cell(value, keep_end=key.endswith("tail"))
        elif _is_flat(value):
            cells.update({f"{key}.{sub}": cell(item) for sub, item in value.items() if sub not in RAW})
        else:
            nested[key] = value
    return cells, nested


def _walk(node: Any, table: str, context: Mapping[str, str], collector: _Collector, mapping_column: str | None) -> None:
    if isinstance(node, list | tuple):
        for item in node:
            if isinstance(item, Mapping):
                _walk(item, table, context, collector, mapping_column=None)
            else:
                collector.emit(table, {**context, "value": cell(item)})
    elif not isinstance(node, Mapping):
        collector.emit(table, {**context, "value": cell(node)})
    else:
        cells, nested = _split(node)
        if not cells and nested and all(isinstance(value, Mapping) for value in nested.values()):
            _walk_mapping(nested, table, context, collector, mapping_column)
        elif not nested:
            collector.emit(table, {**context, **cells})
        else:
            _walk_record(node, table, context, collector, cells=cells, nested=nested)


def _walk_mapping(
    nested: Mapping[str, Any],
    table: str,
    context: Mapping[str, str],
    collector: _Collector,
    mapping_column: str | None,
) -> None:
    """Names (models, paths) to records: a row per name, the names in one column; the names of a mapping
    inside a mapping join the outer name (`t5-small / eager`)."""
    column = mapping_column or table.rsplit(SEPARATOR, 1)[-1]
    for name, value in nested.items():
        label = f"{context[column]}{SEPARATOR}{name}" if mapping_column and column in context else str(name)
        _walk(value, table, {**context, column: label}, collector, mapping_column=column)


def _walk_record(
    node: Mapping[str, Any],
    table: str,
    context: Mapping[str, str],
    collector: _Collector,
    *,
    cells: Mapping[str, str],
    nested: Mapping[str, Any],
) -> None:
    """A record with nested sections: its few values name their rows, or it is a row of its own."""
    if len(cells) <= CONTEXT_FIELDS:
        inherited = {**context, **cells}
    else:
        # A row of its own; its rows below are named by its first few texts (a dtype, a preset).
        collector.emit(table, {**context, **cells})
        names = [(key, text) for key, text in cells.items() if isinstance(node.get(key), str)]
        inherited = {**context, **dict(names[:NAMING_FIELDS])}
    records = {key: value for key, value in nested.items() if _is_record(value)}
    if len(records) > 1:
        # Several sibling records (a run per role, say) are one table with a column naming each.
        for key, value in records.items():
            _walk(value, f"{table}{SEPARATOR}parts", {**inherited, "part": key}, collector, mapping_column=None)
    for key, value in nested.items():
        if len(records) <= 1 or key not in records:
            _walk(value, f"{table}{SEPARATOR}{key}", inherited, collector, mapping_column=None)


def _is_record(value: Any) -> bool:
    if not isinstance(value, Mapping):
        return False
    _, nested = _split(value)
    return not nested


def suite_summary(record: Mapping[str, Any]) -> dict[str, str]:
    """One GPU-suite summary file (`gpu_suite.py`'s, or a tensor-parallel check's) as the cells of one row."""
    stages = record.get("tracks") or record.get("stage_seconds")
    if isinstance(stages, list):
        stage_text = " / ".join(", ".join(map(str, track)) for track in stages if isinstance(track, list))
    elif isinstance(stages, Mapping):
        stage_text = ", ".join(stages)
    else:
        # Early summaries name no stages: their stages' records are the objects they hold.
        stage_text = ", ".join(key for key, value in record.items() if isinstance(value, Mapping) and key not in RAW)
        stage_text = stage_text or "-"
    checks = ", ".join(f"{key}: {cell(value)}" for key, value in record.items() if isinstance(value, bool))
    versions = record.get("transformers_versions") or record.get("transformers")
    return {
        "date": cell(record.get("date", "")[:16] if isinstance(record.get("date"), str) else None),
        "device": cell(record.get("device")),
        "GPUs": cell(record.get("gpus", record.get("world_size"))),
        "torch": cell(record.get("torch")),
        "transformers": cell(versions),
        "stages": stage_text,
        "GPU tests": _test_outcomes(record.get("tests")),
        "checks": checks or "-",
    }


def _test_outcomes(tests: Any) -> str:
    if not isinstance(tests, Mapping):
        return "-"
    parts = []
    for version, run in tests.items():
        outcomes = run.get("tests") if isinstance(run, Mapping) else None
        if not isinstance(outcomes, Mapping):
            continue
        counts: dict[str, int] = {}
        for outcome in outcomes.values():
            counts[str(outcome)] = counts.get(str(outcome), 0) + 1
        parts.append(f"{version}: " + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())))
    return "; ".join(parts) or "-"


def files(results: Path) -> Iterator[Path]:
    """Every JSON file under `results` but its archive (superseded files, which no page cites), folder by
    folder, in name order with runs by number (run 9 before 10)."""

    def order(path: Path) -> tuple[int, list[str | int]]:
        name = path.relative_to(results).as_posix()
        return name.count("/"), [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]

    current = (path for path in results.rglob("*.json") if "archive" not in path.relative_to(results).parts)
    yield from sorted(current, key=order)
