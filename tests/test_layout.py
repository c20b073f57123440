"""The package's layout: imports only go down the layers (the base -> the lifecycle core -> the step's
kernels -> the model rewrites -> the transformers integration -> the fast loop -> serving -> the tools and the
public face), never back up, whatever form they take."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import attrs
import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "cachelife"

# Lowest layer first: a module may import modules of its own layer or of a layer below. A subpackage is one
# layer; the package's own modules at the top are named by file.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"errors", "log", "validate", "version"}),
    frozenset({"core"}),
    frozenset({"kernels"}),
    frozenset({"model_rewrites"}),
    frozenset({"integration"}),
    frozenset({"generation"}),
    frozenset({"serving"}),
    frozenset({"tools", "__main__", "__init__"}),
)
# Review advice, not a limit to squeeze against: a module past it is read for more than one job.
ADVISED_LINES = 400


def layer_of(place: str) -> int:
    found = [index for index, members in enumerate(LAYERS) if place in members]
    if not found:
        pytest.fail(f"cachelife.{place} is in no layer of tests/test_layout.py; place it in LAYERS")
    return found[0]


def _place(dotted: str) -> str | None:
    """The layer name of a dotted module path inside the package (`cachelife.core.pool` -> `core`); the package
    itself is its face, `__init__`."""
    parts = dotted.split(".")
    if parts[0] != "cachelife":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def imported_places(path: Path, root: Path = PACKAGE) -> set[str]:
    """The layers a file imports from, in every form: `import cachelife`, `import cachelife.x.y`,
    `from cachelife import x`, `from cachelife.x import y`, and relative imports (`from . import x`)."""
    module_parts = ["cachelife", *path.relative_to(root).with_suffix("").parts]
    if module_parts[-1] == "__init__":
        module_parts.pop()
    package_parts = module_parts if path.name == "__init__.py" else module_parts[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(p for alias in node.names if (p := _place(alias.name)) is not None)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                dotted = ".".join([*base, *([node.module] if node.module else [])])
            else:
                dotted = node.module or ""
            if dotted == "cachelife":  # `from cachelife import x`: x is a module, a subpackage, or the face's name
                for alias in node.names:
                    named = alias.name
                    is_module = (PACKAGE / f"{named}.py").exists() or (PACKAGE / named).is_dir()
                    found.add(named if is_module else "__init__")
            elif (place := _place(dotted)) is not None:
                found.add(place)
    return found


MODULES = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py"))


def place_of(module: str) -> str:
    return module.split("/", maxsplit=1)[0].removesuffix(".py")


@pytest.mark.parametrize("module", MODULES)
def test_imports_only_go_down_the_layers(module: str) -> None:
    own = layer_of(place_of(module))
    above = sorted(other for other in imported_places(PACKAGE / module) if layer_of(other) > own)
    assert above == [], f"cachelife/{module} (layer {own}) imports from a layer above it: {above}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import cachelife\n", {"__init__"}),
        ("import cachelife.tools.zoo\n", {"tools"}),
        ("from cachelife import generate\n", {"__init__"}),
        ("from cachelife import tools\n", {"tools"}),
        ("from cachelife.generation.loop import x\n", {"generation"}),
        ("from . import loop\n", {"core"}),
        ("from ..generation import x\n", {"generation"}),
    ],
)
def test_every_import_form_is_seen(source: str, expected: set[str], tmp_path: Path) -> None:
    # A stand-in file at cachelife/core/probe.py: relative imports resolve against its package.
    probe = tmp_path / "cachelife" / "core" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(source)
    assert imported_places(probe, root=tmp_path / "cachelife") == expected


def test_no_module_outside_the_face_and_the_cli_imports_the_package_itself() -> None:
    offenders = [
        m for m in MODULES if m not in ("__init__.py", "__main__.py") and "__init__" in imported_places(PACKAGE / m)
    ]
    assert offenders == []


def test_subpackage_faces_define_nothing() -> None:
    """Only `cachelife/__init__.py` is public: a subpackage's `__init__.py` is a docstring."""
    for face in sorted(PACKAGE.glob("*/__init__.py")):
        body = ast.parse(face.read_text()).body
        assert [type(node).__name__ for node in body] == ["Expr"], face


# Optional dependencies a module may need (the `serve` extra); a module that needs a missing one is not read.
OPTIONAL = ("ray", "starlette")
# A record of more fields than this is built with keywords only.
MOST_POSITIONAL = 3


def records(module: str) -> list[type]:
    """The attrs classes `cachelife/<module>` defines."""
    dotted = "cachelife." + module.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    try:
        loaded = importlib.import_module(dotted)
    except ModuleNotFoundError as missing:
        if missing.name is not None and missing.name.split(".")[0] in OPTIONAL:
            pytest.skip(f"{dotted} needs {missing.name}")
        raise
    return [
        value
        for value in vars(loaded).values()
        if isinstance(value, type) and attrs.has(value) and value.__module__ == loaded.__name__
    ]


@pytest.mark.parametrize("module", MODULES)
def test_records_of_more_than_three_fields_are_keyword_only(module: str) -> None:
    positional = {}
    for record in records(module):
        taken = [field for field in attrs.fields(record) if field.init]
        if len(taken) > MOST_POSITIONAL:
            positional[record.__name__] = [field.name for field in taken if not field.kw_only]
    assert {name: fields for name, fields in positional.items() if fields} == {}
