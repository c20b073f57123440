"""Where a benchmark writes its JSON, and the environment every results file starts with."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import torch
import transformers

import cachelife

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = os.environ.get("OUT", str(ROOT / "bench" / "results"))


def header(benchmark: str, device: torch.device) -> dict[str, Any]:
    """Benchmark name, UTC date, device, and the torch, transformers and cachelife versions."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cachelife": cachelife.__version__,
    }


def results_path(out: str, stem: str, device: torch.device) -> Path:
    """`<out>/<stem>-<device type>-<yyyymmdd>-tf<transformers version>.json`, creating `out`."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    return folder / f"{stem}-{device.type}-{day}-tf{transformers.__version__}.json"
