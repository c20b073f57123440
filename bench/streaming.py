"""Per-token streaming latency: one timing streamer on `model.generate` and on `cachelife.generate`, greedy, batch 1.

    python -m bench.streaming [--device auto] [--model llama-3.2-1b|tiny|llama|llama-small] [--dtype bfloat16]
                              [--prompt-length 32] [--new-tokens 64] [--stop-check-every 1,8]
                              [--steps-per-call 1] [--paths eager,auto,cachelife] [--warmups 2] [--repeats 5]
                              [--out DIR]

A streamer (a transformers `BaseStreamer`) notes `time.perf_counter()` at every `put()` and at `end()`.
`generate` puts the prompt first, then the new tokens (several calls in a row where a path hands over several
positions at once: cachelife at each host check, every `stop_check_every` steps); every new token counts as
arriving when the `put()` that carried it did. cachelife's first check comes after its first `stop_check_every`
steps, so the token the prefill chose arrives together with those. On one random prompt (seed 0) of
`--prompt-length` tokens, each path decodes exactly N new tokens (`min_new_tokens = max_new_tokens = N`) on its
own copy of the model (same seed, same weights, built by bench/padded.py) after `torch._dynamo.reset()`:
- `eager`: `model.generate`, dynamic cache;
- `auto`: `model.generate` with transformers' auto-compile (bench/decode.py's settings);
- `cachelife_checkN`: `cachelife.generate` (`fallback=True`, `--steps-per-call`) with `stop_check_every=N`,
  once per `--stop-check-every` value.
After `--warmups` calls (compilation), `--repeats` timed calls, each with a fresh streamer. Per path: time to
the first new token (from the call's start; median, min and max over the calls), the latency of every later
token (its arrival minus the previous token's; p50, p99, mean and max over every token of every call), the
mean ms per token from the first to the last, the time from the last token to `end()`, puts per call, whether
the streamed tokens equal those `eager` and `auto` streamed (bf16 may round differently on each path: the first
differing position is recorded) and the path's own returned tokens, and the WARNING lines logged under the
`cachelife` logger (a fallback's among them). The host's load averages at the start and the end are recorded
(CPU figures from a shared machine are as good as its quiet). Writes
`<out>/streaming-<model>-<device>-<date>-tf<version>.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
from attrs import frozen
from transformers import PreTrainedModel
from transformers.generation.streamers import BaseStreamer

import cachelife
from bench.decode import auto_compile
from bench.padded import MODEL_NAMES, build_model, cachelife_warnings, padded_prompts, release
from bench.results_file import bench_parser, results_file
from bench.timing import as_tokens, greedy, timed
from cachelife.tools import zoo
from cachelife.tools.recipe import pick_device


class TimingStreamer(BaseStreamer):
    """Notes when each `put()` and the `end()` came (seconds since `begin()`) and what each `put()` carried."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.puts: list[tuple[float, torch.Tensor]] = []
        self.ended: float | None = None

    def begin(self) -> None:
        """The call starts now."""
        self.started = time.perf_counter()

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        self.puts.append((now - self.started, value.detach().reshape(-1).clone()))

    def end(self) -> None:
        self.ended = time.perf_counter() - self.started


@frozen(kw_only=True)
class Streamed:
    """One call as its streamer saw it: the prompt, each new token and when it arrived (seconds since the call
    started), the puts that carried new tokens, and when `end()` came."""

    prompt: torch.Tensor
    tokens: torch.Tensor
    arrivals: tuple[float, ...]
    puts: int
    ended: float | None

    @classmethod
    def of(cls, streamer: TimingStreamer) -> Streamed:
        if not streamer.puts:
            msg = "the streamer got no put() at all: generate did not stream this call"
            raise RuntimeError(msg)
        (_, prompt), *rest = streamer.puts
        tokens = torch.cat([value for _, value in rest]) if rest else torch.empty(0, dtype=torch.long)
        arrivals = tuple(moment for moment, value in rest for _ in range(value.numel()))
        return cls(prompt=prompt, tokens=tokens, arrivals=arrivals, puts=len(rest), ended=streamer.ended)

    def latencies(self) -> list[float]:
        """Every token's arrival minus the previous one's, from the second token on (seconds)."""
        return [later - earlier for earlier, later in zip(self.arrivals, self.arrivals[1:], strict=False)]


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile `share` (0-100) of `values`."""
    ordered = sorted(values)
    rank = min(max(1, math.ceil(share / 100 * len(ordered))), len(ordered))
    return ordered[rank - 1]


def ms(seconds: float) -> float:
    return round(1000 * seconds, 4)


def spread(seconds: list[float]) -> dict[str, float]:
    """Median, min and max, in ms."""
    return {"median": ms(statistics.median(seconds)), "min": ms(min(seconds)), "max": ms(max(seconds))}


def summarise(calls: list[Streamed], call_s: list[float]) -> dict[str, Any]:
    """The latency figures of one path's timed calls (see the module docstring)."""
    first = [call.arrivals[0] for call in calls if call.arrivals]
    later = [latency for call in calls for latency in call.latencies()]
    spans = [
        (call.arrivals[-1] - call.arrivals[0]) / (len(call.arrivals) - 1) for call in calls if len(call.arrivals) > 1
    ]
    tails = [call.ended - call.arrivals[-1] for call in calls if call.ended is not None and call.arrivals]
    return {
        "time_to_first_token_ms": spread(first),
        "inter_token_ms": {
            "p50": ms(percentile(later, 50)), "p99": ms(percentile(later, 99)),
            "mean": ms(statistics.fmean(later)), "max": ms(max(later)), "tokens": len(later),
        },
        "ms_per_token_first_to_last": ms(statistics.median(spans)),
        "end_after_last_token_ms": ms(statistics.median(tails)) if tails else None,
        "call_ms": spread(call_s),
        "puts_per_call": sorted({call.puts for call in calls}),
        "new_tokens_streamed": sorted({int(call.tokens.numel()) for call in calls}),
    }  # fmt: skip


