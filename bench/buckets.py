"""Encoder-length buckets: compiled generate over many encoder lengths, with and without buckets.

    python -m bench.buckets [--device cuda|cpu] [--calls 20] [--new-tokens 64] [--out bench/results]

On the t5-small-shaped zoo model (`--model`) (seeded random weights, batch 4), cachelife enabled and `model.forward`
compiled as in bench/decode.py (`mode="reduce-overhead"` on CUDA, inductor's default on a CPU, fullgraph),
`--calls` generate calls whose encoder lengths are spread over `--min-length`..`--bucket` (33..64 by default,
all inside the bucket 64), in a fixed shuffled order, on two paths in one process, each on a fresh model
and a fresh dynamo:

- `no_buckets`: `cachelife.enable(model)`: every encoder length is its own cross-attention shape;
- `buckets`: `cachelife.enable(model, encoder_buckets=(64, 128, 256, 512))`: every length is padded to 64.

Per path: dynamo compilations (frames compiled, first call and later calls), graphs compiled
(`unique_graphs`), CUDA-graph recordings, unexpected re-records and skips (0 and None without CUDA), the
latency of every call and the mean and median after the first, and whether every call's tokens equal eager
dynamic-cache `generate` without padding. The padding cost: the marginal time per decoding step ((time for
`--new-tokens` tokens - time for a quarter of them) / the difference, best of 2) for an input of
`--min-length` positions, padded to the bucket on the buckets path, against a third, fresh model and dynamo
that only ever sees that length (graphs specialised to the real length). The no-buckets path's marginal
times after its calls (at `--min-length` and at the bucket's length) are reported too. Results go to
`<out>/buckets-<device>-<date>-tf<version>.json`.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.callback import CallbackArgs, callback_handler

import cachelife
from bench.results_file import bench_parser, results_file
from bench.timing import greedy, timed
from cachelife.tools import zoo
from cachelife.tools.recipe import CudaGraphHealth, pick_device

BATCH, BUCKETS, REPEATS = 4, (64, 128, 256, 512), 2


class CompileEvents:
    """Counts dynamo's compilation starts by trigger: `DYNAMO` (a frame compiled or recompiled) and
    `CUDAGRAPH_RECORDING` (a CUDA graph recorded), through torch's compile callback handler."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        callback_handler.register_start_callback(self.on_start)

    def on_start(self, args: CallbackArgs) -> None:
        self.counts[args.callback_trigger.name] += 1

    def close(self) -> None:
        callback_handler.remove_start_callback(self.on_start)

    def snapshot(self) -> dict[str, int]:
        return {"dynamo": self.counts["DYNAMO"], "cudagraph_recordings": self.counts["CUDAGRAPH_RECORDING"]}


def generate_call(built: zoo.ZooModel, length: int, tokens: int) -> Callable[[], torch.Tensor]:
    """Static-cache `generate` on the seeded inputs of one encoder length."""
    inputs = built.inputs(BATCH, length, length)
    return lambda: zoo.generate_tokens(built.model, inputs, **greedy(tokens), cache_implementation="static")


def spread(calls: int, low: int, high: int) -> list[int]:
    """`calls` encoder lengths spread evenly over low..high (both ends included), in a fixed shuffled order."""
    if calls == 1:
        return [high]
    lengths = [low + round(index * (high - low) / (calls - 1)) for index in range(calls)]
    random.Random(0).shuffle(lengths)
    return lengths


