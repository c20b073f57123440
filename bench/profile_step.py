"""Where one decode step's time goes: the kernels of `cachelife.decode`'s compiled step, grouped by kind.

    python -m bench.profile_step [--device cuda|cpu] [--model t5-small] [--batch-sizes 1,8]
                                 [--dtype bfloat16] [--bandwidth 4.8e12]

For each batch size (input length 48): `cachelife.decode` with one compiled step per call (CUDA graphs on a
GPU) is warmed up, then profiled with torch.profiler for 64 and for 192 new tokens; every number per step is
(192-token run - 64-token run) / 128, so prefill drops out. The two runs' caches hold 65 and 193 positions and
SDPA over a static cache reads every position, so attention's share comes out somewhat above that of one step
over 193 positions. Kernels are grouped by name, first match wins: attention (sdpa, flash, fmha, attention),
matrix products (gemm, gemv, split-K, mm, matmul, cutlass, cuBLAS's xmma and nvjet; linear on a CPU), cache
writes (index_copy, index_put, scatter), norms (norm, rms, rsqrt), other fused triton kernels (triton_),
copies (copy, memcpy, memset, cat), other. Per group: kernels and GPU time per step, and the ten costliest
kernel names. Per step: total kernel time, wall time (marginal, as bench/decode_loop.py measures it), and the
bytes that must at least be read: the weights of every linear layer the step runs (found by counting calls in
an eager step; cross-attention key/value projections run at prefill only) for matrix products, and the whole
pinned cache's keys and values (193 positions) for attention; against `--bandwidth` bytes per second, the time
that floor takes and the fraction of it a group reaches. On a CPU it profiles CPU operators (self time, summed
over threads) instead: kernel grouping needs CUDA.
Writes `<out>/profile-step-<device>-<date>.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import PreTrainedModel

import cachelife
from bench.models import for_decode
from bench.results_file import DEFAULT_OUT, header, results_path
from bench.timing import timed
from cachelife.generation.decode import decode
from cachelife.tools import zoo
from cachelife.tools.recipe import pick_device

LENGTH, SHORT, LONG, REPEATS = 48, 64, 192, 3

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


def step_weight_bytes(model: PreTrainedModel, inputs: zoo.Inputs) -> int:
    """Bytes of the weights (and biases) of every linear layer an eager decode step calls: prefill calls each
    used layer once, each of 2 later steps once more, so a layer called more than once runs every step."""
    calls: Counter[torch.nn.Module] = Counter()
    handles = [
        module.register_forward_hook(lambda module, _args, _output: calls.update([module]))
        for module in model.modules()
        if isinstance(module, torch.nn.Linear)
    ]
    try:
        decode(model, inputs, max_new_tokens=3, compile_step=False)
    finally:
        for handle in handles:
            handle.remove()
    tensors = {p.data_ptr(): p for m, n in calls.items() if n > 1 for p in m.parameters(recurse=False)}
    return sum(p.numel() * p.element_size() for p in tensors.values())


def cache_bytes(model: PreTrainedModel, inputs: zoo.Inputs, batch: int) -> int:
    """Bytes of keys and values in the pinned cache of a 192-token decode (cross-attention included)."""
    encoder_length = None
    if model.config.is_encoder_decoder:
        with torch.no_grad():
            encoder_length = int(model.get_encoder()(**inputs)[0].shape[1])
    cache = cachelife.prepare_static_cache(
        model, batch_size=batch, max_cache_len=LONG + 1, encoder_length=encoder_length
    )
    state = cachelife.lifecycle(cache)
    pinned = [layer.buffers for layer in state.layers if layer.is_pinned]
    state.release()
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
    built = for_decode(args.model, device=device, dtype=getattr(torch, args.dtype))
    model = built.model
    inputs = built.inputs(batch, LENGTH, 1)
    cachelife.enable(model)
    weight_bytes = step_weight_bytes(model, inputs)
    kv_bytes = cache_bytes(model, inputs, batch)

    def run(tokens: int) -> torch.Tensor:
        return decode(model, inputs, max_new_tokens=tokens, steps_per_call=1)

    first_call_s, _ = timed(device, lambda: run(LONG))
    run(SHORT)  # CUDA graphs: the 64-token cache is another shape, recorded here and not in the profile
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
        "bandwidth_floor": floors(groups, weight_bytes, kv_bytes, args.bandwidth) if device.type == "cuda" else None,
        "weight_bytes_per_step": weight_bytes,
        "kv_cache_bytes": kv_bytes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default="t5-small")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="device memory bandwidth, bytes per second")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args()
    device = pick_device(args.device)
    if device.type != "cuda":
        print("note: no CUDA device; grouping CPU operators by self time (GPU kernel grouping needs CUDA)", flush=True)
    record: dict[str, Any] = {
        **header("profile-step", device),
        "settings": {
            "model": args.model, "dtype": args.dtype, "input_length": LENGTH, "new_tokens": [SHORT, LONG],
            "steps_per_call": 1, "bandwidth_bytes_per_s": args.bandwidth,
        },
        "results": [],
    }  # fmt: skip
    out = results_path(args.out, "profile-step", device)
    for batch in (int(value) for value in args.batch_sizes.split(",")):
        record["results"].append(measure(args, device, batch))
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps(record["results"][-1]), flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
