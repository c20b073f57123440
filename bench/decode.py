"""Decoding benchmark: transformers' paths and cachelife's, side by side, in one process per device.

    python -m bench.decode [--device cuda|cpu] [--models t5-small,bart-small,...] [--out bench/results]

For each model (built by cachelife.tools.zoo with seeded random weights; batch 4, encoder/prompt length 48), on
the same inputs, it measures:

- `vanilla_compiled_forward`: transformers as released with `model.forward = torch.compile(...,
  mode="reduce-overhead" on CUDA, fullgraph=True)` and `cache_implementation="static"`. It runs in a
  subprocess (`python -m cachelife recipe --without-cachelife`), which on a GPU may die of a signal.
- `eager_dynamic`: eager `generate` with the default dynamic cache.
- `transformers_auto_compile`: transformers' decode-only auto-compile (`compile_config`, static cache).
- `cachelife_compiled_forward`: cachelife enabled, `model.forward` compiled as above.
- `cachelife_auto_compile`: cachelife enabled, transformers' auto-compile.

Per path: first-call latency (includes compilation), second-call latency, steady-state marginal ms per
decoding step ((time for 192 new tokens - time for 64) / 128, best of 3), whether every call's tokens equal
eager, CUDA-graph skips, unexpected re-records over 5 same-shape calls after the first, dynamo graphs
compiled after the first call (recompiles), and peak device memory. Results go to
`<out>/decode-<device>-<date>.json` with date, device, torch and transformers versions.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers import CompileConfig

import cachelife
from bench.results_file import ROOT, bench_parser, results_file
from bench.timing import greedy, marginal_runs, timed
from cachelife.tools import zoo
from cachelife.tools.recipe import CudaGraphHealth, pick_device

BATCH, LENGTH, SHORT, LONG, REPEATS, SAME_SHAPE_CALLS = 4, 48, 64, 192, 3, 5


def measure_path(
    name: str, device: torch.device, extra: dict[str, Any], prepare: Callable[[zoo.ZooModel], None] | None
) -> dict[str, Any]:
    """One path on a fresh copy of the model (same seed, same weights, same inputs), compiled afresh."""
    torch._dynamo.reset()  # each path pays its own compilation; no graphs or CUDA-graph trees carried over
    built = zoo.build(name, device=device)
    model = built.model
    inputs = built.inputs(BATCH, LENGTH, 1)
    references = {
        tokens: zoo.generate_tokens(model, inputs, **greedy(tokens), disable_compile=True) for tokens in (SHORT, LONG)
    }
    if prepare is not None:
        prepare(built)
    baseline = 0
    if device.type == "cuda":
        gc.collect()  # earlier paths' models and traced caches, so their memory does not count here
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    start = CudaGraphHealth.now()

    def generate(tokens: int) -> tuple[float, bool]:
        seconds, out = timed(device, lambda: zoo.generate_tokens(model, inputs, **greedy(tokens), **extra))
        return seconds, out.shape == references[tokens].shape and bool(torch.equal(out, references[tokens]))

    # The long call first: transformers keeps the largest static cache length seen, so every later call
    # (long or short) reuses the same cache shape and the same compiled graphs.
    first_s, first_equal = generate(LONG)
    second_s, second_equal = generate(LONG)
    after_first = CudaGraphHealth.now()
    same_shape = [generate(LONG) for _ in range(SAME_SHAPE_CALLS)]
    after_same_shape = CudaGraphHealth.now()
    timing = marginal_runs(generate, SHORT, LONG, REPEATS)
    equal = [first_equal, second_equal, *(e for _, e in same_shape)]
    end = CudaGraphHealth.now()
    return {
        "first_call_s": round(first_s, 4),
        "second_call_s": round(second_s, 4),
        "call_s": timing["call_s"],
        "marginal_ms_per_step": timing["marginal_ms_per_step"],
        "tokens_equal_eager": all(equal) and timing["all_equal"],
        "calls": len(equal) + timing["calls"],
        "cudagraph_skips": end.cudagraph_skips - start.cudagraph_skips,
        "rerecords_after_first_call": after_same_shape.rerecords - after_first.rerecords,
        "rerecords_total": end.rerecords - start.rerecords,
        "graphs_compiled": end.graphs - start.graphs,
        "recompiles_after_first_call": end.graphs - after_first.graphs,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        # Peak above what was allocated when the path started (model weights and reference tokens).
        "peak_memory_above_start_bytes": (
            torch.cuda.max_memory_allocated(device) - baseline if device.type == "cuda" else None
        ),
    }


def compile_forward(device: torch.device, with_cachelife: bool) -> Callable[[zoo.ZooModel], None]:
    def prepare(built: zoo.ZooModel) -> None:
        if with_cachelife:
            cachelife.enable(built.model)
        mode = "reduce-overhead" if device.type == "cuda" else "default"
        cachelife.compile_forward(built.model, mode=mode, fullgraph=True)

    return prepare


def enable_only(built: zoo.ZooModel) -> None:
    cachelife.enable(built.model)


def auto_compile(device: torch.device) -> dict[str, Any]:
    config = CompileConfig(fullgraph=True, mode="reduce-overhead" if device.type == "cuda" else "default")
    config._compile_all_devices = True  # transformers auto-compiles on GPUs only unless told
    return {"cache_implementation": "static", "compile_config": config}


def vanilla(names: list[str], device: torch.device) -> dict[str, dict[str, Any]]:
    """transformers' compiled-forward recipe as released, one subprocess per model (it may die of a
    signal), all at once before any timing starts."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    running = {}
    for name in names:
        command = [
            sys.executable, "-m", "cachelife", "recipe", "--json", "--without-cachelife", "--model", name,
            "--device", str(device), "--batch-size", str(BATCH), "--input-length", str(LENGTH),
            "--new-tokens", str(SHORT), "--calls", "3",
        ]  # fmt: skip
        running[name] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    results = {}
    for name, process in running.items():
        stdout, _ = process.communicate(timeout=900)
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        report = json.loads(lines[-1].removeprefix("RESULT ")) if lines else {}
        calls = report.get("calls", [])
        failure = next((call["error"].splitlines()[0] for call in calls if call["error"]), None)
        if process.returncode < 0:
            failure = f"process killed by signal {-process.returncode}"
        results[name] = {
            "returncode": process.returncode,
            "failure": failure,
            "tokens_equal_eager": [call["equal_to_eager"] for call in calls],
            "call_s": [call["seconds"] for call in calls],
            "cudagraph_skips": calls[-1]["health"]["cudagraph_skips"] if calls else None,
        }
    return results


