"""Beam-search benchmark: `generate(num_beams=4)` on every path, side by side, in one process.

    python -m bench.beams [--device cuda|cpu] [--models t5-small,...] [--beams 4] [--out bench/results]

For each model (cachelife.tools.zoo, seeded random weights; batch 2, encoder/prompt length 48, fp32), on the same
inputs, with exactly N new tokens (min_new_tokens = max_new_tokens, so no beam ends early):

- `eager_dynamic`: eager beam search with the default dynamic cache (the reference tokens).
- `transformers_auto_compile`: transformers' decode-only auto-compile (`compile_config`, static cache).
- `cachelife_compiled_forward_before`: cachelife enabled and `model.forward` compiled (`reduce-overhead` on
  CUDA, `fullgraph=True`), with the behaviour of cachelife before in-place beam reorders: transformers'
  `reorder_cache` replaces every layer's tensors and nothing restores them (emulated by switching off
  `cachelife.core.reorder.install` and the guard's replaced-tensor check for this path only).
- `cachelife_compiled_forward`: the same with cachelife as it is: in-place reorders, cross-attention reorders
  skipped (every beam of one input holds the same rows).
- `cachelife_compiled_forward_cross_reordered`: the same, but cross-attention layers reordered in place
  too, to measure what skipping them saves.

Per path (each compiled in a fresh compile-cache directory on disk; kernels built earlier in the process
are reused from memory, so only the first path's first call shows a cold compile): marginal ms per step
((time for LONG tokens - time for SHORT) / (LONG - SHORT), best of 3), first and second call seconds, tokens
equal eager, CUDA-graph skips, re-records after the first call, and dynamo recompiles. Results go to
`<out>/beams-<device>-<date>-tf<version>.json`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import CompileConfig

import cachelife
from bench.results_file import bench_parser, results_file
from bench.timing import marginal_runs, timed
from cachelife.core import reorder
from cachelife.integration import guard
from cachelife.tools import zoo
from cachelife.tools.recipe import CudaGraphHealth, pick_device

BATCH, LENGTH, SHORT, LONG, REPEATS = 2, 48, 16, 48, 3


def beam_settings(beams: int, tokens: int) -> dict[str, Any]:
    return {"do_sample": False, "num_beams": beams, "max_new_tokens": tokens, "min_new_tokens": tokens}


@contextlib.contextmanager
def unchanged() -> Iterator[None]:
    yield


@contextlib.contextmanager
def before_in_place_reorders() -> Iterator[None]:
    """cachelife as it was before in-place beam reorders: transformers' reorder, replacements unnoticed."""
    install, check = reorder.install, guard.DecodingGuard.check_replaced
    reorder.install = lambda layer: None  # the emulated older release
    guard.DecodingGuard.check_replaced = lambda self, module, state: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        reorder.install = install
        guard.DecodingGuard.check_replaced = check  # type: ignore[method-assign]


@contextlib.contextmanager
def cross_reordered() -> Iterator[None]:
    """In-place reorders of cross-attention layers too (their rows are never declared shared)."""
    share = reorder.share_rows_within_beams
    reorder.share_rows_within_beams = lambda layer, shared=True: None
    try:
        yield
    finally:
        reorder.share_rows_within_beams = share


