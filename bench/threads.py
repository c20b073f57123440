"""What a second thread costs: the same `cachelife.generate` calls on one model, one thread against several.

    python -m bench.threads [--device cpu|cuda] [--model llama] [--calls 12] [--threads 1,2,4] [--out bench/results]

Calls on one model hold the model's lock while they decode (`cachelife.integration.runtime`), so threads
wait for each other: this measures the wall time of `--calls` calls made by one thread and by each number of
threads, each call's tokens checked equal to the same call made alone. Steps are compiled (CUDA graphs on a
GPU); one warm-up call per shape compiles and captures before anything is timed. Writes
`<out>/threads-<model>-<device>-<date>-tf<version>.json`. A benchmark, not a timed test.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import cachelife
from bench.results_file import bench_parser, results_file
from bench.timing import synchronize
from cachelife.tools import zoo
from cachelife.tools.recipe import pick_device


def run(model_name: str, device: torch.device, calls: int, thread_counts: list[int], tokens: int) -> dict[str, Any]:
    built = zoo.build(model_name, device=device)
    model = cachelife.enable(built.model)
    settings: dict[str, Any] = {"max_new_tokens": tokens, "min_new_tokens": tokens}
    prompts = [built.inputs(2, 12, seed) for seed in range(calls)]
    references = [zoo.generate_tokens(model, prompt, **settings) for prompt in prompts]

    def one(index: int) -> bool:
        got = cachelife.generate(model, fallback=False, **prompts[index], **settings)
        return isinstance(got, torch.Tensor) and torch.equal(got, references[index])

    one(0)  # compile and capture
    rows = []
    for threads in thread_counts:
        barrier = threading.Barrier(threads)

        def worker(indices: list[int], barrier: threading.Barrier = barrier) -> list[bool]:
            barrier.wait()
            return [one(index) for index in indices]

        shares = [list(range(calls))[start::threads] for start in range(threads)]
        synchronize(device)
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            results = [ok for share in pool.map(worker, shares) for ok in share]
        synchronize(device)
        seconds = time.perf_counter() - started
        rows.append(
            {"threads": threads, "seconds": seconds, "seconds_per_call": seconds / calls, "equal": all(results)}
        )
        print(f"{threads} thread(s): {seconds:.3f} s for {calls} calls, tokens equal: {all(results)}", flush=True)
    single = rows[0]["seconds"]
    for row in rows:
        row["relative_to_first"] = row["seconds"] / single
    return {"model": model_name, "calls": calls, "new_tokens": tokens, "batch": 2, "rows": rows}


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="llama", choices=zoo.MODEL_NAMES)
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--threads", default="1,2,4", help="thread counts, the first the reference")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    device = pick_device(args.device)
    counts = [int(count) for count in args.threads.split(",")]
    results = results_file(args.out, f"threads-{args.model}", device, "threads", {})
    result = run(args.model, device, args.calls, counts, args.new_tokens)
    results.record.update(result)
    results.finish()
    return 0 if all(row["equal"] for row in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
