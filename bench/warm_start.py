"""Warm starts: the first call of a fresh process with a cold, a shared and a carried compile cache.

    python -m bench.warm_start [--device cuda|cpu] [--models t5-small]
                               [--paths generate,cachelife-generate]
                               [--dtype float32] [--new-tokens 32] [--batch 1]

For each model (with its own generation config; Whisper: language "en", task "transcribe", as
bench/generate.py) and path (`generate`: `model.generate` on an enabled model with a compiled forward,
`mode="reduce-overhead"` on a GPU; `cachelife-generate`: `cachelife.generate(model, fallback=False, ...)`, 1
step per call; `cachelife-generate-beams`: the same with 5 beams; `...-regions`: either on a model enabled with
`Options(compile_regions=True)`, its layers compiled once), every call decoding exactly `--new-tokens`
tokens, three fresh processes, one after another, each with a compile-cache directory of its own choosing
(TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR):
- `empty_dir`: an empty TORCHINDUCTOR_CACHE_DIR (the first deployment); after warm-up it saves
  `cachelife.save_compile_artifacts`;
- `shared_dir`: a second process on the same directory (a restart on the same machine);
- `loaded_artifacts`: another empty directory, `cachelife.load_compile_artifacts` before the first call (a
  new machine that received the file).
Each reports its first call (seconds, compilation included), where torch's compiler spent its time by phase
(`compile_phases_s`), a second call, the artifact load time, torch's compile-cache hit and miss counters, and
its tokens, which must be equal in all three. Input length 48 (text models). Writes
`<out>/warm-start[-<tag>]-<device>-<date>-tf<version>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from attrs import asdict
from torch._dynamo.utils import compile_times, counters
from transformers import PreTrainedModel

import cachelife
from bench.generate import build, settings_for
from bench.results_file import ROOT, bench_parser, results_file
from bench.timing import as_tokens, timed
from cachelife.tools import zoo
from cachelife.tools.recipe import pick_device

LENGTH = 48
ROLES = ("empty_dir", "shared_dir", "loaded_artifacts")
Settings = dict[str, Any]  # generate's keyword arguments for one call: new tokens, Whisper's language and task


def child(args: argparse.Namespace) -> None:
    """One fresh process: optionally load artifacts, build, first and second call, optionally save."""
    load_s = 0.0
    if args.child == "loaded_artifacts":
        started = time.perf_counter()
        cachelife.load_compile_artifacts(args.artifacts)
        load_s = time.perf_counter() - started
    device = pick_device(args.device)
    built = build(args.model, False, device, getattr(torch, args.dtype))
    options = cachelife.Options(compile_regions=args.path.endswith("-regions"))
    model = cachelife.enable(built.model, options=options)
    inputs = built.inputs(args.batch, LENGTH, 1)
    beams = BEAMS if "-beams" in args.path else 0
    call = PATHS[args.path](model, inputs, settings_for(args.model, beams, args.new_tokens))
    first_s, tokens = timed(device, call)
    phases = compile_phases()
    second_s, _ = timed(device, call)
    saved: dict[str, Any] | None = None
    if args.child == "empty_dir":
        saved = asdict(cachelife.save_compile_artifacts(args.artifacts))
        saved["file_bytes"] = os.path.getsize(args.artifacts)
    record = {
        "role": args.child,
        "load_artifacts_s": round(load_s, 3),
        "first_call_s": round(first_s, 3),
        "second_call_s": round(second_s, 3),
        "compile_phases_s": phases,
        "counters": {name: dict(counters[name]) for name in ("inductor", "aot_autograd")},
        "saved": saved,
        "tokens": tokens.tolist(),
    }
    print("RESULT " + json.dumps(record), flush=True)


def compile_phases() -> dict[str, float]:
    """Seconds torch's compiler spent so far in this process, by phase, the largest first (its own timers,
    `torch._dynamo.utils.compile_times`, summed over every compiled function): dynamo's tracing
    (`bytecode_tracing`), AOTAutograd (`create_aot_dispatcher_function`), inductor's lowering and code
    generation (`GraphLowering.*`, `Scheduler.*`), compiling the generated code (`compile_file`,
    `async_compile.wait`), guards (`build_guards`)."""
    found = compile_times(repr="csv", aggregate=True)
    if not isinstance(found, tuple):
        return {}
    names, values = found
    phases = {str(name): round(float(str(value)), 3) for name, value in zip(names, values, strict=True)}
    return dict(sorted(phases.items(), key=lambda item: -item[1]))


def _generate_call(model: PreTrainedModel, inputs: zoo.Inputs, settings: Settings) -> Callable[[], torch.Tensor]:
    """`model.generate` with a compiled forward (CUDA graphs on a GPU) on an enabled model."""
    mode = "reduce-overhead" if model.device.type == "cuda" else None
    cachelife.compile_forward(model, mode=mode, fullgraph=True)
    return lambda: zoo.generate_tokens(model, inputs, do_sample=False, cache_implementation="static", **settings)


def _cachelife_generate_call(
    model: PreTrainedModel, inputs: zoo.Inputs, settings: Settings
) -> Callable[[], torch.Tensor]:
    """`cachelife.generate` with the model's generation config, one compiled step per call."""
    return lambda: as_tokens(cachelife.generate(model, fallback=False, **inputs, **settings))


