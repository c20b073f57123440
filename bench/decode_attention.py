"""cachelife's decode attention kernel against SDPA at the engine's shapes, and how its launch is best cut.

    python -m bench.decode_attention [--device cuda] [--dtype bfloat16] [--cases whisper-cross-16,...]
                                     [--splits 0,1,2,4,8,16] [--warps 4,8] [--block-n 0,64,128] [--stages 0]
                                     [--values-early 0] [--products 0] [--out DIR]

Each case is one attention call of a decoding step: one query per (row, head) over a static cache, as the engine's rows
or `cachelife.generate` make it (CASES: whisper-large-v3's cross-attention over 1500 encoder frames and self-attention
over 448 slots; the Llama-3.2-1B shape's grouped-query self-attention over 512 slots; 1 and 16 rows; a self-attention
row attends its first `used` slots, which differ by row). For each case: SDPA with the process's backends, SDPA
restricted to the backends a step keeps to (`sdpa_repeatable`: `cachelife.generation.repeatable`, what the rows use with
`attention="model"` and for attention without a mask), two matrix products around a float32 softmax (`products`), the op
as it plans itself (`cachelife.kernels.attention.decode_attention`), and every plan of the sweep (`--splits` x `--warps`
x `--block-n` x `--stages` x `--values-early` x `--products`, 0 meaning the plan's or Triton's own choice; with a mask,
also without the per-tile skip). Each is timed as a CUDA graph of 20 calls replayed (device time per call, the median of
5), and its largest difference from the float32 reference (`reference_decode_attention`) is kept beside SDPA's: the
verdict is that the kernel is no further from the reference than SDPA, times 2 plus one unit of the dtype's rounding.
Writes `<out>/decode-attention-<device>-<date>-tf<version>.json`. A benchmark, not a timed test.
"""

from __future__ import annotations

import functools
import itertools
import statistics
from collections.abc import Callable
from typing import Any, Final

import torch
from attrs import frozen
from torch.nn.attention import sdpa_kernel

from bench.results_file import bench_parser, results_file
from cachelife.generation.repeatable import REPEATABLE_ATTENTION
from cachelife.kernels.attention import (
    _programs,
    decode_attention,
    launch_plan,
    plan_splits,
    reference_decode_attention,
)
from cachelife.tools.recipe import pick_device


@frozen(kw_only=True)
class Case:
    """One attention call: `rows` queries of `heads` heads over `kv_heads` heads of `positions` cached slots;
    `used` > 0 masks each row to its first slots (row i attends `used + 8 * i`, capped at `positions`)."""

    rows: int
    heads: int
    kv_heads: int
    positions: int
    head_dim: int = 64
    used: int = 0


CASES: Final = {
    "whisper-cross-1": Case(rows=1, heads=20, kv_heads=20, positions=1500),
    "whisper-cross-16": Case(rows=16, heads=20, kv_heads=20, positions=1500),
    "whisper-self-16": Case(rows=16, heads=20, kv_heads=20, positions=448, used=100),
    "llama-1": Case(rows=1, heads=32, kv_heads=8, positions=512, used=128),
    "llama-16": Case(rows=16, heads=32, kv_heads=8, positions=512, used=128),
}
CALLS_PER_GRAPH: Final = 20
REPLAYS: Final = 10
MEASUREMENTS: Final = 5


def inputs(case: Case, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Query, key, value and mask (an empty tensor for none), seeded."""
    generator = torch.Generator(device="cpu").manual_seed(0)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    query = normal(case.rows, case.heads, 1, case.head_dim)
    key = normal(case.rows, case.kv_heads, case.positions, case.head_dim)
    value = normal(case.rows, case.kv_heads, case.positions, case.head_dim)
    if not case.used:
        return query, key, value, torch.empty(0, device=device)
    lengths = torch.tensor([min(case.used + 8 * row, case.positions) for row in range(case.rows)], device=device)
    mask = torch.arange(case.positions, device=device)[None, :] < lengths[:, None]
    return query, key, value, mask[:, None, None, :]


def device_ms_per_call(call: Callable[[], torch.Tensor]) -> float:
    """The median over MEASUREMENTS of a CUDA graph of CALLS_PER_GRAPH calls replayed REPLAYS times, in ms per call."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves it untyped
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            call()
    graph.replay()
    times = []
    for _ in range(MEASUREMENTS):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # as above
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / (REPLAYS * CALLS_PER_GRAPH))
    return statistics.median(times)


def largest_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    return float((output.float() - reference.float()).abs().max())


