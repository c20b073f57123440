"""Levers on the decode step's kernel time: inductor options, attention kernels and cachelife's own kernels,
each alone and together.

    python -m bench.levers [--device cuda|cpu] [--model whisper-small] [--batch-size 1]
                           [--dtypes bfloat16,float32] [--presets baseline,...] [--tokens 128] [--logits]
                           [--eager-step]

`--model` is a zoo name (`cachelife.tools.zoo`: whisper-large-v3, whisper-large-v3-turbo, t5-small, ...) or
llama-3.2-1b (the Llama-3.2-1B shape of bench.padded). Encoder-decoder models read 48 encoder tokens (Whisper:
its 30 s of features), decoder-only models a prompt of 16 tokens. Each preset runs in a fresh process (nothing
compiled or set leaks from one to the next) with an empty TORCHINDUCTOR_CACHE_DIR, so its first call is a full
compilation. In it, on a model enabled with the preset's `cachelife.Options` (its levers and the inductor options
of the compiled step), `cachelife.generate` (the model's own generation config, exactly N new tokens, 1 step per
CUDA graph replay, inside `torch.nn.attention.sdpa_kernel(...)` where the preset picks attention kernels)
gives: the first call (seconds, compilation included), the marginal wall time per step and, on CUDA, the GPU
kernel time and kernel count per step ((long run - short run) / steps, profiled), and the first `--tokens`
tokens of the long run. Correctness against the baseline preset of the same dtype: the tokens must be equal
in float32; in other dtypes the fraction of equal tokens and, with `--logits`, the largest logit difference
over `--tokens` steps of a compiled forward (the same preset) fed the baseline's tokens (teacher forcing,
so every preset sees the same inputs; it costs each preset a second compilation). `--eager-step` runs the step
and the teacher-forced forward uncompiled, where inductor options do nothing: a quick check of the harness and
of the presets' `enable` options on a CPU. `--concurrent` starts every preset's process at once, so that
their first calls compile side by side (on a GPU host, most of a preset's time); each process then waits until
all have made their first call and takes its turn for everything timed, one process at a time, while the
others sleep. Its first calls are therefore compilations that shared the CPUs, longer than alone: the file
says so (`settings.concurrent_first_calls`).

Presets: baseline (defaults); max_autotune_gemm (GEMM templates autotuned); coordinate_descent
(coordinate_descent_tuning); combo_kernels; freezing (inductor's weights-as-constants pass, which
would concatenate projections of one input; it does not run for a step compiled as a function: README.md);
attention_math / attention_flash (SDPA restricted to the math kernels, which inductor fuses, or to flash and
memory-efficient attention, where the default picks cuDNN on an H200); attention_flex (the model's
`flex_attention` implementation, whose compiled kernels split the positions over blocks at one query); together
(`cachelife.FAST_KERNELS`: combo_kernels + coordinate_descent, the two that cut kernels in GPU run 17); fused
(`Options(fuse_projections=True)`); decode_attention (`Options(decode_attention=True)`: cachelife's split-KV
attention kernel, its torch fallback off CUDA); fused_decode_attention (both); all (`cachelife.FAST`: both, with
`cachelife.FAST_KERNELS`); pdl (inductor's programmatic dependent launch for its Triton kernels, Hopper and
newer: a kernel starts while the one before it ends); small_linear (`Options(small_linear=True)`: the step's
products of few rows through cachelife's Triton kernel); fused_small_linear (with fused projections); regions
(`Options(compile_regions=True)`: each layer class compiled once); all_regions (`cachelife.FAST` with regions).
Writes
`<out>/levers-<model>-b<batch>-<dtypes>[-<presets>]-<device>-<date>-tf<version>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import torch
from attrs import frozen
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

import cachelife
from bench.child import run_child
from bench.decode_loop import first_divergence
from bench.generate import build, settings_for
from bench.padded import build_model, padded_prompts
from bench.results_file import bench_parser, results_file
from bench.timing import as_tokens, kernels_per_step, timed
from cachelife.integration.call_arguments import cache_argument_name
from cachelife.integration.compiled import InductorOptions
from cachelife.tools import zoo
from cachelife.tools.recipe import pick_device

ENCODER_LENGTH = 48
PROMPT_LENGTH = 16
LLAMA = "llama-3.2-1b"


@frozen(kw_only=True)
class Preset:
    enable: cachelife.Options = cachelife.EXACT  # what the model is enabled with, the step's inductor options too
    attention: tuple[SDPBackend, ...] = ()  # empty: SDPA picks as by default
    attn_implementation: str | None = None  # set on the model after it is built; None: the model's default


def compiled_with(**options: bool) -> Preset:
    """The default levers, the step compiled with these inductor options."""
    return Preset(enable=cachelife.Options(compile_options=options))


PRESETS: dict[str, Preset] = {
    "baseline": Preset(enable=cachelife.EXACT),
    "max_autotune_gemm": compiled_with(max_autotune_gemm=True),
    "coordinate_descent": compiled_with(coordinate_descent_tuning=True),
    "combo_kernels": compiled_with(combo_kernels=True),
    "freezing": compiled_with(freezing=True),
    "attention_math": Preset(attention=(SDPBackend.MATH,)),
    "attention_flash": Preset(attention=(SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)),
    "attention_flex": Preset(attn_implementation="flex_attention"),
    "together": Preset(enable=cachelife.Options(compile_options=cachelife.FAST_KERNELS)),
    "fused": Preset(enable=cachelife.Options(fuse_projections=True)),
    "decode_attention": Preset(enable=cachelife.Options(decode_attention=True)),
    "fused_decode_attention": Preset(enable=cachelife.Options(fuse_projections=True, decode_attention=True)),
    "all": Preset(enable=cachelife.FAST),
    "pdl": compiled_with(**{"triton.enable_pdl": True}),
    "small_linear": Preset(enable=cachelife.Options(small_linear=True)),
    "fused_small_linear": Preset(enable=cachelife.Options(fuse_projections=True, small_linear=True)),
    "regions": Preset(enable=cachelife.Options(compile_regions=True)),
    "all_regions": Preset(enable=attrs.evolve(cachelife.FAST, compile_regions=True)),
}


def model_and_inputs(
    name: str, batch: int, device: torch.device, dtype: torch.dtype
) -> tuple[PreTrainedModel, zoo.Inputs]:
    """The named model (see the module docstring) and its inputs for `batch` rows."""
    if name == LLAMA:
        model = build_model(name, device, dtype)
        return model, padded_prompts(model, [PROMPT_LENGTH] * batch, seed=1)
    built = build(name, False, device, dtype)
    length = ENCODER_LENGTH if built.model.config.is_encoder_decoder else PROMPT_LENGTH
    return built.model, built.inputs(batch, length, 1)


@contextlib.contextmanager
def attention_of(preset: Preset) -> Iterator[None]:
    if not preset.attention:
        yield
        return
    with sdpa_kernel(list(preset.attention), set_priority=True):
        yield


def kernel_profile(device: torch.device, run: Any, short: int, long: int) -> dict[str, float] | None:
    """GPU kernel milliseconds and kernels per step, (long run - short run) / (long - short); None off CUDA."""
    measured = kernels_per_step(device, run, short, long)
    if measured is None:
        return None
    return {"kernel_ms_per_step": round(measured[0], 4), "kernels_per_step": round(measured[1], 2)}


def ready_marker(scratch: Path, preset: str) -> Path:
    return scratch / f"ready-{preset}"


@contextlib.contextmanager
def timing_turn(scratch: Path, preset: str, processes: int) -> Iterator[None]:
    """With `processes` > 1 (--concurrent): mark this preset's first call done, wait until every preset's is
    (the parent marks a process that ended early), then hold the scratch folder's lock, one process at a time."""
    if processes <= 1:
        yield
        return
    ready_marker(scratch, preset).touch()
    while len(list(scratch.glob("ready-*"))) < processes:
        time.sleep(0.2)
    with open(scratch / "timing.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def teacher_forced_logits(
    model: PreTrainedModel, inputs: zoo.Inputs, tokens: torch.Tensor, preset: Preset, *, compiled: bool = True
) -> torch.Tensor:
    """Logits (steps, batch, vocab) of the model's compiled (or eager) forward fed `tokens` one at a time on a
    pinned cache: every preset sees the same inputs, so the differences are the preset's numerics alone."""
    if compiled:
        mode = "reduce-overhead" if model.device.type == "cuda" else None
        options: InductorOptions = {**preset.enable.compile_options, "emulate_precision_casts": True}  # as the step
        cachelife.compile_forward(model, mode=mode, fullgraph=True, options=options)
    key = "decoder_input_ids" if model.config.is_encoder_decoder else "input_ids"
    batch, steps = int(tokens.shape[0]), int(tokens.shape[1]) - 1
    logits = []
    with torch.no_grad(), cachelife.pinned_compile_cache():
        kwargs: dict[str, Any] = {}
        encoder_length = None
        if model.config.is_encoder_decoder:
            hidden = model.get_encoder()(**inputs)[0]
            torch._dynamo.mark_static_address(hidden)
            kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
            encoder_length = int(hidden.shape[1])
        cache = cachelife.prepare_static_cache(
            model, batch_size=batch, max_cache_len=steps + 1, encoder_length=encoder_length
        )
        kwargs[cache_argument_name(model)] = cache
        for index in range(steps):
            position = torch.tensor([index], device=model.device)
            output = model(**{key: tokens[:, index : index + 1]}, cache_position=position, use_cache=True, **kwargs)
            logits.append(output.logits[:, -1].float().clone())
    return torch.stack(logits)


