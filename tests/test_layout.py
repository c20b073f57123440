"""The package's layout: modules stay small, and imports only go down the layers (core -> cache -> model
integration -> decode loop -> CLI), never back up."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "cachelife"

# Lowest layer first. A module may import modules of its own layer or of a layer below.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"errors", "log", "validate", "version"}),
    frozenset(
        {
            "reorder",
            "buffers",
            "layer_lifecycle",
            "fit",
            "shapes",
            "placement",
            "cache_lifecycle",
            "pool",
            "compile_cache",
        }
    ),
    frozenset({"call_arguments", "compiled", "buckets", "pinning", "skips", "guard", "enabling", "warm_start"}),
    frozenset({"decode", "generation"}),
    frozenset({"zoo", "recipe", "demo", "__main__", "__init__"}),
)
MAX_LINES = 400


def layer_of(module: str) -> int:
    found = [index for index, members in enumerate(LAYERS) if module in members]
    if not found:
        pytest.fail(f"cachelife.{module} is in no layer of tests/test_layout.py; place it in LAYERS")
    return found[0]


def imported_modules(path: Path) -> set[str]:
    """The cachelife modules a file imports (`from cachelife.x import ...`, `from cachelife import x`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module == "cachelife":
                found.update(
                    alias.name
                    for alias in node.names
                    if (PACKAGE / f"{alias.name}.py").exists() or (PACKAGE / alias.name).is_dir()
                )
            elif node.module.startswith("cachelife."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("cachelife."))
    return found


# Every module, a subpackage's modules under the subpackage's name (`generation/loop.py` is in the layer of
# `generation`), as a path relative to the package.
MODULES = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py"))


def top_name(module: str) -> str:
    return module.split("/", maxsplit=1)[0].removesuffix(".py")


@pytest.mark.parametrize("module", MODULES)
def test_imports_only_go_down_the_layers(module: str) -> None:
    own = layer_of(top_name(module))
    above = sorted(other for other in imported_modules(PACKAGE / module) if layer_of(other) > own)
    assert above == [], f"cachelife/{module} (layer {own}) imports from a layer above it: {above}"


@pytest.mark.parametrize("module", MODULES)
def test_module_is_at_most_400_lines(module: str) -> None:
    lines = len((PACKAGE / module).read_text().splitlines())
    assert lines <= MAX_LINES, f"cachelife/{module} has {lines} lines; split it by job"