def measure_case(name: str, case: Case, args: Any, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    query, key, value, mask_or_empty = inputs(case, device, dtype)
    mask = mask_or_empty if mask_or_empty.numel() else None
    reference = reference_decode_attention(query.float(), key.float(), value.float(), mask)
    group = case.heads // case.kv_heads

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)

    rounding = torch.finfo(dtype).eps
    sdpa_error = largest_error(sdpa(), reference)
    bound = 2 * sdpa_error + rounding

    def repeatable() -> torch.Tensor:
        with sdpa_kernel(list(REPEATABLE_ATTENTION)):
            return sdpa()

    def products() -> torch.Tensor:
        keys = key.repeat_interleave(group, dim=1) if group > 1 else key
        values = value.repeat_interleave(group, dim=1) if group > 1 else value
        scores = torch.matmul(query, keys.transpose(-1, -2)).float() * case.head_dim**-0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(-1).to(dtype), values)

    found: dict[str, Any] = {
        "case": name,
        "shape": {"rows": case.rows, "heads": case.heads, "kv_heads": case.kv_heads, "positions": case.positions,
                  "head_dim": case.head_dim, "used": case.used},
        "sdpa": {"ms": round(device_ms_per_call(sdpa), 4), "error": sdpa_error},
        "sdpa_repeatable": {"ms": round(device_ms_per_call(repeatable), 4),
                            "error": largest_error(repeatable(), reference)},
        "products": {"ms": round(device_ms_per_call(products), 4), "error": largest_error(products(), reference)},
    }  # fmt: skip
    own_error = largest_error(decode_attention(query, key, value, mask), reference)
    own_ms = device_ms_per_call(lambda: decode_attention(query, key, value, mask))
    found["op"] = {"ms": round(own_ms, 4), "error": own_error, "within_bound": own_error <= bound}
    plans = []
    skips = (None, True) if mask is None else (None, False)
    sweep = itertools.product(
        _ints(args.splits), _ints(args.warps), _ints(args.block_n), skips, _ints(args.stages),
        _ints(args.values_early), _ints(args.products),
    )  # fmt: skip
    for splits, warps, block_n, skip, stages, early, dots in sweep:
        plan = plan_splits(
            batch=case.rows, kv_heads=case.kv_heads, group=group, positions=case.positions, key_dim=case.head_dim,
            value_dim=case.head_dim, programs=_programs(device), splits=splits or None, block_n=block_n or None,
        )  # fmt: skip

        launch = functools.partial(
            launch_plan, query, key, value, mask, scale=case.head_dim**-0.5, plan=plan, num_warps=warps,
            skip_empty=skip, num_stages=stages or None, values_early=bool(early), products=bool(dots),
        )  # fmt: skip
        error = largest_error(launch(), reference)
        plans.append({
            "splits": plan.splits, "block_n": plan.block_n, "warps": warps, "skip_empty": skip, "stages": stages,
            "values_early": bool(early), "products": bool(dots),
            "ms": round(device_ms_per_call(launch), 4), "error": error, "within_bound": error <= bound,
        })  # fmt: skip
    found["plans"] = sorted(plans, key=lambda plan: plan["ms"])
    found["best_plan"] = found["plans"][0]
    found["op_to_sdpa"] = round(found["op"]["ms"] / found["sdpa"]["ms"], 3)
    found["op_to_sdpa_repeatable"] = round(found["op"]["ms"] / found["sdpa_repeatable"]["ms"], 3)
    found["best_to_op"] = round(found["best_plan"]["ms"] / found["op"]["ms"], 3)
    found["verdict"] = {"bound": bound, "all_within_bound": found["op"]["within_bound"]
                        and all(plan["within_bound"] for plan in plans)}  # fmt: skip
    return found


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--splits", default="0,1,2,4,8,16")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--block-n", default="0,64,128")
    parser.add_argument("--stages", default="0", help="phase 1's pipelined tiles; 0: Triton's default")
    parser.add_argument("--values-early", default="0", help="0, 1 or both: read a tile's values before its scores")
    parser.add_argument("--products", default="0", help="0, 1 or both: scores and weighted values as matrix products")
    args = parser.parse_args()
    device = pick_device(args.device)
    if device.type != "cuda":
        parser.error(f"this benchmark times CUDA graphs: it needs a CUDA device, got {device}")
    dtype = getattr(torch, args.dtype)
    out = results_file(args.out, "decode-attention", device, "bench.decode_attention", {
        "dtype": args.dtype, "calls_per_graph": CALLS_PER_GRAPH, "replays": REPLAYS, "results": [],
    })  # fmt: skip
    with torch.inference_mode():
        for name in args.cases.split(","):
            out.add(measure_case(name, CASES[name], args, device, dtype))
    out.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
