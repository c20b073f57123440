"""Soak: many consecutive `generate` calls with cachelife enabled; memory must stay flat, tokens equal eager.

    python -m bench.soak [--device cpu|cuda] [--calls 200] [--model t5] [--compile] [--out bench/results]

Each call uses another prompt of the same length (seeded), and is compared with eager dynamic-cache
generation of that prompt. Records resident memory (and CUDA allocated bytes) after the warm-up calls and
at the end, the pool's hits and misses, CUDA-graph skips and re-records, and seconds per call; writes
`<out>/soak-<device>-<date>.json`. A benchmark, not a timed test.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from typing import Any

import torch

import cachelife
from bench.results_file import bench_parser, results_file
from cachelife.tools import zoo
from cachelife.tools.recipe import CudaGraphHealth, pick_device

WARMUP = 10


def resident_bytes() -> int:
    """This process's resident set size, from /proc (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory(device: torch.device) -> dict[str, int]:
    gc.collect()
    sample = {"rss_bytes": resident_bytes()}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        sample["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device)
    return sample


def soak(model_name: str, device: torch.device, calls: int, compile_forward: bool, new_tokens: int) -> dict[str, Any]:
    if calls <= WARMUP:
        msg = f"calls must exceed the {WARMUP} warm-up calls, got {calls}"
        raise ValueError(msg)
    built = zoo.build(model_name, device=device)
    model = built.model
    settings = {"do_sample": False, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    prompts = [built.inputs(4, 24, seed) for seed in range(calls)]
    references = [zoo.generate_tokens(model, prompt, **settings, disable_compile=True) for prompt in prompts]
    cachelife.enable(model)
    if compile_forward:
        mode = "reduce-overhead" if device.type == "cuda" else "default"
        cachelife.compile_forward(model, mode=mode, fullgraph=True)
    equal, seconds, samples = [], [], {}
    start = CudaGraphHealth.now()
    for index, (prompt, reference) in enumerate(zip(prompts, references, strict=True)):
        started = time.perf_counter()
        tokens = zoo.generate_tokens(model, prompt, **settings, cache_implementation="static")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
        equal.append(bool(torch.equal(tokens, reference)))
        if index + 1 == WARMUP:
            samples["after_warmup"] = memory(device)
            after_warmup = CudaGraphHealth.now()
    samples["end"] = memory(device)
    end = CudaGraphHealth.now()
    pool = cachelife.pool_of(model)
    return {
        "model": model_name,
        "calls": calls,
        "compiled_forward": compile_forward,
        "new_tokens": new_tokens,
        "tokens_equal_eager": all(equal),
        "calls_not_equal": [i for i, ok in enumerate(equal) if not ok],
        "memory": samples,
        "rss_growth_after_warmup_bytes": samples["end"]["rss_bytes"] - samples["after_warmup"]["rss_bytes"],
        "cuda_growth_after_warmup_bytes": (
            samples["end"]["cuda_allocated_bytes"] - samples["after_warmup"]["cuda_allocated_bytes"]
            if device.type == "cuda"
            else None
        ),
        "pool": None if pool is None else {"hits": pool.hits, "misses": pool.misses, "idle_bytes": pool.idle_bytes},
        "cudagraph_skips": end.cudagraph_skips - start.cudagraph_skips,
        "rerecords_after_warmup": end.rerecords - after_warmup.rerecords,
        "seconds_per_call": {
            "first": round(seconds[0], 4),
            "median_after_warmup": round(sorted(seconds[WARMUP:])[len(seconds[WARMUP:]) // 2], 4),
        },
    }


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="t5")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--compile", action="store_true", help="compile model.forward (CUDA graphs on a GPU)")
    args = parser.parse_args()
    device = pick_device(args.device)
    results = results_file(args.out, "soak-compiled" if args.compile else "soak", device, "soak", {})
    result = soak(args.model, device, args.calls, args.compile, args.new_tokens)
    print(
        f"{args.calls} calls: tokens equal eager {result['tokens_equal_eager']}, RSS growth after warm-up "
        f"{result['rss_growth_after_warmup_bytes'] / 2**20:.1f} MiB, pool {result['pool']}, "
        f"re-records {result['rerecords_after_warmup']}"
    )
    results.put("result", result)
    results.finish()
    return 0 if result["tokens_equal_eager"] else 1


if __name__ == "__main__":
    sys.exit(main())
