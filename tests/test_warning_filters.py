"""Every `pytest.mark.filterwarnings` of the test suite parses. pytest parses a mark's filter only when its test
runs, and a filter it cannot parse ends the whole session there (under pytest-xdist: a lost worker), so a
malformed filter on a GPU test would first show on a GPU machine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from _pytest.config import parse_warning_filter

TESTS = Path(__file__).resolve().parent


def filters() -> list[tuple[str, str]]:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "filterwarnings"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                found.append((f"{path.relative_to(TESTS)}:{node.lineno}", node.args[0].value))
    return found


def test_the_suite_has_warning_filters() -> None:
    assert len(filters()) >= 3


@pytest.mark.parametrize(("where", "text"), filters())
def test_each_warning_filter_parses(where: str, text: str) -> None:
    action, _, category, _, _ = parse_warning_filter(text, escape=False)
    assert action in {"ignore", "error", "default", "always", "module", "once"}, where
    assert issubclass(category, Warning), where
