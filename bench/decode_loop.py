"""cachelife's decoding loop against `generate` with a compiled forward, and against the GPU kernel-time floor.

    python -m bench.decode_loop [--device cuda|cpu] [--model t5-small] [--dtypes float32,bfloat16]
                                [--steps-per-call 1,4]

For each dtype, in one process, on the same inputs (batch 4, encoder or prompt length 48) and the model's own
generation config, every call decoding exactly N new tokens (`min_new_tokens = max_new_tokens = N`):
- the marginal wall time per step of `cachelife.generate(model, fallback=False, ...)` (the loop users get, for
  each `steps_per_call`) and of `model.generate` with cachelife and a compiled forward (casts rounded as eager
  rounds them, as in cachelife.generate's step) ((time for 192 new tokens - time for 64) / 128, best of 3);
- on CUDA, the GPU kernel time per step of `cachelife.generate`, measured the same way with torch.profiler
  (kernel time of a 192-token run minus that of a 64-token run, over 128), and wall / kernel;
- whether cachelife.generate's tokens equal eager `generate` (float32) or `generate` with the same compiled forward
  (other dtypes), and the first diverging position otherwise.
Writes `<out>/decode-loop-<device>-<date>.json`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

import cachelife
from bench.generate import build, settings_for
from bench.results_file import bench_parser, results_file
from bench.timing import as_tokens, kernels_per_step, timed
from cachelife.tools.recipe import pick_device

BATCH, LENGTH, SHORT, LONG, REPEATS = 4, 48, 64, 192, 3


def marginal_ms(device: torch.device, run: Callable[[int], torch.Tensor]) -> float:
    short = min(timed(device, lambda: run(SHORT))[0] for _ in range(REPEATS))
    long = min(timed(device, lambda: run(LONG))[0] for _ in range(REPEATS))
    return 1000 * (long - short) / (LONG - SHORT)


def kernel_ms(device: torch.device, run: Callable[[int], torch.Tensor]) -> float | None:
    measured = kernels_per_step(device, run, SHORT, LONG)
    return None if measured is None else measured[0]


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    if a.shape == b.shape and torch.equal(a, b):
        return None
    width = min(a.shape[1], b.shape[1])
    differs = (a[:, :width] != b[:, :width]).any(dim=0).nonzero()
    return int(differs[0]) if differs.numel() else width


def measure(name: str, device: torch.device, dtype: torch.dtype, steps_per_call: list[int]) -> dict[str, Any]:
    torch._dynamo.reset()
    built = build(name, False, device, dtype)
    model = built.model
    inputs = built.inputs(BATCH, LENGTH, 1)
    eager = as_tokens(model.generate(**inputs, **settings_for(name, 0, LONG)))
    cachelife.enable(model)

    compiled = cachelife.enable(build(name, False, device, dtype).model)
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    # Rounded at every cast as eager rounds, as cachelife.generate's step is: the reference in other dtypes.
    cachelife.compile_forward(compiled, mode=mode, fullgraph=True, options={"emulate_precision_casts": True})

    def generate(tokens: int) -> torch.Tensor:
        return as_tokens(compiled.generate(**inputs, **settings_for(name, 0, tokens), cache_implementation="static"))

    _, generated = timed(device, lambda: generate(LONG))
    generate_ms = marginal_ms(device, generate)
    reference = eager if dtype == torch.float32 else generated
    loops = []
    for steps in steps_per_call:

        def loop(tokens: int, steps: int = steps) -> torch.Tensor:
            out = cachelife.generate(
                model, fallback=False, steps_per_call=steps, **inputs, **settings_for(name, 0, tokens)
            )
            return as_tokens(out)

        compile_s, tokens = timed(device, lambda: loop(LONG))
        loop_ms = marginal_ms(device, loop)
        loop_kernel_ms = kernel_ms(device, loop)
        loops.append(
            {
                "steps_per_call": steps,
                "loop_first_call_s": round(compile_s, 3),
                "loop_ms_per_step": round(loop_ms, 4),
                "loop_kernel_ms_per_step": None if loop_kernel_ms is None else round(loop_kernel_ms, 4),
                "loop_wall_over_kernel": None if not loop_kernel_ms else round(loop_ms / loop_kernel_ms, 3),
                "speedup_over_generate": round(generate_ms / loop_ms, 3),
                "first_divergence": first_divergence(tokens, reference),
            }
        )
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "generate_compiled_forward_ms_per_step": round(generate_ms, 4),
        "compared_with": "eager generate" if dtype == torch.float32 else "generate with the same compiled forward",
        "loops": loops,
    }


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="t5-small")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps-per-call", default="1,4", help="cachelife.generate's steps_per_call values")
    args = parser.parse_args()
    steps = [int(value) for value in args.steps_per_call.split(",")]
    device = pick_device(args.device)
    settings = {
        "model": args.model, "loop": "cachelife.generate", "generation_config": "the model's own",
        "batch_size": BATCH, "input_length": LENGTH, "new_tokens": [SHORT, LONG],
    }  # fmt: skip
    results = results_file(args.out, "decode-loop", device, "decode-loop", {"settings": settings, "results": []})
    for dtype in args.dtypes.split(","):
        results.add(measure(args.model, device, getattr(torch, dtype), steps))
    results.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
