"""README.md is a user's first page: short, with the two commands that work on a fresh CPU machine, and with
snippets that run as they are written.

Each ```python snippet runs in a fresh namespace in this process, under pytest's warnings-as-errors; the
snippets build tiny models from configs and check their own results (`assert torch.equal(...)`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
MAIN_JOB = "pip install torch==2.13.0 && pip install -e . && python -m cachelife demo"
# .ci/run runs exactly this; the README must say it.
TESTS = "pip install nox && nox"
MOST_LINES = 250
FEWEST_SNIPPETS = 3


def snippets() -> list[str]:
    """The body of every ```python block of README.md, in order."""
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.DOTALL | re.MULTILINE)


def test_the_readme_is_a_short_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MOST_LINES, f"README.md has {len(lines)} lines; move the depth to docs/"


def test_the_readme_gives_the_two_commands() -> None:
    text = README.read_text()
    assert MAIN_JOB in text
    assert TESTS in text


def test_the_readme_has_its_snippets() -> None:
    assert len(snippets()) >= FEWEST_SNIPPETS


@pytest.mark.parametrize("number", range(len(snippets())), ids=lambda number: f"snippet-{number + 1}")
def test_every_snippet_runs(number: int) -> None:
    # A last line of our own, reached only if every line of the snippet before it ran.
    source = snippets()[number] + "\nreached_the_end = True\n"
    namespace: dict[str, object] = {"__name__": f"readme_snippet_{number + 1}"}
    exec(compile(source, f"README.md, snippet {number + 1}", "exec"), namespace)
    assert namespace.get("reached_the_end") is True
