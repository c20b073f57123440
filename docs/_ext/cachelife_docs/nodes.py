"""docutils nodes for generated content: tables whose cells are text or code, and titled sections."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from attrs import frozen
from docutils import nodes


@frozen
class Code:
    """A cell shown as code."""

    text: str


# A cell: text, code, or a run of both (`inline("uses `x`")`).
Cell = str | Code | tuple[str | Code, ...]

WIDEST_COLUMN = 40


def table(header: Sequence[Cell], rows: Iterable[Sequence[Cell]], *, classes: Sequence[str] = ()) -> nodes.table:
    """A table with one header row; each row is padded (or cut) to the header's length."""
    padded = [[*list(row)[: len(header)], *[""] * (len(header) - len(row))] for row in rows]
    node = nodes.table(classes=["cachelife-generated", *classes])
    group = nodes.tgroup(cols=len(header))
    node += group
    for column in range(len(header)):
        # Relative widths, for builders that lay out text (HTML sizes the columns itself).
        longest = max(_length(row[column]) for row in [list(header), *padded])
        group += nodes.colspec(colwidth=min(max(longest, 3), WIDEST_COLUMN))
    head = nodes.thead()
    head += _row(header)
    group += head
    body = nodes.tbody()
    for row in padded:
        body += _row(row)
    group += body
    return node


def _length(value: Cell) -> int:
    if isinstance(value, tuple):
        return sum(_length(part) for part in value)
    return len(value.text) + 2 if isinstance(value, Code) else len(value)


def inline(text: str) -> tuple[str | Code, ...]:
    """Text with `backticked` pieces as code, as Markdown writes them."""
    pieces = text.split("`")
    return tuple(Code(piece) if number % 2 else piece for number, piece in enumerate(pieces) if piece)


def _row(cells: Sequence[Cell]) -> nodes.row:
    row = nodes.row()
    for value in cells:
        entry = nodes.entry()
        entry += paragraph(*(value if isinstance(value, tuple) else (value,)))
        row += entry
    return row


def paragraph(*parts: str | Code) -> nodes.paragraph:
    """A paragraph of text and code pieces."""
    node = nodes.paragraph()
    for part in parts:
        node += nodes.literal(part.text, part.text) if isinstance(part, Code) else nodes.Text(part)
    return node


def section(title: str, anchor: str) -> nodes.section:
    """A section with a title and the anchor `anchor` (made a valid id)."""
    node = nodes.section(ids=[nodes.make_id(anchor)], names=[nodes.fully_normalize_name(anchor)])
    node += nodes.title(title, title)
    return node


def preformatted(text: str) -> nodes.literal_block:
    """Preformatted text (a drawn diagram), not highlighted as code."""
    node = nodes.literal_block(text, text, classes=["cachelife-diagram"])
    node["language"] = "text"
    return node
