"""A new user's first hour: what `import cachelife` gives, and what the command line says.

The import checks run in a fresh interpreter: in this one, other tests have imported submodules already.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cachelife
from cachelife import errors
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


# Reads, after a plain `import cachelife` and nothing else, which of the given names are not there.
PROBE = """
import json, sys
import cachelife
names = json.loads(sys.argv[1])
seen = {"missing": [name for name in names if not hasattr(cachelife, name)]}
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


# The top level, by task (docs/api.rst shows the same groups).
PUBLIC = {
    # enable a model
    "enable", "Options", "EXACT", "FAST", "disable", "is_enabled", "compile_forward", "restore_forward", "pool_of",
    "CachePool", "release", "Released",
    # generate
    "generate", "FAST_KERNELS",
    # serve
    "Engine", "EngineStats",
    # the lifecycle
    "lifecycle", "prepare_static_cache", "CacheLifecycle", "LayerLifecycle", "LayerState", "Unallocated", "Pinned",
    "Filled", "NoStorage", "FillRecord", "TRANSITIONS",
    # model authors
    "CacheLifecycleMixin", "DeclaresCacheShapes", "CacheShapes", "LayerShape", "model_cache_shapes",
    # warm starts
    "pinned_compile_cache", "save_compile_artifacts", "load_compile_artifacts", "read_compile_artifacts_header",
    "CompileArtifactsHeader",
    # debugging
    "enable_debug_logging", "disable_debug_logging", "__version__",
    # the base error
    "CacheLifecycleError",
}  # fmt: skip
# The names that left the top level in 0.2 -> where they live now (docs/changes.md).
DEPRECATED = {
    **{
        name: "cachelife.errors"
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.CacheLifecycleError)
        and value is not errors.CacheLifecycleError
    },
    "Buffers": "cachelife.core.buffers",
    "PinSpec": "cachelife.core.buffers",
    "is_managed_cache": "cachelife.core.cache_lifecycle",
    "pin_for_model": "cachelife.core.pinning",
    "infer_cache_shapes": "cachelife.core.shapes",
    "decode": "cachelife.generation.decode",
    "release_pool": "cachelife.integration.enabling",
    "ModelRuntime": "cachelife.integration.runtime",
    "runtime_of": "cachelife.integration.runtime",
    "configure_from_environment": "cachelife.log",
}  # fmt: skip


def test_the_top_level_is_the_public_set_and_each_name_is_bound_there() -> None:
    assert sorted(cachelife.__all__) == sorted(PUBLIC)
    assert len(cachelife.__all__) == len(set(cachelife.__all__))
    # Bound in the module itself, not reached through the deprecation hook.
    assert [name for name in PUBLIC if name not in vars(cachelife)] == []
    namespace: dict[str, object] = {}
    exec("from cachelife import *", namespace)  # what a star import gives, in a fresh namespace
    assert set(namespace) - {"__builtins__"} == PUBLIC


def test_dir_lists_the_public_names_and_errors_only() -> None:
    assert dir(cachelife) == sorted([*PUBLIC, "errors"])


@pytest.mark.parametrize(("name", "home"), sorted(DEPRECATED.items()))
def test_a_name_that_left_the_top_level_warns_and_is_its_new_homes(name: str, home: str) -> None:
    expected = rf"^cachelife\.{name} is deprecated and will be removed in 0\.3; import it from {re.escape(home)}\b"
    with pytest.warns(DeprecationWarning, match=expected) as caught:
        value = getattr(cachelife, name)
    assert value is getattr(importlib.import_module(home), name)
    assert [warning.filename for warning in caught] == [__file__]  # the warning points at the caller


def test_from_import_of_a_deprecated_name_warns_at_the_import() -> None:
    with pytest.warns(DeprecationWarning, match=r"^cachelife\.QueueFullError is deprecated") as caught:
        from cachelife import QueueFullError  # noqa: PLC0415 - the deprecated form under test

    assert QueueFullError is errors.QueueFullError
    # The import machinery looks the name up twice (is it a submodule? then the name itself): both at the caller.
    assert {warning.filename for warning in caught} == {__file__}


def test_a_deprecated_name_with_a_public_replacement_names_it() -> None:
    instead = re.escape("or use cachelife.generate(model, **inputs, fallback=False)")
    with pytest.warns(DeprecationWarning, match=rf"; import it from cachelife\.generation\.decode, {instead}$"):
        _ = cachelife.decode


def test_an_unknown_name_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match=r"^module 'cachelife' has no attribute 'runtime'$") as raised:
        _ = cachelife.runtime
    assert raised.value.name == "runtime"
    assert not hasattr(cachelife, "runtime")


def test_every_error_is_in_cachelife_errors_and_only_the_base_at_the_top() -> None:
    classes = {
        name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, BaseException)
    }
    assert len(classes) == 19
    assert all(issubclass(getattr(errors, name), errors.CacheLifecycleError) for name in classes)
    assert sorted(classes & set(cachelife.__all__)) == ["CacheLifecycleError"]
    assert cachelife.CacheLifecycleError is errors.CacheLifecycleError


def test_no_public_name_is_deprecated_too() -> None:
    assert sorted(PUBLIC & set(DEPRECATED)) == []


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