PATHS: dict[str, Callable[[PreTrainedModel, zoo.Inputs, Settings], Callable[[], torch.Tensor]]] = {
    "generate": _generate_call,
    "cachelife-generate": _cachelife_generate_call,
    "cachelife-generate-beams": _cachelife_generate_call,  # with BEAMS beams
    "cachelife-generate-regions": _cachelife_generate_call,  # on a model enabled with compile_regions=True
    "cachelife-generate-beams-regions": _cachelife_generate_call,
}
BEAMS = 5


def run_role(role: str, args: argparse.Namespace, model: str, path: str, folder: Path) -> dict[str, Any]:
    """Run one fresh process for `role` (`python -m bench.warm_start --child ROLE ...`) with its compile-cache
    directory; its `RESULT` record and the seconds the process took, or its return code and stderr's tail."""
    cache_dir = folder / ("cache-loaded" if role == "loaded_artifacts" else "cache-shared")
    arguments = [
        "--child", role, "--artifacts", str(folder / "warm.artifacts"), "--device", args.device, "--model", model,
        "--path", path, "--dtype", args.dtype, "--new-tokens", str(args.new_tokens), "--batch", str(args.batch),
    ]  # fmt: skip
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TRITON_CACHE_DIR": str(cache_dir / "triton")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "bench.warm_start", *arguments], capture_output=True, text=True, env=env, cwd=ROOT,
        check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        return {"role": role, "returncode": done.returncode, "stderr_tail": done.stderr[-3000:]}
    record: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    record["process_s"] = round(time.perf_counter() - started, 3)
    return record


def measure(args: argparse.Namespace, model: str, path: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="warm-start-") as scratch:
        records = {role: run_role(role, args, model, path, Path(scratch)) for role in ROLES}
    tokens = [record.pop("tokens", None) for record in records.values()]
    cold = records["empty_dir"].get("first_call_s")
    for role in ROLES[1:]:
        warm = records[role].get("first_call_s")
        records[role]["speedup_over_empty_dir"] = round(cold / warm, 2) if cold and warm else None
    return {
        "model": model, "path": path,
        "tokens_equal": tokens[0] is not None and all(other == tokens[0] for other in tokens),
        "roles": list(records.values()),
    }  # fmt: skip


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--models", default="t5-small")
    parser.add_argument("--paths", default="generate", help=f"any of {', '.join(PATHS)}, comma-separated")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tag", default="", help="a word for the results file's name (warm-start-TAG-...)")
    parser.add_argument("--child", choices=ROLES, help=argparse.SUPPRESS)
    parser.add_argument("--artifacts", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    unknown = [path for path in args.paths.split(",") if path not in PATHS]
    if unknown:
        parser.error(f"unknown paths {unknown}; choose from {', '.join(PATHS)}")
    device = pick_device(args.device)
    settings = {
        "batch_size": args.batch, "input_length": LENGTH, "new_tokens": args.new_tokens, "dtype": args.dtype,
        "generation_config": "the model's own",
    }  # fmt: skip
    stem = f"warm-start-{args.tag}" if args.tag else "warm-start"
    results = results_file(args.out, stem, device, "warm-start", {"settings": settings, "results": []})
    for model in args.models.split(","):
        for path in args.paths.split(","):
            results.add(measure(args, model, path))
    results.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
