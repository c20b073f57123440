"""Where one decoding step's time goes: the kernels of `cachelife.generate`'s compiled step, grouped by kind.

    python -m bench.profile_step [--device cuda|cpu] [--model t5-small] [--batch-sizes 1,8]
                                 [--dtype bfloat16] [--bandwidth 4.8e12]

For each batch size (input length 48), `cachelife.generate(model, fallback=False, ...)` on the model with its
own generation config (Whisper: language "en", task "transcribe", as bench/generate.py), every call decoding
exactly N new tokens, with one compiled step per call (CUDA graphs on a GPU), is warmed up, then profiled with
torch.profiler for 64 and for 192 new tokens; every number per step is (192-token run - 64-token run) / 128,
so prefill drops out. cachelife.generate's caches hold its token buffers' width (the decoder prompt plus the
new tokens, rounded up to a multiple of 64) plus one position, and SDPA over a static cache reads every
position, so attention's share comes out somewhat above that of one step over the long run's length. Kernels
are grouped by name, first match wins: attention (sdpa, flash, fmha, attention), matrix products (gemm, gemv,
split-K, mm, matmul, cutlass, cuBLAS's xmma and nvjet; linear on a CPU), cache writes (index_copy, index_put,
scatter), norms (norm, rms, rsqrt), other fused triton kernels (triton_), copies (copy, memcpy, memset, cat),
other. Per group: kernels and GPU time per step, and the ten costliest kernel names. Per step: total kernel
time, wall time (marginal, as bench/decode_loop.py measures it), and the bytes that must at least be read: the
weights of every linear layer the step runs (found by counting calls in an eager run of the same loop,
`compile_step=False`; cross-attention key/value projections run at prefill only) for matrix products, and the
whole pinned cache's keys and values of the 192-token run (cross-attention included) for attention; against
`--bandwidth` bytes per second, the time that floor takes and the fraction of it a group reaches. On a CPU it
profiles CPU operators (self time, summed over threads) instead: kernel grouping needs CUDA.
Writes `<out>/profile-step-<device>-<date>.json`.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from attrs import frozen
from torch.profiler import ProfilerActivity, profile
from transformers import PreTrainedModel

import cachelife
from bench.generate import build, settings_for
from bench.results_file import bench_parser, results_file
from bench.timing import as_tokens, timed
from cachelife.integration.call_arguments import cache_argument_name
from cachelife.tools.recipe import pick_device

LENGTH, SHORT, LONG, REPEATS = 48, 64, 192, 3
Run = Callable[..., torch.Tensor]  # run(new_tokens, compile_step=True): the profiled loop's call

# Kernel kinds, first match wins: attention before matrix products (flash-attention and cutlass attention kernels
# carry gemm-like names), and a fused triton kernel that writes the cache is a cache write.
GROUPS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention", re.compile(r"sdpa|flash|fmha|attention|attn", re.I)),
    (
        "matrix_products",
        re.compile(r"gemm|gemv|splitk|matmul|cutlass|xmma|nvjet|cublas|linear|mkldnn|(^|[_:])(add|b)?mm(_|$|\b)", re.I),
    ),
    ("cache_writes", re.compile(r"index_copy|index_put|scatter", re.I)),
    ("norms", re.compile(r"norm|rms|rsqrt", re.I)),
    ("fused_triton", re.compile(r"triton_", re.I)),
    ("copies", re.compile(r"copy|memcpy|memset|(^|[_:])cat(_|$|\b)", re.I)),
)
OTHER = "other"


def group_of(name: str) -> str:
    return next((group for group, pattern in GROUPS if pattern.search(name)), OTHER)


def profiled_events(
    device: torch.device, run: Callable[[int], torch.Tensor], tokens: int
) -> dict[str, tuple[int, float]]:
    """Kernel (CUDA) or operator (CPU, self time) name -> (count, milliseconds) over one run."""
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as trace:
        run(tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events: dict[str, tuple[int, float]] = {}
    for event in trace.key_averages():
        if device.type == "cuda" and event.device_type.name != "CUDA":
            continue
        micros = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        events[event.key] = (event.count, micros / 1000)
    return events


def per_step_groups(short: dict[str, tuple[int, float]], long: dict[str, tuple[int, float]]) -> dict[str, Any]:
    """Per group: kernels and milliseconds per step ((long - short) / steps) and its costliest names."""
    steps = LONG - SHORT
    counts: Counter[str] = Counter()
    times: defaultdict[str, float] = defaultdict(float)
    by_name: defaultdict[str, dict[str, float]] = defaultdict(dict)
    for name, (count, ms) in long.items():
        short_count, short_ms = short.get(name, (0, 0.0))
        group = group_of(name)
        counts[group] += count - short_count
        times[group] += ms - short_ms
        by_name[group][name] = (ms - short_ms) / steps
    return {
        group: {
            "kernels_per_step": round(counts[group] / steps, 2),
            "ms_per_step": round(times[group] / steps, 4),
            "top": {name[:120]: round(ms, 4) for name, ms in sorted(by_name[group].items(), key=lambda i: -i[1])[:10]},
        }
        for group in [*(g for g, _ in GROUPS), OTHER]
        if group in times
    }


@frozen
class StepBytes:
    """The least bytes a decoding step reads: the weights of the linear layers it runs, and the pinned cache."""

    weights: int
    cache: int


def step_bytes(model: PreTrainedModel, run: Run) -> StepBytes:
    """Bytes of the weights (and biases) of every linear layer a decoding step calls, and of the keys and values
    of the cache the loop pinned (cross-attention included), from one eager run of the same loop
    (`run(LONG, compile_step=False)`): prefill calls each used layer once, each later step once more, so a layer
    called more than once runs every step; the cache is read off the model's first call, prefill's."""
    calls: Counter[torch.nn.Module] = Counter()
    caches: list[int] = []

    def count(module: torch.nn.Module, _args: object, _output: object) -> None:
        calls.update([module])

    def pinned_bytes(_module: torch.nn.Module, _args: object, kwargs: dict[str, Any]) -> None:
        cache = kwargs.get(cache_argument_name(model))
        if cache is not None and not caches:
            caches.append(cache_bytes(cache))

    handles = [module.register_forward_hook(count) for module in model.modules() if isinstance(module, torch.nn.Linear)]
    handles.append(model.register_forward_pre_hook(pinned_bytes, with_kwargs=True))
    try:
        run(LONG, compile_step=False)
    finally:
        for handle in handles:
            handle.remove()
    tensors = {p.data_ptr(): p for m, n in calls.items() if n > 1 for p in m.parameters(recurse=False)}
    return StepBytes(sum(p.numel() * p.element_size() for p in tensors.values()), caches[0] if caches else 0)


def cache_bytes(cache: object) -> int:
    """Bytes of the keys and values pinned in `cache`, a cache cachelife manages."""
    state = cachelife.lifecycle(cache)
    pinned = [layer.buffers for layer in state.layers if layer.is_pinned]
    return sum((math.prod(b.key_shape) + math.prod(b.value_shape)) * b.dtype.itemsize for b in pinned)


def marginal_wall_ms(device: torch.device, run: Callable[[int], torch.Tensor]) -> float:
    short = min(timed(device, lambda: run(SHORT))[0] for _ in range(REPEATS))
    long = min(timed(device, lambda: run(LONG))[0] for _ in range(REPEATS))
    return 1000 * (long - short) / (LONG - SHORT)


def floors(groups: dict[str, Any], weight_bytes: int, kv_bytes: int, bandwidth: float) -> dict[str, Any]:
    """Milliseconds the least bytes each group must read take at `bandwidth`, and the fraction reached."""
    result = {}
    for group, needed in (("matrix_products", weight_bytes), ("attention", kv_bytes)):
        floor_ms = 1000 * needed / bandwidth
        measured = groups.get(group, {}).get("ms_per_step")
        result[group] = {
            "min_bytes": needed,
            "floor_ms": round(floor_ms, 4),
            "achieved_fraction": round(floor_ms / measured, 3) if measured else None,
        }
    result["step"] = {
        "min_bytes": weight_bytes + kv_bytes,
        "floor_ms": round(1000 * (weight_bytes + kv_bytes) / bandwidth, 4),
    }
    return result


def measure(args: argparse.Namespace, device: torch.device, batch: int) -> dict[str, Any]:
    torch._dynamo.reset()
    built = build(args.model, False, device, getattr(torch, args.dtype))
    model = cachelife.enable(built.model)
    inputs = built.inputs(batch, LENGTH, 1)

    def run(tokens: int, *, compile_step: bool = True) -> torch.Tensor:
        out = cachelife.generate(
            model, fallback=False, steps_per_call=1, compile_step=compile_step, **inputs,
            **settings_for(args.model, 0, tokens),
        )  # fmt: skip
        return as_tokens(out)

    needed = step_bytes(model, run)
    first_call_s, _ = timed(device, lambda: run(LONG))
    run(SHORT)  # the 64-token call's buffers are another shape: compiled and captured here, not in the profile
    wall_ms = marginal_wall_ms(device, run)
    groups = per_step_groups(profiled_events(device, run, SHORT), profiled_events(device, run, LONG))
    kernel_ms = sum(group["ms_per_step"] for group in groups.values())
    return {
        "batch_size": batch,
        "first_call_s": round(first_call_s, 3),
        "wall_ms_per_step": round(wall_ms, 4),
        "time_is": "GPU kernel time" if device.type == "cuda" else "CPU operator self time (not kernels)",
        "total_ms_per_step": round(kernel_ms, 4),
        "kernels_per_step": round(sum(group["kernels_per_step"] for group in groups.values()), 2),
        "wall_over_total": round(wall_ms / kernel_ms, 3) if kernel_ms > 0 else None,
        "groups": groups,
        "bandwidth_floor": floors(groups, needed.weights, needed.cache, args.bandwidth)
        if device.type == "cuda"
        else None,
        "weight_bytes_per_step": needed.weights,
        "kv_cache_bytes": needed.cache,
    }


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="t5-small")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="device memory bandwidth, bytes per second")
    args = parser.parse_args()
    device = pick_device(args.device)
    if device.type != "cuda":
        print("note: no CUDA device; grouping CPU operators by self time (GPU kernel grouping needs CUDA)", flush=True)
    settings = {
        "model": args.model, "loop": "cachelife.generate", "generation_config": "the model's own",
        "dtype": args.dtype, "input_length": LENGTH, "new_tokens": [SHORT, LONG], "steps_per_call": 1,
        "bandwidth_bytes_per_s": args.bandwidth,
    }  # fmt: skip
    results = results_file(args.out, "profile-step", device, "profile-step", {"settings": settings, "results": []})
    for batch in (int(value) for value in args.batch_sizes.split(",")):
        results.add(measure(args, device, batch))
    results.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
