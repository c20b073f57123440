"""Where a step of `cachelife.Engine` goes, with every row decoding: wall time, kernel time by kind, idle device.

    python -m bench.engine_step [--device cuda] [--model llama-3.2-1b] [--dtype bfloat16] [--rows 1,16]
                                [--max-length 512] [--prompt 64] [--window 0.5]
                                [--enable none,decode_attention/fuse_projections] [--out DIR]

For each `--rows` value an `Engine(rows=N, max_length=--max-length)` gets N requests of `--prompt` tokens that each
decode to the end of the cache (`min_new_tokens = max_new_tokens`), so that every row decodes through the
measurement and nobody joins. Once every row decodes and 16 more steps ran, for `--window` seconds and at least 4
steps: the scheduler's step calls (wall ms per step: the whole boundary, host work included), and under
torch.profiler (device activity alone) the device's kernels, grouped by kind as bench/profile_step.py groups them
(ms per step and kernels per step) and the kernels that took the most time, and the device's idle time (the
window's span less the union of its kernels' intervals, per step): how much of a step the device waits for the
host, by the group of the kernel that ends each wait (`idle_ms_per_step_before`). Each measurement also gives the
ratio of its wall ms per step to the first one's (the first options set's first rows value).
Then the first two rows decode to their end and are judged against transformers (bench.verdict, tokens).
`--enable` measures every rows value once per set of `cachelife.Options` levers (`/` between sets, `,` between
the options of one set, `none` for none): the model is enabled with the set's options True and every other
lever False (fused projections too, which `enable` turns on by default), measured, and disabled again; `none`
leaves the model as it is, not enabled. So every lever's wall time per step is measured beside none in one
process.
Writes `<out>/engine-step-<model>-<device>-<date>-tf<version>.json`. A benchmark, not a timed test.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.profiler import DeviceType, ProfilerActivity, profile

from bench.padded import MODEL_NAMES, build_model
from bench.profile_step import GROUPS, OTHER, group_of
from bench.results_file import bench_parser, results_file
from bench.timing import NAME_LENGTH, TOP_KERNELS, timeline
from bench.verdict import judge
from cachelife.integration.enabling import disable, enable
from cachelife.integration.options import Options
from cachelife.integration.rewrites import REWRITES
from cachelife.serving.engine import Engine
from cachelife.serving.step_attention import StepAttention, check_attention
from cachelife.tools import zoo
from cachelife.tools.recipe import pick_device


def device_kernels(profiler: Any) -> list[tuple[str, int, int]]:
    """(name, start ns, end ns) of every device kernel the profiler saw."""
    kernels = []
    for event in profiler.profiler.kineto_results.events():
        if event.device_type() == DeviceType.CUDA and event.duration_ns() > 0:
            start = event.start_ns()
            kernels.append((event.name(), start, start + event.duration_ns()))
    return kernels


def option_sets(text: str) -> list[tuple[str, ...]]:
    """`--enable`'s sets of `cachelife.Options` levers: `/` between sets, `,` within one, `none` for none."""
    sets = []
    for part in text.split("/"):
        names = tuple(name for name in part.split(",") if name and name != "none")
        unknown = set(names) - set(LEVERS)
        if unknown:
            msg = f"--enable takes {', '.join(LEVERS)} or none, got {', '.join(sorted(unknown))}"
            raise SystemExit(msg)
        sets.append(names)
    return sets


# The fewest steps a wall time is taken over, when `--window` seconds hold fewer.
MIN_STEPS = 4
# Whisper's longest decoder prompt: start of transcript, language, task, no timestamps.
WHISPER_DECODER_PROMPT = 4
# The boolean fields of `cachelife.Options`, one rewrite each.
LEVERS = tuple(rewrite.option for rewrite in REWRITES)


@contextmanager
def enabled(model: Any, levers: tuple[str, ...]) -> Iterator[None]:
    """The model enabled with `levers` on (`cachelife.Options`) for the block, disabled after; nothing for none."""
    if not levers:
        yield
        return
    on: dict[str, Any] = {name: name in levers for name in LEVERS}  # explicit: fused projections default on
    enable(model, options=Options(**on))
    try:
        yield
    finally:
        disable(model)


def step_requests(model: Any, rows: int, args: Any) -> list[dict[str, Any]]:
    """`rows` requests that each decode to the end of the cache: prompts of `--prompt` tokens for a decoder-only
    model, random audio features (English, so one decoder prompt) for Whisper."""
    generator = torch.Generator().manual_seed(rows)
    if model.config.model_type == "whisper":
        new = args.max_length - WHISPER_DECODER_PROMPT
        frames = 2 * model.config.max_source_positions
        shape = (1, model.config.num_mel_bins, frames)
        language = {"language": "en"} if getattr(model.generation_config, "lang_to_id", None) else {}
        return [
            {"input_features": torch.randn(shape, generator=generator).to(model.device, model.dtype),
             **language, "max_new_tokens": new, "min_new_tokens": new}
            for _ in range(rows)
        ]  # fmt: skip
    new = args.max_length - args.prompt - 1
    vocab = int(model.config.vocab_size)
    return [
        {"input_ids": torch.randint(4, vocab, (1, args.prompt), generator=generator).to(model.device),
         "max_new_tokens": new, "min_new_tokens": new}
        for _ in range(rows)
    ]  # fmt: skip


