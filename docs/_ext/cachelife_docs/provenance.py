"""Where a results file came from: the command that reruns it, the command line it recorded, its commit.

The command is `python -m bench run NAME` for the entry of `bench/registry.py` that produced the file, chosen
as bench/results/README.md chooses it (`bench.results_readme.json_row`: the entry whose command the file
recorded, else the one whose `results` glob matches the file's name most specifically), so the page and that
README cannot disagree. Without a registry (a checkout from before it), the page says so and shows the command
line the file recorded, if any.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attrs import frozen

NOT_RECORDED = "not recorded"


@frozen
class Provenance:
    """What a results file's table says about its origin, each as text for the page."""

    rerun: str
    recorded_command: str
    commit: str

    @property
    def rerun_is_command(self) -> bool:
        return self.rerun.startswith("python ")


def has_registry(root: Path) -> bool:
    return (root / "bench" / "registry.py").exists()


def provenance(root: Path, path: Path, relative: str, record: Mapping[str, Any]) -> Provenance:
    """What the page says about where `path` (`relative` under bench/results) came from."""
    recorded = record.get("command")
    recorded_text = recorded if isinstance(recorded, str) else NOT_RECORDED
    if has_registry(root):
        # Imported from the repository root (conf.py puts it on sys.path); imports attrs and the registry only.
        readme = importlib.import_module("bench.results_readme")
        row = readme.json_row(path, relative, dict(record))
        rerun = str(row.command)
        if rerun == "none registered":
            rerun = "no entry of bench/registry.py produced this file"
        return Provenance(rerun=rerun, recorded_command=recorded_text, commit=str(row.commit))
    # Fallback, clearly marked: a checkout without bench/registry.py.
    rerun = (
        f"(no bench/registry.py in this checkout: the command line the file recorded) {recorded}"
        if isinstance(recorded, str)
        else "(no bench/registry.py in this checkout, and the file recorded no command line)"
    )
    commit = record.get("commit")
    commit_text = NOT_RECORDED
    if isinstance(commit, str):
        commit_text = commit + (" + uncommitted changes" if record.get("dirty") is True else "")
    return Provenance(rerun=rerun, recorded_command=recorded_text, commit=commit_text)


def recorded_command(record: Mapping[str, Any]) -> str | None:
    """The command line a file recorded (`python -m MODULE ...`, without `--out`), where it is not an entry's
    command: the file was matched to its entry by name, and `python -m bench run NAME` would run otherwise.
    None where the recorded command is an entry's, or none was recorded."""
    readme = importlib.import_module("bench.results_readme")
    command = record.get("command")
    if not isinstance(command, str) or "-m" not in command.split() or readme.recorded_entry(dict(record)):
        return None
    words = command.split()
    return " ".join(["python", *readme.without_out(words[words.index("-m") :])])
