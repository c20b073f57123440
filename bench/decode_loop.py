"""cachelife's decode loop against `generate` with a compiled forward, and against the GPU kernel-time floor.

    python -m bench.decode_loop [--device cuda|cpu] [--model t5-small] [--dtypes float32,bfloat16]
                                [--steps-per-call 1,4]

For each dtype, in one process and on the same inputs (batch 4, encoder or prompt length 48):
- the marginal wall time per step of `cachelife.decode` (for each `steps_per_call`) and of `generate` with
  cachelife and a compiled forward ((time for 192 new tokens - time for 64) / 128, best of 3);
- on CUDA, the GPU kernel time per step of the decode loop, measured the same way with torch.profiler
  (kernel time of a 192-token run minus that of a 64-token run, over 128), and wall / kernel;
- whether the loop's tokens equal eager `generate` (float32) or `generate` with the same compiled forward
  (other dtypes), and the first diverging position otherwise.
Writes `<out>/decode-loop-<device>-<date>.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

import cachelife
from bench.results_file import DEFAULT_OUT, header, results_path
from bench.timing import kernels_per_step, timed
from cachelife.generation.decode import decode
from cachelife.tools import zoo
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
    built = zoo.build(name, device=device, dtype=dtype)
    model = built.model
    model.generation_config.forced_eos_token_id = None
    model.generation_config.eos_token_id = None  # fixed lengths: every call decodes exactly N tokens
    inputs = built.inputs(BATCH, LENGTH, 1)
    eager = zoo.generate_tokens(model, inputs, do_sample=False, max_new_tokens=LONG)
    cachelife.enable(model)

    compiled = zoo.build(name, device=device, dtype=dtype).model
    compiled.generation_config.forced_eos_token_id = None
    compiled.generation_config.eos_token_id = None
    cachelife.enable(compiled)
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    cachelife.compile_forward(compiled, mode=mode, fullgraph=True)

    def generate(tokens: int) -> torch.Tensor:
        return zoo.generate_tokens(
            compiled, inputs, do_sample=False, max_new_tokens=tokens, cache_implementation="static"
        )

    _, generated = timed(device, lambda: generate(LONG))
    generate_ms = marginal_ms(device, generate)
    reference = eager if dtype == torch.float32 else generated
    loops = []
    for steps in steps_per_call:

        def loop(tokens: int, steps: int = steps) -> torch.Tensor:
            return decode(model, inputs, max_new_tokens=tokens, steps_per_call=steps)

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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default="t5-small")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps-per-call", default="1,4", help="cachelife.decode's steps_per_call values")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args()
    steps = [int(value) for value in args.steps_per_call.split(",")]
    device = pick_device(args.device)
    record: dict[str, Any] = {
        **header("decode-loop", device),
        "settings": {"model": args.model, "batch_size": BATCH, "input_length": LENGTH, "new_tokens": [SHORT, LONG]},
        "results": [],
    }
    path = results_path(args.out, "decode-loop", device)
    for dtype in args.dtypes.split(","):
        record["results"].append(measure(args.model, device, getattr(torch, dtype), steps))
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps(record["results"][-1]), flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