def run(models: list[str], device: torch.device, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every path for every model; `save` gets the results so far after each model."""
    results: dict[str, Any] = {}
    vanilla_results = vanilla(models, device)
    for name in models:
        print(f"== {name}", flush=True)
        paths: dict[str, Any] = {"vanilla_compiled_forward": vanilla_results[name]}
        print(f"   vanilla: {paths['vanilla_compiled_forward']['failure']}", flush=True)
        plans: list[tuple[str, dict[str, Any], Callable[[zoo.ZooModel], None] | None]] = [
            ("eager_dynamic", {}, None),
            ("transformers_auto_compile", auto_compile(device), None),
            ("cachelife_compiled_forward", {"cache_implementation": "static"}, compile_forward(device, True)),
            ("cachelife_auto_compile", auto_compile(device), enable_only),
        ]
        for path, extra, prepare in plans:
            paths[path] = measure_path(name, device, extra, prepare)
            summary = paths[path]
            print(
                f"   {path}: marginal {summary['marginal_ms_per_step']} ms/step, first {summary['first_call_s']} s, "
                f"equal {summary['tokens_equal_eager']}, skips {summary['cudagraph_skips']}, "
                f"rerecords {summary['rerecords_after_first_call']}",
                flush=True,
            )
        results[name] = paths
        save(results)
    return results


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--models", default="t5-small,bart-small,whisper-small,llama-small")
    args = parser.parse_args()
    device = pick_device(args.device)
    settings = {"batch_size": BATCH, "input_length": LENGTH, "new_tokens": [SHORT, LONG], "dtype": "float32"}
    results = results_file(args.out, "decode", device, "decode", {"settings": settings, "models": {}})
    run(args.models.split(","), device, functools.partial(results.put, "models"))
    results.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