def measure_path(
    name: str,
    device: torch.device,
    *,
    beams: int,
    extra: dict[str, Any],
    prepare: Callable[[zoo.ZooModel], None] | None,
    variant: Callable[[], contextlib.AbstractContextManager[None]],
) -> dict[str, Any]:
    """One path on a fresh copy of the model (same seed, weights and inputs), compiled afresh in a compile
    cache directory of its own: no path loads another's graphs (or, on torch 2.11 and 2.12, their CUDA-graph
    skips, since static inputs are not part of the cache key there)."""
    torch._dynamo.reset()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"beams-{name}-")
    built = zoo.build(name, device=device)
    model = built.model
    inputs = built.inputs(BATCH, LENGTH, 1)
    references = {
        tokens: zoo.generate_tokens(model, inputs, **beam_settings(beams, tokens), disable_compile=True)
        for tokens in (SHORT, LONG)
    }
    if prepare is not None:
        prepare(built)
    start = CudaGraphHealth.now()

    def generate(tokens: int) -> tuple[float, bool]:
        seconds, out = timed(
            device, lambda: zoo.generate_tokens(model, inputs, **beam_settings(beams, tokens), **extra)
        )
        return seconds, out.shape == references[tokens].shape and bool(torch.equal(out, references[tokens]))

    with variant():
        first_s, first_equal = generate(LONG)
        second_s, second_equal = generate(LONG)
        after_first = CudaGraphHealth.now()
        timing = marginal_runs(generate, SHORT, LONG, REPEATS)
    end = CudaGraphHealth.now()
    return {
        "first_call_s": round(first_s, 4),
        "second_call_s": round(second_s, 4),
        "call_s": timing["call_s"],
        "marginal_ms_per_step": timing["marginal_ms_per_step"],
        "tokens_equal_eager": first_equal and second_equal and timing["all_equal"],
        "calls": 2 + timing["calls"],
        "cudagraph_skips": end.cudagraph_skips - start.cudagraph_skips,
        "cudagraph_skips_after_first_call": end.cudagraph_skips - after_first.cudagraph_skips,
        "rerecords_after_first_call": end.rerecords - after_first.rerecords,
        "recompiles_after_first_call": end.graphs - after_first.graphs,
    }


def compile_forward(device: torch.device) -> Callable[[zoo.ZooModel], None]:
    def prepare(built: zoo.ZooModel) -> None:
        cachelife.enable(built.model)
        mode = "reduce-overhead" if device.type == "cuda" else "default"
        cachelife.compile_forward(built.model, mode=mode, fullgraph=True)

    return prepare


def auto_compile(device: torch.device) -> dict[str, Any]:
    config = CompileConfig(fullgraph=True, mode="reduce-overhead" if device.type == "cuda" else "default")
    config._compile_all_devices = True  # transformers auto-compiles on GPUs only unless told
    return {"cache_implementation": "static", "compile_config": config}


def run(models: list[str], device: torch.device, beams: int, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    static = {"cache_implementation": "static"}
    for name in models:
        print(f"== {name}", flush=True)
        plans: list[
            tuple[
                str,
                dict[str, Any],
                Callable[[zoo.ZooModel], None] | None,
                Callable[[], contextlib.AbstractContextManager[None]],
            ]
        ] = [
            ("eager_dynamic", {}, None, unchanged),
            ("transformers_auto_compile", auto_compile(device), None, unchanged),
            ("cachelife_compiled_forward", static, compile_forward(device), unchanged),
            ("cachelife_compiled_forward_cross_reordered", static, compile_forward(device), cross_reordered),
            ("cachelife_compiled_forward_before", static, compile_forward(device), before_in_place_reorders),
        ]
        paths: dict[str, Any] = {}
        for path, extra, prepare, variant in plans:
            paths[path] = measure_path(name, device, beams=beams, extra=extra, prepare=prepare, variant=variant)
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
    parser.add_argument("--models", default="t5-small", help="comma-separated zoo models (default: t5-small)")
    parser.add_argument("--beams", type=int, default=4, help="num_beams (default: 4)")
    args = parser.parse_args()
    device = pick_device(args.device)
    settings = {
        "batch_size": BATCH, "input_length": LENGTH, "num_beams": args.beams, "new_tokens": [SHORT, LONG],
        "dtype": "float32",
    }  # fmt: skip
    results = results_file(args.out, "beams", device, "beams", {"settings": settings, "models": {}})
    run(args.models.split(","), device, args.beams, functools.partial(results.put, "models"))
    results.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
