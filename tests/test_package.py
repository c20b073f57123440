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
from cachelife.__main__ import main, program_name

README = Path(__file__).resolve().parents[1] / "README.md"
SOURCE = str(Path(cachelife.__file__).resolve().parents[1])


def run(*command: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [SOURCE, os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        command, capture_output=True, text=True, check=False, timeout=300, env={**os.environ, "PYTHONPATH": path}
    )


def documented_names() -> list[str]:
    """Every `cachelife.NAME` that README.md mentions (functions, classes and submodules)."""
    return sorted(set(re.findall(r"\bcachelife\.([A-Za-z_]\w*)", README.read_text())))


# Reads, after a plain `import cachelife` and nothing else, what each documented name is.
PROBE = """
import importlib.util, json, sys, types
import cachelife
names = json.loads(sys.argv[1])
seen = {}
for name in names:
    value = getattr(cachelife, name, None)
    spec = importlib.util.find_spec(f"cachelife.{name}")
    seen[name] = {
        "kind": "missing" if value is None else "module" if isinstance(value, types.ModuleType) else "object",
        "submodule": spec is not None,
        "module": getattr(value, "__name__", None) if isinstance(value, types.ModuleType) else None,
    }
import cachelife.decode
seen["decode after import cachelife.decode"] = {"callable": callable(cachelife.decode)}
print("PROBE " + json.dumps(seen))
"""


@pytest.fixture(scope="module")
def after_import() -> dict[str, dict[str, object]]:
    done = run(sys.executable, "-c", PROBE, json.dumps(documented_names()))
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))
    seen: dict[str, dict[str, object]] = json.loads(line.removeprefix("PROBE "))
    return seen


def test_readme_documents_the_names_checked_here() -> None:
    names = documented_names()
    for name in ("decode", "enable", "lifecycle", "zoo", "buckets", "layer_lifecycle"):
        assert name in names


def test_every_name_the_readme_documents_is_there_after_import_cachelife(
    after_import: dict[str, dict[str, object]],
) -> None:
    missing = [name for name in documented_names() if after_import[name]["kind"] == "missing"]
    assert missing == []


def test_every_documented_submodule_is_that_module_after_import_cachelife(
    after_import: dict[str, dict[str, object]],
) -> None:
    submodules = [name for name in documented_names() if after_import[name]["submodule"] and name != "decode"]
    assert submodules, "README.md names no submodule"
    for name in submodules:
        assert after_import[name] == {"kind": "module", "submodule": True, "module": f"cachelife.{name}"}, name


def test_cachelife_decode_is_the_function_even_after_importing_its_module(
    after_import: dict[str, dict[str, object]],
) -> None:
    assert after_import["decode"]["kind"] == "object"
    assert after_import["decode after import cachelife.decode"] == {"callable": True}
    from cachelife.decode import decode  # the module, by name  # noqa: PLC0415

    assert cachelife.decode is decode
    assert sys.modules["cachelife.decode"].decode is decode


def test_everything_in_all_is_exported_and_no_storage_is_among_it() -> None:
    assert "NoStorage" in cachelife.__all__
    assert "decode" in cachelife.__all__
    assert [name for name in cachelife.__all__ if not hasattr(cachelife, name)] == []
    assert cachelife.NoStorage is cachelife.layer_lifecycle.NoStorage


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
