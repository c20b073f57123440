"""The harness every bench script shares: its command line's common flags, where it writes its JSON, and the
environment every results file starts with.

A script's main() is `parser = bench_parser(__doc__)`, its own flags, `results = results_file(...)` before it
measures (the header's date, commit and dirty flag are those of the start), then `results.add(...)` or
`results.put(...)`, which rewrite the file after each measurement (a run cut by a time limit keeps what it
measured), and `results.finish()`, which says where it wrote.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from attrs import frozen

import cachelife

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = os.environ.get("OUT", str(ROOT / "bench" / "results"))


def source_state() -> dict[str, object]:
    """The commit the benchmark ran at and whether the tree had changes: the environment variables
    CACHELIFE_COMMIT and CACHELIFE_DIRTY where set (a machine that got a copy of the tree, whose git, if any, is
    not the tree's), else git."""
    if "CACHELIFE_COMMIT" in os.environ:
        stated = os.environ.get("CACHELIFE_DIRTY", "unknown").lower()
        dirty: bool | str = {"0": False, "false": False, "1": True, "true": True}.get(stated, "unknown")
        return {"commit": os.environ["CACHELIFE_COMMIT"], "dirty": dirty}
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True,
            check=True, timeout=10,
        ).stdout  # fmt: skip
        return {"commit": commit, "dirty": bool(status.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": "unknown"}


def header(benchmark: str, device: torch.device) -> dict[str, Any]:
    """Benchmark name, UTC date, device, the torch, transformers and cachelife versions, the commit, whether
    the tree was dirty, and the command line."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cachelife": cachelife.__version__,
        **source_state(),
        "command": " ".join(sys.orig_argv),
    }


def results_path(out: str, stem: str, device: torch.device) -> Path:
    """`<out>/<stem>-<device type>-<yyyymmdd>-tf<transformers version>.json`, creating `out`."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    return folder / f"{stem}-{device.type}-{day}-tf{transformers.__version__}.json"


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """A bench script's parser: its module docstring as the help text (layout kept), and the --device and
    --out flags every script takes."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda where available)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder the JSON results file is written to")
    return parser


@frozen
class ResultsFile:
    """A results file being filled: the header is taken once, when the benchmark starts (its date is the
    start's), and the whole record is rewritten after each measurement."""

    path: Path
    record: dict[str, Any]

    def save(self) -> Path:
        self.path.write_text(json.dumps(self.record, indent=1) + "\n")
        return self.path

    def add(self, item: object, key: str = "results", *, show: bool = True) -> None:
        """Append `item` to the record's list `key` and rewrite the file; with `show`, print the item as one JSON
        line, the run's progress in its log."""
        self.record[key].append(item)
        self.save()
        if show:
            print(json.dumps(item), flush=True)

    def put(self, key: str, value: object) -> None:
        """Set the record's `key` to `value` and rewrite the file."""
        self.record[key] = value
        self.save()

    def finish(self) -> Path:
        """Write the record a last time and say where."""
        self.save()
        print(f"wrote {self.path}", flush=True)
        return self.path


def results_file(out: str, stem: str, device: torch.device, benchmark: str, body: dict[str, Any]) -> ResultsFile:
    """`results_path(out, stem, device)` with `header(benchmark, device)` followed by `body`, not written yet."""
    return ResultsFile(results_path(out, stem, device), {**header(benchmark, device), **body})
