"""Render a decode benchmark results file as the Markdown table README.md shows.

python -m bench.table bench/results/decode-cuda-20261130-tf5.24.0.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PATHS = (
    ("vanilla_compiled_forward", "transformers, compiled forward (as released)"),
    ("eager_dynamic", "transformers, eager, dynamic cache"),
    ("transformers_auto_compile", "transformers, auto-compile (`compile_config`)"),
    ("cachelife_compiled_forward", "cachelife, compiled forward"),
    ("cachelife_auto_compile", "cachelife, auto-compile"),
)


def render(record: dict[str, Any]) -> str:
    settings = record["settings"]
    lines = [
        f"{record['device']}, torch {record['torch']}, transformers {record['transformers']}, {record['date'][:10]}; "
        f"batch {settings['batch_size']}, input length {settings['input_length']}, {settings['dtype']}, greedy.",
        "",
        "| model | path | marginal ms/step | 1st call s | 2nd call s | = eager | skips | re-records | recompiles |"
        " peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, paths in record["models"].items():
        for key, label in PATHS:
            path = paths.get(key)
            if path is None:
                continue
            if key == "vanilla_compiled_forward":
                if path["failure"]:
                    outcome = f"fails: {path['failure'][:70]}"
                else:
                    equal = "yes" if all(path["tokens_equal_eager"]) else "NO"
                    outcome = f"runs ({len(path['call_s'])} calls, tokens equal eager: {equal})"
                lines.append(f"| {model} | {label} | {outcome} | | | | | | | |")
                continue
            peak = "-" if path["peak_memory_bytes"] is None else f"{path['peak_memory_bytes'] / 2**20:.0f}"
            lines.append(
                f"| {model} | {label} | {path['marginal_ms_per_step']:.2f} | {path['first_call_s']:.2f} | "
                f"{path['second_call_s']:.2f} | {'yes' if path['tokens_equal_eager'] else 'NO'} | "
                f"{path['cudagraph_skips']} | {path['rerecords_after_first_call']} | "
                f"{path['recompiles_after_first_call']} | {peak} |"
            )
    return "\n".join(lines)


def main() -> int:
    for name in sys.argv[1:]:
        print(render(json.loads(Path(name).read_text())))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
