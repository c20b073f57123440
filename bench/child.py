"""One benchmark step in a fresh process with a compile cache of its own, reporting one `RESULT {json}` line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.results_file import ROOT


def run_child(module: str, arguments: list[str], cache_dir: Path) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Run `python -m module arguments` with `cache_dir` as its inductor and Triton caches.

    Returns the child's last `RESULT` record (None if it failed or printed none) and what every caller
    reports either way: its return code, the seconds the process took and, on failure, stderr's tail.
    """
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TRITON_CACHE_DIR": str(cache_dir / "triton")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", module, *arguments], capture_output=True, text=True, env=env, cwd=ROOT, check=False
    )
    process = {"returncode": done.returncode, "process_s": time.perf_counter() - started}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        return None, {**process, "stderr_tail": done.stderr[-3000:]}
    record: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return record, process
