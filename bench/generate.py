"""`cachelife.generate` against transformers' paths on real checkpoints' shapes and generation configs.

    python -m bench.generate [--device auto] [--models whisper-large-v3,bart-large-cnn,t5-base]
                             [--batches 1,8] [--dtype bfloat16] [--tokens 16,80] [--beams 0]
                             [--steps-per-call 1,4] [--paths eager,auto,forward,cachelife]
                             [--cuda-graphs cachelife,torch] [--trees-steps-per-call 1]
                             [--repeats 3] [--tiny] [--out DIR] [--tag NAME]

For each model and batch size, in one process, on the same inputs and the model's own generation config
(Whisper: language "en", task "transcribe"; bart-large-cnn: 4 beams, no-repeat 3, length penalty 2.0,
forced BOS/EOS; `--beams N` overrides num_beams, 0 keeps the config's), every path decodes exactly N new
tokens (`min_new_tokens = max_new_tokens = N`):
- `eager`: `generate`, dynamic cache;
- `auto`: transformers' auto-compile (`compile_config`, static cache);
- `forward`: `generate` with a compiled forward (`reduce-overhead` on CUDA, casts rounded as eager rounds them:
  inductor's `emulate_precision_casts`, as in cachelife.generate's step) and `cachelife.enable`;
- `cachelife`: `cachelife.generate`, once per `--steps-per-call` value and `--cuda-graphs` value
  (`cachelife_spcN`: cachelife's own CUDA graphs; `cachelife_trees_spcN`: torch's cudagraph trees, only at
  the `--trees-steps-per-call` values, since each compiles an N-step function).
Reported per path: marginal ms per step ((time for N2 tokens - time for N1) / (N2 - N1), best of
`--repeats`), first-call seconds (compilation included), GPU kernel ms per step (torch.profiler, CUDA only,
measured the same marginal way), whether the tokens equal the reference (float32: eager `generate`; other
dtypes: `generate` with the compiled forward, as compiled rounding differs from eager), and CUDA-graph skips,
unexpected re-records and new dynamo graphs after the first calls, and graphs cachelife captured (all of
them, and after the first calls). `--tiny` swaps in the zoo's tiny models
with the same generation configs (a CPU smoke run). Writes `<out>/generate[-<tag>]-<device>-<date>-tf<version>.json`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

import cachelife
from bench.decode import auto_compile
from bench.results_file import bench_parser, results_file
from bench.timing import as_tokens, kernels_per_step, timed
from cachelife.generation.steps import CudaGraphs
from cachelife.tools import zoo
from cachelife.tools.recipe import CudaGraphHealth, pick_device

TINY = {"whisper-large-v3": "whisper", "bart-large-cnn": "bart", "t5-base": "t5"}
Run = Callable[[int], torch.Tensor]


def build(name: str, tiny: bool, device: torch.device, dtype: torch.dtype) -> zoo.ZooModel:
    built = zoo.build(TINY[name] if tiny else name, device=device, dtype=dtype)
    config = built.model.generation_config
    if tiny and name == "whisper-large-v3":
        zoo.whisper_tiny_generation(config)
    if tiny and name == "bart-large-cnn":
        zoo.bart_cnn_generation(config)
    return built


def settings_for(name: str, beams: int, tokens: int) -> dict[str, Any]:
    settings: dict[str, Any] = {"max_new_tokens": tokens, "min_new_tokens": tokens}
    if name in ("whisper-large-v3", "whisper-large-v3-turbo"):  # their generation configs take a language and task
        settings.update(language="en", task="transcribe")
    if beams:
        settings["num_beams"] = beams
    return settings


def marginal_ms(device: torch.device, run: Run, short: int, long: int, repeats: int) -> float:
    first = min(timed(device, lambda: run(short))[0] for _ in range(repeats))
    second = min(timed(device, lambda: run(long))[0] for _ in range(repeats))
    return 1000 * (second - first) / (long - short)


def kernel_ms(device: torch.device, run: Run, short: int, long: int) -> float | None:
    measured = kernels_per_step(device, run, short, long)
    return None if measured is None else measured[0]


def paths(
    name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, batch: int
) -> dict[str, tuple[Run, str]]:
    """Each path's run(tokens) on its own model instance (same seed, same weights), by path name."""
    inputs = build(name, args.tiny, device, dtype).inputs(batch, args.input_length, 1)
    wanted = args.paths.split(",")
    runs: dict[str, tuple[Run, str]] = {}
    if "eager" in wanted:
        eager = build(name, args.tiny, device, dtype).model
        runs["eager"] = (lambda n: as_tokens(eager.generate(**inputs, **settings_for(name, args.beams, n))), "eager")
    if "auto" in wanted:
        auto = build(name, args.tiny, device, dtype).model
        extra = auto_compile(device)
        runs["auto"] = (
            lambda n: as_tokens(auto.generate(**inputs, **settings_for(name, args.beams, n), **extra)),
            "auto",
        )
    if "forward" in wanted:
        forward = cachelife.enable(build(name, args.tiny, device, dtype).model)
        mode = "reduce-overhead" if device.type == "cuda" else "default"
        # Rounded at every cast as eager rounds, as cachelife.generate's step is: the bf16 reference.
        cachelife.compile_forward(forward, mode=mode, fullgraph=True, options={"emulate_precision_casts": True})
        static: dict[str, Any] = {"cache_implementation": "static"}
        runs["forward"] = (
            lambda n: as_tokens(forward.generate(**inputs, **settings_for(name, args.beams, n), **static)),
            "forward",
        )
    if "cachelife" in wanted:
        ours = _MODELS["cachelife"] = cachelife.enable(build(name, args.tiny, device, dtype).model)
        trees_steps = {int(value) for value in args.trees_steps_per_call.split(",")}
        for graphs, steps in itertools.product(graph_modes(args.cuda_graphs), map(int, args.steps_per_call.split(","))):
            if graphs == "torch" and steps not in trees_steps:
                continue

            def run(n: int, steps: int = steps, graphs: CudaGraphs = graphs) -> torch.Tensor:
                out = cachelife.generate(
                    ours, fallback=False, steps_per_call=steps, cuda_graphs=graphs, **inputs,
                    **settings_for(name, args.beams, n),
                )  # fmt: skip
                return as_tokens(out)

            label = f"cachelife_spc{steps}" if graphs == "cachelife" else f"cachelife_trees_spc{steps}"
            runs[label] = (run, "cachelife")
    return runs