def measure(model: Any, rows: int, attention: StepAttention, args: Any) -> dict[str, Any]:
    requests = step_requests(model, rows, args)
    with Engine(model, rows=rows, max_length=args.max_length, queue_size=0, attention=attention) as engine:
        futures = [engine.submit(**request) for request in requests]
        while engine.stats().decoding < rows:
            time.sleep(0.001)
        warm = engine.stats().steps + 16  # past the first calls (compilation, capture)
        while engine.stats().steps < warm:
            time.sleep(0.001)
        before, began = engine.stats(), time.perf_counter()
        time.sleep(args.window)
        # However slow a step (Triton's interpreter on a CPU), the wall time is taken over a few steps at least.
        while engine.stats().steps - before.steps < MIN_STEPS and engine.stats().decoding == rows:
            time.sleep(0.001)
        after, ended = engine.stats(), time.perf_counter()
        wall_steps = after.steps - before.steps
        if wall_steps < MIN_STEPS:
            msg = f"the rows ended after {wall_steps} timed steps (at least {MIN_STEPS}): raise --max-length"
            raise SystemExit(msg)
        # Device activity alone: tracing the host's operators would slow the host and widen the device's gaps.
        # A CPU has no device timeline: its wall time alone is measured.
        profiler = None
        if model.device.type == "cuda":
            with profile(activities=[ProfilerActivity.CUDA]) as profiler:
                profiled_before = engine.stats()
                time.sleep(args.window)
                profiled_after = engine.stats()
            # The rows decoded what transformers computes (bench.verdict, tokens), on the first two of a
        # decoder-only model (Whisper's processors suppress tokens, which the raw greedy verdict does not know).
        judged = 0 if model.config.is_encoder_decoder else 2
        outputs = [future.result() for future in futures[:judged]]
        for future in futures[judged:]:
            future.cancel()
    measured: dict[str, Any] = {
        "rows": rows,
        "attention": attention,
        "wall_ms_per_step": round((ended - began) * 1e3 / wall_steps, 4),
        "steps_timed": wall_steps,
    }
    verdicts = [
        judge(model, {"input_ids": request["input_ids"]}, tokens, args.prompt)
        for request, tokens in zip(requests, outputs, strict=False)
    ]
    if verdicts:
        measured["verdict_rows"] = len(verdicts)
        measured["tokens_agree_with_transformers"] = all(v["tokens_agree_with_transformers"] for v in verdicts)
        measured["largest_gap_over_margin"] = max(v["largest_gap_over_margin"] for v in verdicts)
    if profiler is None:
        return measured
    steps = max(profiled_after.steps - profiled_before.steps, 1)
    return {**measured, "steps_profiled": steps, **kernel_figures(device_kernels(profiler), steps)}


def kernel_figures(kernels: list[tuple[str, int, int]], steps: int) -> dict[str, Any]:
    """Per step, from the (name, start ns, end ns) of the kernels of `steps` steps: kernel, busy and idle time,
    the idle time before each group's kernels, each group's kernels and time, and the `TOP_KERNELS` names that
    took the most time."""
    names = [name for name, _ in GROUPS] + [OTHER]
    groups: dict[str, dict[str, float]] = {name: {"ms_per_step": 0.0, "kernels_per_step": 0.0} for name in names}
    for name, start, end in kernels:
        group = groups[group_of(name)]
        group["ms_per_step"] += (end - start) / 1e6 / steps
        group["kernels_per_step"] += 1 / steps
    seen = timeline((name, start / 1e6, end / 1e6) for name, start, end in kernels)
    top = sorted(seen.by_name.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
    return {
        "kernel_ms_per_step": round(seen.kernel_ms / steps, 4),
        "device_busy_ms_per_step": round(seen.busy_ms / steps, 4),
        "device_idle_ms_per_step": round((seen.span_ms - seen.busy_ms) / steps, 4),
        "idle_ms_per_step_before": {
            group: round(ms / steps, 4) for group, ms in sorted(seen.idle_ms_before.items(), key=lambda item: -item[1])
        },
        "kernels_per_step": round(len(kernels) / steps, 1),
        "groups": {name: {key: round(value, 4) for key, value in group.items()} for name, group in groups.items()},
        "top": [
            {
                "kernel": name[:NAME_LENGTH],
                "kernels_per_step": round(count / steps, 2),
                "ms_per_step": round(ms / steps, 4),
            }
            for name, (count, ms) in top
        ],
    }


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted({*MODEL_NAMES, *zoo.MODEL_NAMES}))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--window", type=float, default=0.5, help="seconds timed, and seconds profiled")
    parser.add_argument("--enable", default="none", help="sets of cachelife.enable options, '/' between sets")
    parser.add_argument("--attention", default="auto", help="the Engine's attention values measured (a, b, ...)")
    args = parser.parse_args()
    sets = option_sets(args.enable)
    attentions = [check_attention(attention) for attention in args.attention.split(",")]
    device = pick_device(args.device)
    dtype = getattr(torch, args.dtype)
    model = (
        build_model(args.model, device, dtype)
        if args.model in MODEL_NAMES
        else zoo.build(args.model, device=device, dtype=dtype).model
    )
    model.generation_config.eos_token_id = None  # every row decodes to its length
    out = results_file(args.out, f"engine-step-{args.model}", device, "bench.engine_step", {
        "model": args.model, "dtype": args.dtype, "max_length": args.max_length, "prompt": args.prompt,
        "window_s": args.window, "results": [],
    })  # fmt: skip
    first: float | None = None
    for options in sets:
        with enabled(model, options):
            for attention, rows in itertools.product(attentions, (int(part) for part in args.rows.split(","))):
                measured = {"enable": list(options), **measure(model, rows, attention, args)}
                first = measured["wall_ms_per_step"] if first is None else first
                measured["wall_ratio_to_first"] = round(measured["wall_ms_per_step"] / first, 3)
                out.add(measured)
    out.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
