"""A new user's first hour: what `import cachelife` gives, and what the command line says.

The import checks run in a fresh interpreter: in this one, other tests have imported submodules already.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cachelife
from cachelife.tools.cli import main, program_name

README = Path(__file__).resolve().parents[2] / "README.md"
SOURCE = str(Path(cachelife.__file__).resolve().parents[1])


def run(*command: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [SOURCE, os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        command, capture_output=True, text=True, check=False, timeout=300, env={**os.environ, "PYTHONPATH": path}
    )


def documented_names() -> list[str]:
    """Every `cachelife.NAME` that README.md names as an attribute of the package (not `cachelife.tools.x`)."""
    return sorted(set(re.findall(r"\bcachelife\.([A-Za-z_]\w*)\b(?!\.\w)", README.read_text())))


# Reads, after a plain `import cachelife` and nothing else, which public names are there, and what
# `cachelife.decode` is once its module has been imported by name too.
PROBE = """
import json, sys
import cachelife
names = json.loads(sys.argv[1])
seen = {"missing": [name for name in names if not hasattr(cachelife, name)]}
import cachelife.generation.decode
seen["decode is callable"] = callable(cachelife.decode)
print("PROBE " + json.dumps(seen))
"""


@pytest.fixture(scope="module")
def after_import() -> dict[str, object]:
    done = run(sys.executable, "-c", PROBE, json.dumps(documented_names()))
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))
    seen: dict[str, object] = json.loads(line.removeprefix("PROBE "))
    return seen


def test_readme_documents_the_public_api() -> None:
    names = documented_names()
    for name in ("generate", "enable", "release"):
        assert name in names


def test_every_name_the_readme_documents_is_public_and_there_after_import_cachelife(
    after_import: dict[str, object],
) -> None:
    assert after_import["missing"] == []
    assert [name for name in documented_names() if name not in cachelife.__all__] == []


def test_cachelife_decode_is_the_function_even_after_importing_its_module(after_import: dict[str, object]) -> None:
    assert after_import["decode is callable"] is True
    from cachelife.generation.decode import decode  # noqa: PLC0415

    assert cachelife.decode is decode


def test_everything_in_all_is_exported_and_nothing_else_public() -> None:
    assert "NoStorage" in cachelife.__all__
    assert [name for name in cachelife.__all__ if not hasattr(cachelife, name)] == []
    public = {name for name in vars(cachelife) if not name.startswith("_")}
    subpackages = {
        "core",
        "kernels",
        "model_rewrites",
        "integration",
        "generation",
        "serving",
        "tools",
        "errors",
        "log",
        "validate",
        "version",
    }
    assert sorted(public - set(cachelife.__all__) - subpackages) == []


@pytest.mark.parametrize(
    ("argv0", "prog"),
    [
        ("/home/me/.venv/bin/cachelife", "cachelife"),
        ("/home/me/src/cachelife/__main__.py", "python -m cachelife"),
        ("cachelife", "cachelife"),
    ],
)
def test_usage_names_the_command_the_user_typed(argv0: str, prog: str) -> None:
    assert program_name(argv0) == prog


@pytest.mark.parametrize("command", ["demo", "recipe"])
def test_every_option_has_help_and_shows_its_default(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    options = re.findall(r"^  (--[a-z-]+)", text, flags=re.MULTILINE)
    assert "--batch-size" in options
    assert "--calls" in options
    # Each option's entry runs from its flag to the next flag; every one states its default.
    entries = re.split(r"^  (?=-)", text.split("options:", 1)[1], flags=re.MULTILINE)[1:]
    for entry in entries:
        if not entry.startswith("-h"):
            assert "(default:" in " ".join(entry.split()), entry


def test_the_console_script_names_itself_in_its_usage() -> None:
    script = Path(sys.executable).with_name("cachelife")
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable}: cachelife is not installed in this environment")
    done = run(str(script), "demo", "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage: cachelife demo")