def child(args: argparse.Namespace) -> None:
    """One fresh process: time and check `cachelife.generate` with the preset's options and attention."""
    preset = PRESETS[args.child]
    device = pick_device(args.device)
    dtype = getattr(torch, args.dtype)
    model, inputs = model_and_inputs(args.model, args.batch_size, device, dtype)
    cachelife.enable(model, options=preset.enable)  # the step's inductor options too
    if preset.attn_implementation is not None:
        model.set_attn_implementation(preset.attn_implementation)

    def run(tokens: int) -> torch.Tensor:
        out = cachelife.generate(
            model, fallback=False, compile_step=not args.eager_step, **inputs, **settings_for(args.model, 0, tokens)
        )
        return as_tokens(out)

    scratch = Path(args.scratch)
    with attention_of(preset):
        first_call_s, tokens = timed(device, lambda: run(args.long))
        tokens = tokens[:, : tokens.shape[1] - args.long + args.tokens]  # the first --tokens new tokens
        torch.save(tokens.cpu(), scratch / f"{args.child}-tokens.pt")
        with timing_turn(scratch, args.child, args.processes):
            run(args.short)
            short = min(timed(device, lambda: run(args.short))[0] for _ in range(3))
            long = min(timed(device, lambda: run(args.long))[0] for _ in range(3))
            record: dict[str, Any] = {
                "preset": args.child,
                "options": dict(preset.enable.compile_options),
                "attention": [backend.name for backend in preset.attention],
                "enable": {
                    name: value for name, value in attrs.asdict(preset.enable).items() if name != "compile_options"
                },
                "attn_implementation": model.config._attn_implementation,
                "first_call_s": round(first_call_s, 3),
                "wall_ms_per_step": round(1000 * (long - short) / (args.long - args.short), 4),
                "kernels": kernel_profile(device, run, args.short, args.long),
                "max_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)
                if device.type == "cuda"
                else None,
            }
            if dtype != torch.float32 and args.logits:
                reference = tokens if args.child == "baseline" else torch.load(scratch / "baseline-tokens.pt")
                logits = teacher_forced_logits(
                    model, inputs, reference.to(device), preset, compiled=not args.eager_step
                )
                torch.save(logits.cpu(), scratch / f"{args.child}-logits.pt")
    print("RESULT " + json.dumps(record), flush=True)


