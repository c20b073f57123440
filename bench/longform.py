"""Whisper long-form transcription with timestamps: `cachelife.generate` against transformers' long-form loop.

    python -m bench.longform [--device auto] [--model whisper-large-v3] [--dtype bfloat16] [--minutes 5]
                             [--new-tokens 64] [--paths eager,auto,forward,cachelife] [--repeats 2]
                             [--tiny] [--out DIR]

One process, one input: `--minutes` of seeded random log-mel features (100 frames per second), decoded by
Whisper's sequential long-form loop (`return_timestamps=True`, language "en", task "transcribe", the model's
own generation config, at most `--new-tokens` tokens per segment), on each path's own model instance (same
seed, same weights):
- `eager`: `model.generate`, dynamic cache (transformers' long-form as released);
- `auto`: transformers' auto-compile (static cache, `compile_config`);
- `forward`: `generate` with a compiled forward (`reduce-overhead` on CUDA, casts rounded as eager rounds them)
  and `cachelife.enable`: the reference for bfloat16 tokens, whose rounding differs from eager's;
- `cachelife`: `cachelife.generate(fallback=False)`: every segment on the fast path, or an error.
Reported per path: the first call (compilation included), the best of `--repeats` later calls in wall seconds,
the real-time factor (wall seconds per second of audio), the segments and tokens decoded, the speedup of
cachelife over each path, and whether the tokens and segment boundaries equal the reference's (float32:
eager; other dtypes: the compiled forward). Writes `<out>/longform-<model>-<device>-<date>-tf<version>.json`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

import cachelife
from bench.decode import auto_compile
from bench.results_file import bench_parser, results_file
from bench.timing import timed
from cachelife.tools import zoo
from cachelife.tools.recipe import pick_device

FRAMES_PER_SECOND = 100
Run = Callable[[], dict[str, Any]]


def build(name: str, tiny: bool, device: torch.device, dtype: torch.dtype) -> zoo.ZooModel:
    built = zoo.build("whisper" if tiny else name, device=device, dtype=dtype)
    if tiny:
        zoo.whisper_tiny_generation(built.model.generation_config)
    return built


def audio(model: Any, seconds: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Seeded log-mel features of `seconds` of audio, at the model's 100 frames per second (tiny models: the
    same number of their own windows)."""
    window = 2 * int(model.config.max_source_positions)  # frames in one 30-s window
    frames = round(seconds * FRAMES_PER_SECOND * window / 3000)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, int(model.config.num_mel_bins), frames, generator=generator)
    return features.to(device=device, dtype=dtype)


def settings(new_tokens: int) -> dict[str, Any]:
    return {
        "return_timestamps": True, "return_segments": True, "language": "en", "task": "transcribe",
        "max_new_tokens": new_tokens,
    }  # fmt: skip


def summary(output: object) -> dict[str, Any]:
    """The tokens and the segments' boundaries of a long-form result."""
    if not isinstance(output, dict) or "sequences" not in output:
        msg = f"expected Whisper's dict of sequences and segments, got {type(output).__name__}"
        raise TypeError(msg)
    segments = output["segments"][0]
    return {
        "sequences": output["sequences"],
        "boundaries": [(float(s["start"]), float(s["end"])) for s in segments],
        "segment_tokens": sum(int(s["tokens"].numel()) for s in segments),
    }


def paths(args: Any, device: torch.device, dtype: torch.dtype) -> dict[str, Run]:
    """Each path's call on its own model instance (same seed, same weights)."""
    wanted = args.paths.split(",")
    runs: dict[str, Run] = {}
    call = settings(args.new_tokens)
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    features = audio(build(args.model, args.tiny, device, dtype).model, 60 * args.minutes, device, dtype)
    inputs: dict[str, Any] = {"input_features": features}
    if "eager" in wanted:
        eager = build(args.model, args.tiny, device, dtype).model
        runs["eager"] = lambda: summary(eager.generate(**inputs, **call))
    if "auto" in wanted:
        auto = build(args.model, args.tiny, device, dtype).model
        static = auto_compile(device)
        runs["auto"] = lambda: summary(auto.generate(**inputs, **call, **static))
    if "forward" in wanted:
        forward = cachelife.enable(build(args.model, args.tiny, device, dtype).model)
        cachelife.compile_forward(forward, mode=mode, fullgraph=True, options={"emulate_precision_casts": True})
        runs["forward"] = lambda: summary(forward.generate(**inputs, **call, cache_implementation="static"))
    if "cachelife" in wanted:
        ours = cachelife.enable(build(args.model, args.tiny, device, dtype).model)
        runs["cachelife"] = lambda: summary(
            cachelife.generate(ours, fallback=False, steps_per_call=args.steps_per_call, **inputs, **call)
        )
    return runs


def _timed(device: torch.device, run: Run) -> tuple[float, dict[str, Any]]:
    kept: dict[str, Any] = {}

    def call() -> torch.Tensor:
        kept.update(run())
        tokens: torch.Tensor = kept["sequences"]
        return tokens

    seconds, _ = timed(device, call)
    return seconds, kept


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="whisper-large-v3")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--new-tokens", type=int, default=64, help="max_new_tokens of each segment")
    parser.add_argument("--steps-per-call", type=int, default=4, help="cachelife.generate's steps_per_call")
    parser.add_argument("--paths", default="eager,auto,forward,cachelife")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="the zoo's tiny Whisper with the same settings")
    args = parser.parse_args()
    device = pick_device(args.device)
    dtype = getattr(torch, args.dtype)
    seconds_of_audio = 60 * args.minutes
    stem = f"longform-{'tiny' if args.tiny else args.model}"
    results = results_file(args.out, stem, device, "longform", {"settings": vars(args), "paths": {}})
    outputs: dict[str, dict[str, Any]] = {}
    rows: dict[str, dict[str, Any]] = {}
    for path, run in paths(args, device, dtype).items():
        first_s, outputs[path] = _timed(device, run)
        best = min(_timed(device, run)[0] for _ in range(args.repeats))
        rows[path] = {
            "first_call_s": round(first_s, 3),
            "wall_s": round(best, 3),
            "real_time_factor": round(best / seconds_of_audio, 5),
            "segments": len(outputs[path]["boundaries"]),
            "segment_tokens": outputs[path]["segment_tokens"],
        }
        print(json.dumps({"path": path, **rows[path]}), flush=True)
    reference_path = "eager" if dtype == torch.float32 else "forward"
    reference = outputs.get(reference_path)
    for path, output in outputs.items():
        same = reference is not None and torch.equal(output["sequences"], reference["sequences"])
        rows[path]["tokens_equal_reference"] = same if reference is not None else None
        rows[path]["segments_equal_reference"] = (
            output["boundaries"] == reference["boundaries"] if reference is not None else None
        )
    ours = rows.get("cachelife")
    if ours is not None:
        for row in rows.values():
            row["cachelife_speedup"] = round(row["wall_s"] / ours["wall_s"], 3)
    results.put("reference", reference_path)
    results.put("seconds_of_audio", seconds_of_audio)
    results.put("paths", rows)
    results.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