def measure_path(
    device: torch.device,
    *,
    model_name: str,
    lengths: list[int],
    references: dict[int, torch.Tensor],
    new_tokens: int,
    buckets: tuple[int, ...] | None,
    cost_lengths: list[int],
) -> dict[str, Any]:
    """Every call on a fresh model and a fresh dynamo, then the padding-cost timings on the same model."""
    torch._dynamo.reset()
    built = zoo.build(model_name, device=device)
    model = built.model
    cachelife.enable(model, encoder_buckets=buckets)
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    cachelife.compile_forward(model, mode=mode, fullgraph=True)
    events = CompileEvents()
    start_health, start_events = CudaGraphHealth.now(), events.snapshot()
    calls: list[dict[str, Any]] = []
    try:
        for index, length in enumerate(lengths):
            seconds, tokens = timed(device, generate_call(built, length, new_tokens))
            expected = references[length]
            health, counted = CudaGraphHealth.now(), events.snapshot()
            calls.append(
                {
                    "index": index,
                    "encoder_length": length,
                    "seconds": round(seconds, 4),
                    "tokens_equal_eager": tokens.shape == expected.shape and bool(torch.equal(tokens, expected)),
                    "dynamo_compilations": counted["dynamo"] - start_events["dynamo"],
                    "graphs_compiled": health.graphs - start_health.graphs,
                    "cudagraph_recordings": counted["cudagraph_recordings"] - start_events["cudagraph_recordings"],
                }
            )
            print(f"   call {index}: length {length}, {seconds:.2f} s, {calls[-1]}", flush=True)
        end_health, end_events = CudaGraphHealth.now(), events.snapshot()
        first = calls[0]
        after_first = [call["seconds"] for call in calls[1:]]
        result: dict[str, Any] = {
            "encoder_buckets": list(buckets) if buckets is not None else None,
            "tokens_equal_eager": all(call["tokens_equal_eager"] for call in calls),
            "first_call_s": first["seconds"],
            "mean_call_s_after_first": round(statistics.mean(after_first), 4) if after_first else None,
            "median_call_s_after_first": round(statistics.median(after_first), 4) if after_first else None,
            "dynamo_compilations_first_call": first["dynamo_compilations"],
            "dynamo_recompilations_after_first_call": end_events["dynamo"]
            - start_events["dynamo"]
            - first["dynamo_compilations"],
            "graphs_compiled_first_call": first["graphs_compiled"],
            "graphs_compiled_after_first_call": end_health.graphs - start_health.graphs - first["graphs_compiled"],
            "cudagraph_recordings_first_call": first["cudagraph_recordings"] if device.type == "cuda" else None,
            "cudagraph_recordings_after_first_call": (
                end_events["cudagraph_recordings"]
                - start_events["cudagraph_recordings"]
                - first["cudagraph_recordings"]
                if device.type == "cuda"
                else None
            ),
            "cudagraph_rerecords": end_health.rerecords - start_health.rerecords if device.type == "cuda" else None,
            "cudagraph_skips": end_health.cudagraph_skips - start_health.cudagraph_skips,
            "calls": calls,
        }
        result["marginal_ms_per_step"] = {
            str(length): marginal_ms(device, built, length, new_tokens, references) for length in cost_lengths
        }
    finally:
        events.close()
    pool = cachelife.pool_of(model)
    result["pool"] = None if pool is None else {"hits": pool.hits, "misses": pool.misses}
    return result


def measure_static_baseline(
    device: torch.device, *, model_name: str, length: int, new_tokens: int, references: dict[int, torch.Tensor]
) -> dict[str, Any]:
    """The padding cost's baseline: a fresh model and dynamo that only ever sees `length`, so its graphs are
    specialised to the real length (no buckets, and no dynamic length, which dynamo switches to once it has
    seen a second length)."""
    torch._dynamo.reset()
    built = zoo.build(model_name, device=device)
    cachelife.enable(built.model)
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    cachelife.compile_forward(built.model, mode=mode, fullgraph=True)
    start = CudaGraphHealth.now()
    first_s, tokens = timed(device, generate_call(built, length, new_tokens))
    if not torch.equal(tokens, references[length]):
        msg = f"tokens differ from eager at encoder length {length} in the static baseline"
        raise RuntimeError(msg)
    marginal = marginal_ms(device, built, length, new_tokens, references)
    return {
        "encoder_length": length,
        "first_call_s": round(first_s, 4),
        "graphs_compiled": CudaGraphHealth.now().graphs - start.graphs,
        "marginal_ms_per_step": marginal,
    }