_MODES: dict[str, CudaGraphs] = {"cachelife": "cachelife", "torch": "torch"}


def graph_modes(text: str) -> list[CudaGraphs]:
    """`--cuda-graphs` values, checked."""
    unknown = [value for value in text.split(",") if value not in _MODES]
    if unknown:
        msg = f"--cuda-graphs takes values of {sorted(_MODES)}, got {unknown}"
        raise SystemExit(msg)
    return [_MODES[value] for value in text.split(",")]


_MODELS: dict[str, object] = {}


def _captures(model_kind: str) -> int:
    """Graphs cachelife captured so far for the model of that kind in this measurement (0 if none)."""
    model = _MODELS.get(model_kind)
    return 0 if model is None else cachelife.runtime_of(model).captures


def measure(name: str, batch: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    torch._dynamo.reset()
    dtype = getattr(torch, args.dtype)
    short, long = (int(value) for value in args.tokens.split(","))
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, torch.Tensor] = {}
    for path, (run, model_kind) in paths(name, args, device, dtype, batch).items():
        start = CudaGraphHealth.now()
        first_s, outputs[path] = timed(device, functools.partial(run, long))
        run(short)  # a different max_length may be a different compiled shape: compile it before timing
        after_first = CudaGraphHealth.now()
        captured = _captures(model_kind)
        ms = marginal_ms(device, run, short, long, args.repeats)
        kernel = kernel_ms(device, run, short, long)
        end = CudaGraphHealth.now()
        results[path] = {
            "first_call_s": round(first_s, 3),
            "ms_per_step": round(ms, 4),
            "kernel_ms_per_step": None if kernel is None else round(kernel, 4),
            "wall_over_kernel": None if not kernel else round(ms / kernel, 3),
            "cudagraph_skips": end.cudagraph_skips - start.cudagraph_skips,
            "rerecords_after_first_calls": end.rerecords - after_first.rerecords,
            "new_graphs_after_first_calls": end.graphs - after_first.graphs,
            "cachelife_captures": _captures(model_kind),
            "cachelife_captures_after_first_calls": _captures(model_kind) - captured,
        }
        print(json.dumps({"model": name, "batch": batch, "path": path, **results[path]}), flush=True)
    reference_path = "eager" if dtype == torch.float32 else "forward"
    reference = outputs.get(reference_path)
    for path, tokens in outputs.items():
        same = reference is not None and tokens.shape == reference.shape and torch.equal(tokens, reference)
        results[path]["tokens_equal_reference"] = same if reference is not None else None
    return {"model": name, "batch": batch, "reference": reference_path, "paths": results}


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--models", default="whisper-large-v3,bart-large-cnn,t5-base")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", default="16,80", help="N1,N2 new tokens for the marginal step time")
    parser.add_argument("--beams", type=int, default=0, help="num_beams for every model; 0 keeps each config's")
    parser.add_argument("--steps-per-call", default="1,4", help="cachelife.generate's steps_per_call values")
    parser.add_argument("--paths", default="eager,auto,forward,cachelife")
    parser.add_argument(
        "--cuda-graphs", default="cachelife,torch", help="cachelife.generate's cuda_graphs values (CUDA only)"
    )
    parser.add_argument("--trees-steps-per-call", default="1", help="steps_per_call values of the trees paths")
    parser.add_argument("--input-length", type=int, default=64, help="prompt length of the text models")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="the zoo's tiny models with the same configs")
    parser.add_argument("--tag", default="", help="added to the file name, so that runs split by model keep apart")
    args = parser.parse_args()
    device = pick_device(args.device)
    stem = f"generate-{args.tag}" if args.tag else "generate"
    results = results_file(args.out, stem, device, "generate", {"settings": vars(args), "results": []})
    for name in args.models.split(","):
        for batch in (int(value) for value in args.batches.split(",")):
            results.add(measure(name, batch, args, device), show=False)  # measure prints each path's line
    results.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
