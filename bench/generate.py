"""`cachelife.generate` against transformers' paths on real checkpoints' shapes and generation configs.

    python -m bench.generate [--device auto] [--models whisper-large-v3,bart-large-cnn,t5-base,llama-3.2-1b]
                             [--batches 1,8] [--dtype bfloat16] [--tokens 16,80] [--beams 0] [--input-length 64]
                             [--steps-per-call 1,4] [--paths eager,auto,forward,cachelife,cachelife_cudnn]
                             [--cuda-graphs cachelife,torch] [--trees-steps-per-call 1]
                             [--levers fuse_projections,decode_attention,small_linear,fused_layers,...]
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
  the `--trees-steps-per-call` values, since each compiles an N-step function);
- `cachelife_cudnn`: `cachelife.generate` at one step per graph on its own model, its steps allowed torch's cuDNN
  attention (as before they kept to attention that repeats exactly: the cost of repeatable attention);
- `lever_<name>` for each of `--levers` (none by default): `cachelife.generate` at one step per graph on its own
  model enabled with that `cachelife.Options` (`LEVERS`): each lever's wall time beside its kernel time, the
  device's busy time and the span from first kernel to last (the gaps between kernels), against `cachelife_spc1`.
`llama-3.2-1b` is bench.padded's Llama-3.2-1B shape: at batch 1 one prompt of `--input-length` tokens, at larger
batches prompts spread from 20 tokens to `--input-length`, left-padded.
Reported per path: marginal ms per step ((time for N2 tokens - time for N1) / (N2 - N1), best of
`--repeats`), first-call seconds (compilation included), GPU kernel ms per step (torch.profiler, CUDA only,
measured the same marginal way), whether the tokens equal the reference (float32: eager `generate`; other
dtypes: `generate` with the compiled forward, as compiled rounding differs from eager), whether repeated calls
gave the same tokens, for every greedy `cachelife` path a verdict against transformers (bench.verdict: one more
call with its logits, teacher-forced against a float32 copy), and CUDA-graph skips,
unexpected re-records and new dynamo graphs after the first calls, and graphs cachelife captured (all of
them, and after the first calls). `--tiny` swaps in the zoo's tiny models
with the same generation configs (a CPU smoke run). Writes `<out>/generate[-<tag>]-<device>-<date>-tf<version>.json`,
rewritten after each path: a run cut short keeps the paths of its model and batch measured so far under
`in_progress` (without the verdicts, which come after the last path).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import json
import sys
import unittest.mock
from collections.abc import Callable
from typing import Any

import attrs
import torch
from transformers import CompileConfig, PreTrainedModel

import cachelife
from bench.padded import build_model, padded_prompts, spread_lengths
from bench.results_file import bench_parser, results_file
from bench.timing import as_tokens, cudnn_attention_allowed, kernel_timeline, marginal_ms, timed
from bench.verdict import judge
from cachelife.generation.loop_settings import CudaGraphs
from cachelife.integration.runtime import runtime_of
from cachelife.model_rewrites import decode_attention as decode_attention_module
from cachelife.tools import zoo
from cachelife.tools.recipe import CudaGraphHealth, pick_device

LEVERS: dict[str, cachelife.Options] = {
    "exact": cachelife.EXACT,
    "fuse_projections": attrs.evolve(cachelife.EXACT, fuse_projections=True),
    "decode_attention": attrs.evolve(cachelife.EXACT, decode_attention=True),
    "small_linear": attrs.evolve(cachelife.EXACT, small_linear=True),
    "fused_layers": attrs.evolve(cachelife.EXACT, fused_layers=True),
    "layers_projections": attrs.evolve(cachelife.EXACT, fused_layers=True, fuse_projections=True),
    "fast_kernels": attrs.evolve(cachelife.EXACT, compile_options=cachelife.FAST_KERNELS),
    "unmasked_kernel": attrs.evolve(cachelife.EXACT, decode_attention=True),  # and UNMASKED_BY_KERNEL: below
    "fast": cachelife.FAST,
    "all": attrs.evolve(cachelife.FAST, small_linear=True),
}
"""`--levers` names: nothing on (`EXACT`; the `cachelife` path has the default, fused projections), one lever
alone, fused layers with fused projections, `FAST`, and `FAST` with the few-row linear kernel. `unmasked_kernel`
is `decode_attention` with calls without a mask (cross-attention) through the kernel's matrix products too
(`cachelife.model_rewrites.decode_attention.UNMASKED_BY_KERNEL`, set for its calls alone)."""

TINY = {"whisper-large-v3": "whisper", "bart-large-cnn": "bart", "t5-base": "t5"}
LLAMAS = ("llama-3.2-1b",)


def prompt_lengths(batch: int, longest: int) -> list[int]:
    """One prompt of `longest` tokens, or `batch` prompts spread from 20 tokens to `longest`."""
    return [longest] if batch == 1 else spread_lengths(batch, 20, longest)


Run = Callable[[int], torch.Tensor]


_BUILT: dict[tuple[str, bool, torch.device, torch.dtype], zoo.ZooModel] = {}


def build(name: str, tiny: bool, device: torch.device, dtype: torch.dtype) -> zoo.ZooModel:
    """The named model, built once per process (random weights take long on a host for the large shapes) and
    copied for every later caller: each path gets its own instance of the same weights."""
    key = (name, tiny, device, dtype)
    if key not in _BUILT:
        _BUILT[key] = built_afresh(name, tiny, device, dtype)
    model = copy.deepcopy(_BUILT[key].model)
    if name in LLAMAS:
        return zoo.ZooModel(model, lambda batch, longest, seed: padded_prompts(model, prompt_lengths(batch, longest)))
    return zoo.ZooModel(model, _BUILT[key].inputs)


def built_afresh(name: str, tiny: bool, device: torch.device, dtype: torch.dtype) -> zoo.ZooModel:
    if name in LLAMAS:  # bench.padded's shapes, with its left-padded prompts of spread lengths
        model = build_model("tiny" if tiny else name, device, dtype)
        return zoo.ZooModel(model, lambda batch, longest, seed: padded_prompts(model, prompt_lengths(batch, longest)))
    built = zoo.build(TINY[name] if tiny else name, device=device, dtype=dtype)
    config = built.model.generation_config
    if tiny and name == "whisper-large-v3":
        zoo.whisper_tiny_generation(config)
    if tiny and name == "bart-large-cnn":
        zoo.bart_cnn_generation(config)
    return built


def auto_compile(device: torch.device) -> dict[str, Any]:
    """`generate` keywords for transformers' auto-compile: a static cache and a `compile_config` (CUDA graphs on
    a GPU), on any device."""
    config = CompileConfig(fullgraph=True, mode="reduce-overhead" if device.type == "cuda" else "default")
    config._compile_all_devices = True  # transformers auto-compiles on GPUs only unless told
    return {"cache_implementation": "static", "compile_config": config}


def settings_for(name: str, beams: int, tokens: int) -> dict[str, Any]:
    settings: dict[str, Any] = {"max_new_tokens": tokens, "min_new_tokens": tokens}
    if name in ("whisper-large-v3", "whisper-large-v3-turbo"):  # their generation configs take a language and task
        settings.update(language="en", task="transcribe")
    if beams:
        settings["num_beams"] = beams
    return settings


def paths(
    name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, batch: int
) -> tuple[dict[str, tuple[Run, str]], zoo.Inputs]:
    """Each path's run(tokens) on its own model instance (same seed, same weights), by path name, and the inputs
    every path decodes."""
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
        forward = cachelife.enable(build(name, args.tiny, device, dtype).model, options=cachelife.EXACT)
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
    if "cachelife_cudnn" in wanted:
        cudnn = _MODELS["cachelife_cudnn"] = cachelife.enable(build(name, args.tiny, device, dtype).model)

        def allowing_cudnn(n: int) -> torch.Tensor:
            with cudnn_attention_allowed():
                out = cachelife.generate(cudnn, fallback=False, **inputs, **settings_for(name, args.beams, n))
            return as_tokens(out)

        runs["cachelife_cudnn"] = (allowing_cudnn, "cachelife_cudnn")
    for lever in levers(args.levers):
        kind = f"lever_{lever}"
        enabled = _MODELS[kind] = cachelife.enable(build(name, args.tiny, device, dtype).model, options=LEVERS[lever])

        def with_lever(n: int, enabled: PreTrainedModel = enabled, lever: str = lever) -> torch.Tensor:
            with lever_switches(lever):
                out = cachelife.generate(enabled, fallback=False, **inputs, **settings_for(name, args.beams, n))
            return as_tokens(out)

        runs[kind] = (with_lever, kind)
    return runs, inputs


def lever_switches(lever: str) -> contextlib.AbstractContextManager[Any]:
    """What a lever sets beside its `Options` while its calls run: `unmasked_kernel`'s module switch."""
    if lever == "unmasked_kernel":
        return unittest.mock.patch.object(decode_attention_module, "UNMASKED_BY_KERNEL", True)
    return contextlib.nullcontext()


