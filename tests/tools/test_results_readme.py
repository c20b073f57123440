"""bench/results_readme.py: which registry entry produced a results file, and each entry's newest file (what the
performance page shows)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.registry import BENCHMARKS
from bench.results_readme import newest, recorded_entry


def command(name: str, *extra: str) -> str:
    """The command line a run of entry `name` records, as bench/results_file.py writes it (spaces between)."""
    return " ".join(["/venv/bin/python", *BENCHMARKS[name].command, *extra])


def write(folder: Path, name: str, record: dict[str, object]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(record))
    return path


def test_a_recorded_command_names_its_entry_and_what_the_run_added_but_its_out() -> None:
    found = recorded_entry({"command": command("soak-cpu", "--calls", "20", "--out", "/tmp/x")})
    assert found is not None
    entry, extra = found
    assert (entry.name, extra) == ("soak-cpu", ["--calls", "20"])


def test_an_argument_holding_a_space_still_names_its_entry() -> None:
    # planted-bugs-cuda's `--select "not compiled_step_captures"` is recorded without its quotes.
    found = recorded_entry({"command": command("planted-bugs-cuda", "--out", "/root/out")})
    assert found is not None
    assert found[0].name == "planted-bugs-cuda"
    assert found[1] == []


def test_a_command_of_no_entry_names_none() -> None:
    assert recorded_entry({"command": "python -m bench.soak --device cuda"}) is None
    assert recorded_entry({"date": "2026-01-01"}) is None


def test_the_newest_file_of_an_entry_is_the_latest_it_produced(tmp_path: Path) -> None:
    soak = command("soak-cpu")
    write(tmp_path, "soak-cpu-20260101-tf5.25.0.json", {"date": "2026-01-01T00:00:00+00:00", "command": soak})
    latest = write(tmp_path, "soak-cpu-20260301-tf5.25.0.json", {"date": "2026-03-01T00:00:00+00:00", "command": soak})
    # Another entry's file, newer, and a file named like soak-cpu's that recorded another entry's command.
    write(
        tmp_path / "gpu",
        "planted-bugs-cuda-20260401.json",
        {"date": "2026-04-01", "command": command("planted-bugs-cuda")},
    )
    write(tmp_path, "soak-cpu-20260501-tf5.25.0.json", {"date": "2026-05-01", "command": command("planted-bugs-cpu")})
    write(tmp_path, "notes.txt", {})
    found = newest("soak-cpu", tmp_path)
    assert found is not None
    assert found[0] == latest
    assert found[1]["date"] == "2026-03-01T00:00:00+00:00"


def test_a_file_without_a_recorded_command_belongs_to_the_entry_its_name_matches(tmp_path: Path) -> None:
    path = write(tmp_path, "soak-cpu-20260101-tf5.25.0.json", {"date": "2026-01-01"})
    assert newest("soak-cpu", tmp_path) == (path, {"date": "2026-01-01"})
    assert newest("planted-bugs-cpu", tmp_path) is None
