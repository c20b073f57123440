"""Where a benchmark writes its JSON, and the environment every results file starts with."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

import cachelife

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = os.environ.get("OUT", str(ROOT / "bench" / "results"))


def source_state() -> dict[str, object]:
    """The commit the benchmark ran at and whether the tree had changes (git; on a machine that got a copy of
    the tree without git, the environment variables CACHELIFE_COMMIT and CACHELIFE_DIRTY say it)."""
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
        return {
            "commit": os.environ.get("CACHELIFE_COMMIT", "unknown"),
            "dirty": os.environ.get("CACHELIFE_DIRTY", "unknown"),
        }


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