def levers(text: str) -> list[str]:
    """`--levers` values, checked."""
    named = [value for value in text.split(",") if value]
    unknown = [value for value in named if value not in LEVERS]
    if unknown:
        msg = f"--levers takes values of {sorted(LEVERS)}, got {unknown}"
        raise SystemExit(msg)
    return named


_MODES: dict[str, CudaGraphs] = {"cachelife": "cachelife", "torch": "torch"}


def graph_modes(text: str) -> list[CudaGraphs]:
    """`--cuda-graphs` values, checked."""
    unknown = [value for value in text.split(",") if value not in _MODES]
    if unknown:
        msg = f"--cuda-graphs takes values of {sorted(_MODES)}, got {unknown}"
        raise SystemExit(msg)
    return [_MODES[value] for value in text.split(",")]


_MODELS: dict[str, PreTrainedModel] = {}


def _captures(model_kind: str) -> int:
    """Graphs cachelife captured so far for the model of that kind in this measurement (0 if none)."""
    model = _MODELS.get(model_kind)
    return 0 if model is None else runtime_of(model).captures


def measure(
    name: str, batch: int, args: argparse.Namespace, device: torch.device, progress: Callable[[object], None]
) -> dict[str, Any]:
    """Every path of one model and batch; `progress` gets the paths measured so far after each (a run cut short
    keeps them in its file)."""
    torch._dynamo.reset()
    dtype = getattr(torch, args.dtype)
    short, long = (int(value) for value in args.tokens.split(","))
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, torch.Tensor] = {}
    runs, inputs = paths(name, args, device, dtype, batch)
    for path, (run, model_kind) in runs.items():
        start = CudaGraphHealth.now()
        first_s, outputs[path] = timed(device, functools.partial(run, long))
        run(short)  # a different max_length may be a different compiled shape: compile it before timing
        after_first = CudaGraphHealth.now()
        captured = _captures(model_kind)
        ms, repeats_same = marginal_ms(device, run, short, long, args.repeats)
        timeline = kernel_timeline(device, run, short, long)
        kernel = None if timeline is None else timeline["kernel_ms_per_step"]
        end = CudaGraphHealth.now()
        results[path] = {
            "first_call_s": round(first_s, 3),
            "ms_per_step": round(ms, 4),
            "repeat_calls_same_tokens": repeats_same and torch.equal(run(long), outputs[path]),
            "kernel_ms_per_step": kernel,
            "wall_over_kernel": None if not kernel else round(ms / kernel, 3),
            "timeline": timeline,
            "cudagraph_skips": end.cudagraph_skips - start.cudagraph_skips,
            "rerecords_after_first_calls": end.rerecords - after_first.rerecords,
            "new_graphs_after_first_calls": end.graphs - after_first.graphs,
            "cachelife_captures": _captures(model_kind),
            "cachelife_captures_after_first_calls": _captures(model_kind) - captured,
        }
        print(json.dumps({"model": name, "batch": batch, "path": path, **results[path]}), flush=True)
        progress({"model": name, "batch": batch, "paths": results})
    reference_path = "eager" if dtype == torch.float32 else "forward"
    reference = outputs.get(reference_path)
    for path, tokens in outputs.items():
        same = reference is not None and tokens.shape == reference.shape and torch.equal(tokens, reference)
        results[path]["tokens_equal_reference"] = same if reference is not None else None
    for path in [path for path in results if path.startswith(("cachelife", "lever_"))]:
        results[path]["verdict"] = verdict(name, args, path, inputs=inputs, tokens=long, timed_out=outputs[path])
    return {"model": name, "batch": batch, "reference": reference_path, "paths": results}