@frozen
class Plan:
    """One path: `model.generate`, or `cachelife.generate` (`ours`), with `extra` settings."""

    name: str
    extra: dict[str, Any]
    ours: bool = False


def plans(args: argparse.Namespace, device: torch.device) -> list[Plan]:
    wanted = args.paths.split(",")
    chosen = [Plan("eager", {})] if "eager" in wanted else []
    if "auto" in wanted:
        chosen.append(Plan("auto", auto_compile(device)))
    if "cachelife" in wanted:
        for check in (int(value) for value in args.stop_check_every.split(",")):
            settings = {"stop_check_every": check, "steps_per_call": args.steps_per_call}
            chosen.append(Plan(f"cachelife_check{check}", settings, ours=True))
    return chosen


@frozen
class Call:
    """One streamed call: what its streamer saw, its seconds, and whether the streamed tokens are the new tokens
    `generate` returned."""

    streamed: Streamed
    seconds: float
    streamed_is_output: bool


def call(plan: Plan, model: PreTrainedModel, inputs: zoo.Inputs, tokens: int, device: torch.device) -> Call:
    """One call of `plan`'s path for `tokens` new tokens, with a fresh streamer."""
    streamer = TimingStreamer()
    settings = {**inputs, **greedy(tokens), **plan.extra, "streamer": streamer}

    def run() -> torch.Tensor:
        streamer.begin()
        if plan.ours:
            return as_tokens(cachelife.generate(model, **settings))
        return as_tokens(model.generate(**settings))

    seconds, output = timed(device, run)
    streamed = Streamed.of(streamer)
    returned = output[0, inputs["input_ids"].shape[1] :].cpu()
    return Call(streamed, seconds, bool(torch.equal(streamed.tokens, returned)))


def measure(plan: Plan, args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Any], torch.Tensor]:
    """One path's figures after its warm-up calls, on a fresh model, and the tokens its first timed call
    streamed."""
    torch._dynamo.reset()  # each path pays its own compilation; no graphs carried over from the last
    model = build_model(args.model, device, getattr(torch, args.dtype))
    inputs = padded_prompts(model, [args.prompt_length])
    with cachelife_warnings() as warnings:
        for _ in range(args.warmups):
            call(plan, model, inputs, args.new_tokens, device)
        calls = [call(plan, model, inputs, args.new_tokens, device) for _ in range(args.repeats)]
    figures = summarise([one.streamed for one in calls], [one.seconds for one in calls])
    first = calls[0].streamed.tokens
    figures["repeat_calls_same_stream"] = all(torch.equal(one.streamed.tokens, first) for one in calls)
    figures["streamed_is_output"] = all(one.streamed_is_output for one in calls)
    figures["prompt_streamed_first"] = all(
        torch.equal(one.streamed.prompt, inputs["input_ids"][0].cpu()) for one in calls
    )
    figures["warnings"] = warnings
    figures["fallback"] = any("falls back" in line for line in warnings)
    del model
    release(device)
    return figures, first


def compare(tokens: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    """Whether two streams of new tokens are equal; if not, the first position where they differ."""
    if torch.equal(tokens, reference):
        return {"equal": True}
    common = min(tokens.numel(), reference.numel())
    differs = (tokens[:common] != reference[:common]).nonzero()
    first = int(differs[0]) if differs.numel() else common
    return {"equal": False, "first_difference_new_token": first, "lengths": [tokens.numel(), reference.numel()]}


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="llama-3.2-1b", choices=MODEL_NAMES)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--stop-check-every", default="1,8", help="cachelife.generate's stop_check_every values")
    parser.add_argument("--steps-per-call", type=int, default=1, help="cachelife.generate's steps_per_call")
    parser.add_argument("--paths", default="eager,auto,cachelife")
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = pick_device(args.device)
    body: dict[str, Any] = {"settings": vars(args).copy(), "load_average": [os.getloadavg()], "paths": {}}
    results = results_file(args.out, f"streaming-{args.model}", device, "streaming", body)
    streams: dict[str, torch.Tensor] = {}
    for plan in plans(args, device):
        figures, streams[plan.name] = measure(plan, args, device)
        for reference in ("eager", "auto"):
            if reference in streams and reference != plan.name:
                figures[f"streamed_vs_{reference}"] = compare(streams[plan.name], streams[reference])
        results.record["paths"][plan.name] = figures
        results.save()
        print(json.dumps({"path": plan.name, **figures}), flush=True)
    results.record["load_average"].append(os.getloadavg())
    results.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