def run_preset(preset: str, args: argparse.Namespace, dtype: str, scratch: Path, processes: int) -> dict[str, Any]:
    """Run one preset in a fresh process with an empty compile cache, `processes` of them at once; its record.
    A process that ends early is marked ready for the others' `timing_turn`."""
    arguments = [
        "--child", preset, "--scratch", str(scratch), "--device", args.device, "--model", args.model,
        "--batch-size", str(args.batch_size), "--dtype", dtype, "--tokens", str(args.tokens),
        "--short", str(args.short), "--long", str(args.long), "--processes", str(processes),
        *(["--logits"] if args.logits else []), *(["--eager-step"] if args.eager_step else []),
    ]  # fmt: skip
    try:
        record, process = run_child("bench.levers", arguments, scratch / f"cache-{preset}")
    finally:
        ready_marker(scratch, preset).touch()
    if record is None:
        return {"preset": preset, "returncode": process["returncode"], "stderr_tail": process["stderr_tail"]}
    record["process_s"] = round(process["process_s"], 1)
    return record


def correctness(scratch: Path, preset: str, dtype: str, logits: bool) -> dict[str, Any]:
    """Tokens against the baseline's (equal, or the fraction equal), and the largest logit difference."""
    tokens, reference = (torch.load(scratch / f"{name}-tokens.pt") for name in (preset, "baseline"))
    result: dict[str, Any] = {
        "tokens_equal": bool(torch.equal(tokens, reference)),
        "token_agreement": round(float((tokens == reference).float().mean()), 4),
        "first_divergence": first_divergence(tokens, reference),
    }
    if dtype != "float32" and logits:
        preset_logits, baseline = (torch.load(scratch / f"{name}-logits.pt") for name in (preset, "baseline"))
        result["max_logit_diff"] = float((preset_logits - baseline).abs().max())
        result["teacher_forced_argmax_agreement"] = round(
            float((preset_logits.argmax(-1) == baseline.argmax(-1)).float().mean()), 4
        )
    return result


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="whisper-small", choices=(*zoo.MODEL_NAMES, LLAMA))
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--presets", default=",".join(PRESETS), help=f"any of {', '.join(PRESETS)}")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens compared with the baseline")
    parser.add_argument("--short", type=int, default=128, help="new tokens of the short timed run")
    parser.add_argument("--long", type=int, default=188, help="new tokens of the long timed run")
    parser.add_argument("--logits", action="store_true", help="teacher-forced logit differences (not in float32)")
    parser.add_argument("--eager-step", action="store_true", help="the step uncompiled: a quick check of the harness")
    parser.add_argument("--concurrent", action="store_true", help="compile every preset at once, then time in turn")
    parser.add_argument("--child", choices=PRESETS, help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    if not 0 < args.short < args.long or args.tokens > args.long:
        parser.error(
            f"expected 0 < --short < --long and --tokens <= --long, got {args.short}, {args.long}, {args.tokens}"
        )
    presets = ["baseline", *(name for name in args.presets.split(",") if name != "baseline")]
    unknown = [name for name in presets if name not in PRESETS]
    if unknown:
        parser.error(f"unknown presets {unknown}; choose from {', '.join(PRESETS)}")
    device = pick_device(args.device)
    settings = {
        "model": args.model, "batch_size": args.batch_size, "encoder_input_length": ENCODER_LENGTH,
        "prompt_length": PROMPT_LENGTH, "tokens": args.tokens,
        "timed_new_tokens": [args.short, args.long], "steps_per_call": 1, "compiled_step": not args.eager_step,
        "concurrent_first_calls": args.concurrent,
    }  # fmt: skip
    chosen = "" if set(presets) == set(PRESETS) else "-" + "-".join(presets[1:] or presets)
    eager = "-eager-step" if args.eager_step else ""
    stem = f"levers-{args.model}-b{args.batch_size}-{args.dtypes.replace(',', '-')}{chosen}{eager}"
    results = results_file(args.out, stem, device, "levers", {"settings": settings, "results": []})
    for dtype in args.dtypes.split(","):
        with tempfile.TemporaryDirectory(prefix="levers-") as scratch:
            processes = len(presets) if args.concurrent else 1
            run = functools.partial(run_preset, args=args, dtype=dtype, scratch=Path(scratch), processes=processes)
            with ThreadPoolExecutor(processes) as pool:
                records = list(pool.map(run, presets))
            for record in records:
                if "returncode" not in record:
                    record["correctness"] = correctness(Path(scratch), record["preset"], dtype, args.logits)
                results.add({"dtype": dtype, **record})
    results.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