def marginal_ms(
    device: torch.device, built: zoo.ZooModel, length: int, new_tokens: int, references: dict[int, torch.Tensor]
) -> float:
    """Marginal ms per decoding step at one encoder length: (best time for `new_tokens` tokens - best time for
    a quarter of them) / the difference. The longer call goes first, so the self-attention cache keeps the
    length every earlier call had (transformers keeps the largest one) and nothing is recompiled for it."""
    short = max(1, new_tokens // 4)
    best = {}
    for tokens in (new_tokens, short):
        times = []
        for _ in range(REPEATS):
            seconds, out = timed(device, generate_call(built, length, tokens))
            times.append(seconds)
            if tokens == new_tokens and not torch.equal(out, references[length]):
                msg = f"tokens differ from eager at encoder length {length} while timing the padding cost"
                raise RuntimeError(msg)
        best[tokens] = min(times)
    return round(1000 * (best[new_tokens] - best[short]) / (new_tokens - short), 3)


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="t5-small", help="a bucketable zoo model (t5, t5-small, bart, bart-small)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-length", type=int, default=33)
    parser.add_argument("--bucket", type=int, default=64, choices=BUCKETS)
    args = parser.parse_args()
    if not 1 <= args.min_length <= args.bucket or args.calls < 1 or args.new_tokens < 4:
        parser.error("need 1 <= --min-length <= --bucket, --calls >= 1 and --new-tokens >= 4")
    device = pick_device(args.device)
    lengths = spread(args.calls, args.min_length, args.bucket)
    cost_lengths = sorted({args.min_length, args.bucket})
    settings = {
        "model": args.model, "batch_size": BATCH, "new_tokens": args.new_tokens, "calls": args.calls,
        "encoder_lengths": lengths, "encoder_buckets": list(BUCKETS), "dtype": "float32",
        "compile": {"mode": "reduce-overhead" if device.type == "cuda" else "default", "fullgraph": True},
        "dynamo_recompile_limit": torch._dynamo.config.recompile_limit,
        "dynamo_automatic_dynamic_shapes": torch._dynamo.config.automatic_dynamic_shapes,
    }  # fmt: skip
    results = results_file(args.out, "buckets", device, "buckets", {"settings": settings, "paths": {}})
    record = results.record
    print(f"== eager references for {len(set(lengths) | set(cost_lengths))} encoder lengths", flush=True)
    reference_model = zoo.build(args.model, device=device)
    references = {
        length: zoo.generate_tokens(
            reference_model.model, reference_model.inputs(BATCH, length, length), **greedy(args.new_tokens),
            disable_compile=True,
        )
        for length in sorted(set(lengths) | set(cost_lengths))
    }  # fmt: skip
    del reference_model
    for name, buckets in (("no_buckets", None), ("buckets", BUCKETS)):
        print(f"== {name}", flush=True)
        record["paths"][name] = measure_path(
            device, model_name=args.model, lengths=lengths, references=references, new_tokens=args.new_tokens,
            buckets=buckets, cost_lengths=cost_lengths,
        )  # fmt: skip
        results.save()
    print(f"== static baseline at encoder length {args.min_length}", flush=True)
    baseline = measure_static_baseline(
        device, model_name=args.model, length=args.min_length, new_tokens=args.new_tokens, references=references
    )
    dynamic = record["paths"]["no_buckets"]["marginal_ms_per_step"]
    padded = record["paths"]["buckets"]["marginal_ms_per_step"]
    low = str(args.min_length)
    record["padding_cost"] = {
        "encoder_length": args.min_length,
        "bucket": args.bucket,
        "static_baseline": baseline,
        "marginal_ms_per_step_real_length_static_graph": baseline["marginal_ms_per_step"],
        "marginal_ms_per_step_padded_to_bucket": padded[low],
        "extra_ms_per_step": round(padded[low] - baseline["marginal_ms_per_step"], 3),
        "marginal_ms_per_step_no_buckets_after_calls": dynamic,
    }
    print(json.dumps({name: {k: v for k, v in p.items() if k != "calls"} for name, p in record["paths"].items()}))
    print(json.dumps(record["padding_cost"]))
    results.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