def verdict(
    name: str, args: argparse.Namespace, path: str, *, inputs: zoo.Inputs, tokens: int, timed_out: torch.Tensor
) -> dict[str, Any] | None:
    """The path's greedy call of `tokens` new tokens once more with its logits, judged against transformers
    (bench.verdict; raw logits decide the tokens unless the config suppresses some), and whether its tokens are
    the timed call's. None for beam search, which teacher forcing does not judge."""
    model = _MODELS[path if path == "cachelife_cudnn" or path.startswith("lever_") else "cachelife"]
    config = model.generation_config
    if args.beams > 1 or (not args.beams and (config.num_beams or 1) > 1):
        return None
    graphs: CudaGraphs = "torch" if path.startswith("cachelife_trees") else "cachelife"
    steps = int(path.rsplit("spc", 1)[1]) if "_spc" in path else 1
    switches = lever_switches(path.removeprefix("lever_"))
    with cudnn_attention_allowed() if path == "cachelife_cudnn" else contextlib.nullcontext(), switches:
        out: Any = cachelife.generate(
            model, fallback=False, steps_per_call=steps, cuda_graphs=graphs, return_dict_in_generate=True,
            output_logits=True, **inputs, **settings_for(name, args.beams, tokens),
        )  # fmt: skip
    sequences, logits = out["sequences"], torch.stack(out["logits"], dim=1)
    suppresses = bool(config.suppress_tokens or config.begin_suppress_tokens)
    judged = judge(model, inputs, sequences, sequences.shape[1] - tokens, logits=logits, raw_greedy=not suppresses)
    # Whisper's token tensor leaves out the decoder prompt that its output's sequences hold: the new tokens compare.
    same = torch.equal(sequences[:, -tokens:], timed_out[:, -tokens:])
    return {**judged, "tokens_equal_timed_call": bool(same)}


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
    parser.add_argument("--levers", default="", help=f"lever paths, of {', '.join(LEVERS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="the zoo's tiny models with the same configs")
    parser.add_argument("--tag", default="", help="added to the file name, so that runs split by model keep apart")
    args = parser.parse_args()
    levers(args.levers)
    device = pick_device(args.device)
    stem = f"generate-{args.tag}" if args.tag else "generate"
    results = results_file(args.out, stem, device, "generate", {"settings": vars(args), "results": []})
    for name in args.models.split(","):
        for batch in (int(value) for value in args.batches.split(",")):
            # measure prints each path's line, and keeps those measured so far under "in_progress" until it ends
            results.add(measure(name, batch, args, device, functools.partial(results.put, "in_progress")), show=False)
            results.record.pop("in_progress", None)
    results.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
